"""``kernels.launch``: a launch goes through Triton once per specialization, then straight to
the compiled kernel with every argument in signature order. (Under the interpreter every
launch goes through Triton, so these tests stand in for GPU launches with a recording
kernel; the GPU tests run the real ones.)"""

import inspect
import weakref

import pytest
import torch

from titan_megamoe.kernels import launch as launching


def _kernel():
    """A fake JIT function of signature ``(x, n, flag, y, BLOCK: constexpr, MODE: constexpr = 3)``."""

    def fn(x, n, flag, y, BLOCK: "tl.constexpr", MODE: "tl.constexpr" = 3):  # noqa: F821
        pass

    class Param:
        def __init__(self, p):
            self.is_constexpr = "constexpr" in str(p.annotation)

    class Compiled:
        def __init__(self, seen):
            self.seen = seen

        def __getitem__(self, grid):
            return lambda *args: self.seen.append(("compiled", grid, args))

    class Kernel:
        def __init__(self):
            self.fn = fn
            self.params = [Param(p) for p in inspect.signature(fn).parameters.values()]
            self.seen = []

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                self.seen.append(("jit", grid, args, kwargs))
                return Compiled(self.seen)
            return run

    return Kernel()


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(launching, "INTERPRET", False)
    monkeypatch.setattr(launching, "_COMPILED", {})
    monkeypatch.setattr(launching, "_RECENT", {})
    monkeypatch.setattr(launching, "_current_device", lambda: 0)


def test_later_launches_go_straight_to_the_compiled_kernel_with_every_argument(on_gpu):
    kernel = _kernel()
    x, y = torch.zeros(8), torch.zeros(8)
    launching.launch(kernel, (4,), x, 32, True, y, BLOCK=16, num_warps=4)
    launching.launch(kernel, (5, 2), y, 48, False, x, BLOCK=16, num_warps=4)
    assert [s[0] for s in kernel.seen] == ["jit", "compiled"]
    # Constexprs and defaults included, the grid padded to three dimensions.
    assert kernel.seen[1][1:] == ((5, 2, 1), (y, 48, False, x, 16, 3))


@pytest.mark.parametrize("change", [
    "constexpr", "option", "dtype", "alignment", "one", "multiple_of_16", "int64", "bool_to_int",
])
def test_what_triton_specializes_on_takes_triton_s_path_again(on_gpu, change):
    kernel = _kernel()
    x = torch.zeros(64, dtype=torch.uint8)
    base = dict(args=[x, 32, True, None], kwargs=dict(BLOCK=16, num_warps=4))
    changed = dict(args=list(base["args"]), kwargs=dict(base["kwargs"]))
    if change == "constexpr":
        changed["kwargs"]["BLOCK"] = 32
    elif change == "option":
        changed["kwargs"]["num_warps"] = 8
    elif change == "dtype":
        changed["args"][0] = x.view(torch.int8)
    elif change == "alignment":
        changed["args"][0] = x[1:]
    elif change == "one":
        changed["args"][1] = 1
    elif change == "multiple_of_16":
        changed["args"][1] = 33
    elif change == "int64":
        changed["args"][1] = 2**32
    elif change == "bool_to_int":
        changed["args"][2] = 2
    launching.launch(kernel, (1,), *base["args"], **base["kwargs"])
    launching.launch(kernel, (1,), *changed["args"], **changed["kwargs"])
    launching.launch(kernel, (1,), *changed["args"], **changed["kwargs"])
    assert [s[0] for s in kernel.seen] == ["jit", "jit", "compiled"], change


def test_a_steady_launch_keys_only_the_arguments_that_are_new_objects(on_gpu, monkeypatch):
    kernel = _kernel()
    buffer = torch.zeros(8)
    for _ in range(2):  # the first compiles, the second finds the compiled kernel
        launching.launch(kernel, (1,), torch.zeros(8), 4096, True, buffer, BLOCK=16)
    keyed = []
    key_of = launching._key_of
    monkeypatch.setattr(launching, "_key_of", lambda value, c: keyed.append(value) or key_of(value, c))
    x = torch.zeros(8)
    launching.launch(kernel, (1,), x, 4096 + int("0"), True, buffer, BLOCK=16)
    # The new tensor and the equal but new integer are keyed; the buffer, the bool and the
    # constexprs are not.
    assert keyed == [x, 4096]
    assert [s[0] for s in kernel.seen] == ["jit", "compiled", "compiled"]
    assert kernel.seen[-1][2][0] is x


def test_kernels_launched_in_turns_of_specializations_keep_each_one(on_gpu):
    kernel = _kernel()
    small, wide = torch.zeros(8), torch.zeros(8, dtype=torch.float64)
    for _ in range(3):
        launching.launch(kernel, (1,), small, 32, True, None, BLOCK=16)
        launching.launch(kernel, (1,), wide, 32, True, None, BLOCK=64)
    assert [s[0] for s in kernel.seen] == ["jit", "jit"] + ["compiled"] * 4
    assert len(launching._RECENT[kernel]) == 2


def test_a_launch_keeps_no_call_s_tensor_alive(on_gpu):
    """A tensor that changes from launch to launch (a call's own) is not kept; one passed
    again and again (a buffer) is, until a launch passes another in its place."""
    kernel = _kernel()
    buffer = torch.zeros(8)
    for _ in range(3):
        x = torch.zeros(8)
        launching.launch(kernel, (1,), x, 32, True, buffer, BLOCK=16)
    call_s, buffer_s = weakref.ref(x), weakref.ref(buffer)
    kernel.seen.clear()
    del x, buffer
    assert call_s() is None and buffer_s() is not None
    launching.launch(kernel, (1,), torch.zeros(8), 32, True, torch.zeros(8), BLOCK=16)
    assert buffer_s() is None
    # A new tensor in a released one's place is keyed, not taken for it: another dtype compiles.
    launching.launch(kernel, (1,), torch.zeros(8, dtype=torch.int32), 32, True, None, BLOCK=16)
    assert [s[0] for s in kernel.seen] == ["compiled", "jit"]


def test_a_tensor_that_failed_a_recent_launch_s_key_is_never_taken_for_it(on_gpu):
    """An unaligned view fails the aligned launch's key and compiles its own kernel; passed
    again, it must reach that kernel, not the aligned one it was once compared with."""
    kernel = _kernel()
    x = torch.zeros(64, dtype=torch.uint8)
    for _ in range(3):  # compiled, recorded as a recent launch, then held as passed again
        launching.launch(kernel, (1,), x, 32, True, None, BLOCK=16)
    unaligned = x[1:]
    for _ in range(3):
        launching.launch(kernel, (1,), unaligned, 32, True, None, BLOCK=16)
    aligned_kernel, unaligned_kernel = launching._COMPILED.values()
    assert [s[0] for s in kernel.seen] == ["jit", "compiled", "compiled", "jit", "compiled", "compiled"]
    # The view's launches found its own kernel: it is a recent launch beside the aligned one.
    assert [seen.compiled for seen in launching._RECENT[kernel]] == [unaligned_kernel, aligned_kernel]


def test_a_tma_descriptor_is_keyed_by_its_tile_not_its_tensor(on_gpu):
    """The Gluon core's descriptors: a new tensor of another extent reuses the compiled
    kernel; another tile or dtype compiles again."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def descriptor(rows, block, dtype=torch.bfloat16):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
        return TensorDescriptor.from_tensor(torch.zeros(rows, 64, dtype=dtype), block, layout)

    kernel = _kernel()
    for desc in (descriptor(256, [128, 64]), descriptor(512, [128, 64]), descriptor(256, [64, 64]),
                 descriptor(256, [128, 64], torch.float16)):
        launching.launch(kernel, (1,), desc, 32, True, None, BLOCK=16)
    assert [s[0] for s in kernel.seen] == ["jit", "compiled", "jit", "jit"]


def test_an_argument_of_another_type_is_refused_by_name(on_gpu):
    with pytest.raises(TypeError, match="an argument of type list"):
        launching.launch(_kernel(), (1,), torch.zeros(4), [1], True, None, BLOCK=16)


def test_the_interpreter_takes_triton_s_path_every_time(monkeypatch):
    monkeypatch.setattr(launching, "INTERPRET", True)
    kernel = _kernel()
    for _ in range(2):
        launching.launch(kernel, (1,), torch.zeros(4), 32, True, None, BLOCK=16)
    assert [s[0] for s in kernel.seen] == ["jit", "jit"]

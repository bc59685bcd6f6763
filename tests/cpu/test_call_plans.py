"""What every call of the operator would otherwise redo on the host is done once: the
settings' encoding and decoding, the GPU's architecture, and the fused backend's plan of
a kind of call (buffers, saved shape, program counts)."""

import dataclasses

import pytest
import torch

from problems import make_problem, make_weights
from ranks import run_ranks
from titan_megamoe import fused_support
from titan_megamoe.settings import OperatorSettings


def test_settings_encode_once_and_decode_to_one_object():
    settings = OperatorSettings(precision="fp8", backend="fused", capacity_tokens_per_rank=64, save_gemm1=True)
    encoded = settings.encode()
    assert settings.encode() is encoded
    decoded = OperatorSettings.decode(encoded)
    assert decoded == settings and OperatorSettings.decode(encoded) is decoded
    assert settings.replace(comm_sms=3).encode() == encoded.replace("comm_sms=0", "comm_sms=3")


@pytest.fixture
def fresh_arch_cache():
    fused_support._cuda_arch.cache_clear()
    yield
    fused_support._cuda_arch.cache_clear()


def test_gpu_architecture_is_asked_of_the_driver_once_per_device(monkeypatch, fresh_arch_cache):
    asked = []

    def capability(index):
        asked.append(index)
        return 9, 0

    monkeypatch.setattr(fused_support, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "a test GPU")
    for _ in range(3):
        for index in (0, 1):
            assert fused_support.arch(torch.device("cuda", index)) == ("sm90", "a test GPU (compute capability 9.0)")
    assert asked == [0, 1]


def test_gpu_architecture_is_a_constant_to_torch_compile(monkeypatch, fresh_arch_cache):
    """A full graph around the operator on a GPU traces its device check: the driver's
    answers (``torch.cuda.get_device_name`` returns a string, which Dynamo cannot put in a
    graph) must not be traced."""

    def name(index):
        torch._dynamo.graph_break()  # what tracing the driver's answers amounts to
        return "a test GPU"

    monkeypatch.setattr(fused_support, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", name)

    def sm90_only(x):
        target, _ = fused_support.arch(torch.device("cuda", 0))
        return x + 1 if target == "sm90" else x

    torch._dynamo.reset()
    assert torch.equal(torch.compile(sm90_only, backend="eager", fullgraph=True)(torch.zeros(2)), torch.ones(2))


def _one_plan_per_kind(rank, world):
    from titan_megamoe import fused

    x, idx, _ = make_problem(9, "random", seed=0)
    w1, _, _ = make_weights()
    sized = OperatorSettings(backend="fused", capacity_tokens_per_rank=16)
    plan = fused._plan(x, idx, w1, None, sized)
    assert fused._plan(x[:5], idx[:5], w1, None, sized) is plan  # any count within the capacity
    assert fused._plan(x, idx, w1, None, OperatorSettings.decode(sized.encode())) is plan  # as the ops pass them

    # A single rank without a capacity: a new token count replaces the buffers, and the
    # plans that held the old ones go with them.
    unsized = sized.replace(capacity_tokens_per_rank=0)
    nine = fused._plan(x, idx, w1, None, unsized)
    fused._plan(x[:5], idx[:5], w1, None, unsized)
    again = fused._plan(x, idx, w1, None, unsized)
    assert again.buffers is not nine.buffers and again.buffers.shape == nine.buffers.shape
    held = [id(b) for b in fused._BUFFERS.values()]
    assert sorted(held) == sorted([id(plan.buffers), id(again.buffers)])
    assert all(id(p.buffers) in held for p in fused._PLANS.values())

    # A tile row changed at run time (what profile_layer --tiles does) plans anew, with
    # buffers sized and kernels launched by the new row, forward and backward.
    from titan_megamoe.kernels import configs

    row = ("interpret", sized.precision.forward.name)
    changed = dataclasses.replace(configs.TILE_CONFIGS[row], copy_rows=2, gemm1_n=32)
    configs.TILE_CONFIGS[row] = changed
    replanned = fused._plan(x, idx, w1, None, sized)
    assert replanned is not plan and replanned.buffers.tiles == changed
    assert fused._grad_buffers(None, replanned.buffers, sized).tiles == changed

    # Released (bench_layer, between variants on one rank): no buffer set or plan is left
    # to count in the next variant's memory, and the next call plans and allocates anew.
    fused.release_buffers()
    assert not (fused._BUFFERS or fused._GRAD_BUFFERS or fused._PLANS)
    fresh = fused._plan(x, idx, w1, None, sized)
    assert fresh is not replanned and list(fused._BUFFERS.values()) == [fresh.buffers]


def test_fused_backend_plans_each_kind_of_call_once(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_one_plan_per_kind, 1, timeout_s=300)


@pytest.mark.parametrize(
    "most, num_tokens, programs, expected",
    [(64, 16384, 132, 64), (64, 4096, 132, 16), (64, 1, 132, 8), (64, 4096, 33, 64), (4, 10, 132, 4)],
)
def test_reduce_blocks_fill_the_programs(most, num_tokens, programs, expected):
    """The combine reduction is bound by memory: a call whose token blocks would leave
    programs idle takes smaller blocks, down to a floor (each size is a compiled variant)."""
    from titan_megamoe.kernels.forward import reduce_tokens

    assert reduce_tokens(most, num_tokens, programs) == expected


@pytest.mark.parametrize(
    "sms, ranks_per_device, reserved, expected",
    [(132, 1, 0, 132), (132, 1, 16, 116), (132, 8, 0, 16), (132, 8, 4, 16), (132, 8, 5, 15), (132, 1, 130, 2)],
)
def test_reserved_sms_are_left_out_of_the_persistent_grids(sms, ranks_per_device, reserved, expected):
    """``reserved_sms`` is taken from the device's SMs before they are split between the
    ranks that share it (virtual ranks)."""
    from titan_megamoe.fused import persistent_programs

    assert persistent_programs(sms, ranks_per_device, reserved) == expected


@pytest.mark.parametrize(
    "sms, ranks_per_device, reserved, message",
    [(132, 1, 131, "reserved_sms = 131 leaves 1 of the GPU's 132 SMs: the fused kernels need at least 2"),
     (132, 1, 200, "reserved_sms = 200 leaves 0 of the GPU's 132 SMs"),
     (132, 8, 120, "reserved_sms = 120 leaves 12 of the GPU's 132 SMs shared by 8 ranks")],
)
def test_reserving_too_many_sms_names_the_value(sms, ranks_per_device, reserved, message):
    from titan_megamoe.fused import persistent_programs

    with pytest.raises(ValueError, match=message):
        persistent_programs(sms, ranks_per_device, reserved)

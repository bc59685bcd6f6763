"""Kernel launches at a few microseconds of host time each.

``kernel[grid](*args, **kwargs)`` binds every argument, specializes it, looks the kernel
up, re-checks every global the kernel reads and builds launch metadata, each call: 50-120
us per launch of these kernels (40-90 arguments), measured on an H200 host, and at small
token counts most of what the operator costs (perf log v26). ``launch`` takes that path
once per specialization and then launches the compiled kernel directly. Keying every
argument again costs 30-50 us per launch itself, so ``launch`` first tries the kernel's
recent specializations, keying only the arguments that are not the objects they held.

The key of a specialization holds everything Triton specializes a compiled kernel on, or
more (a finer key only costs an extra lookup through Triton's own path): every constexpr
argument's value and the launch options by value; for the other arguments, a tensor's
dtype and whether its address is 16-byte aligned; a TMA descriptor's dtype, tile and
shared-memory layout; an integer's being 1, a multiple of 16,
and its width (32-bit signed, 64-bit signed, unsigned); a bool, a float or None by type.
Globals the kernels read are module-level constants, so the per-launch check of them is
left out. Under the interpreter every launch takes Triton's path (it compiles nothing).
"""

import inspect
import weakref
from itertools import compress
from operator import is_not

import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime import driver

from titan_megamoe.kernels.configs import INTERPRET

_SIGNATURES: dict = {}
"""Per kernel: its parameter names, which are constexpr, and their defaults."""

_COMPILED: dict = {}
"""Compiled kernels by specialization key."""

RECENT_PER_KERNEL = 4
"""Specializations of a kernel ``launch`` tries before keying every argument: a call
launches some kernels in a few specializations (the rows of ``x``, then of its gradient)."""

_RECENT: dict = {}
"""Per kernel: its latest launches straight to a compiled kernel (``_RecentLaunch``), one
per specialization, newest first."""

_INT32 = range(-(2**31), 2**31)

_SIDE_STREAMS: dict = {}
"""Per CUDA device: the stream ``fork_stream`` returns, made once."""


def _runtime_key(value):
    """What Triton specializes a non-constexpr argument on (or more)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, TensorDescriptor):  # specialized on its tiles, not its tensor's extent
        return value.base.dtype, tuple(value.block_shape), value.layout, value.padding
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return type(value)
    if isinstance(value, int):
        return value == 1, value % 16 == 0, value in _INT32, value >= 2**63
    raise TypeError(f"launch: an argument of type {type(value).__name__} ({value!r}); the kernels take "
                    "tensors, TMA descriptors, integers, floats, bools and None")


def _current_device() -> int:
    return driver.active.get_current_device()


def _signature(kernel):
    signature = _SIGNATURES.get(kernel)
    if signature is None:
        parameters = inspect.signature(kernel.fn).parameters
        names = tuple(parameters)
        constexpr = tuple(p.is_constexpr for p in kernel.params)
        defaults = {n: p.default for n, p in parameters.items() if p.default is not inspect.Parameter.empty}
        signature = _SIGNATURES[kernel] = (names, frozenset(names), constexpr, defaults)
    return signature


def launch(kernel, grid: tuple[int, ...], *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``: the first launch of each specialization through
    Triton (which compiles it if it must), the later ones straight to the compiled kernel."""
    if INTERPRET:
        kernel[grid](*args, **kwargs)
        return
    names, name_set, constexpr, defaults = _signature(kernel)
    values = [*args, *(kwargs[n] if n in kwargs else defaults[n] for n in names[len(args):])]
    options = tuple((k, v) for k, v in kwargs.items() if k not in name_set)
    device = _current_device()
    recent = _RECENT.setdefault(kernel, [])
    for seen in recent:
        if seen.device == device and seen.options == options and seen.same_key(values, constexpr):
            seen.compiled[(*grid, 1, 1)[:3]](*values)
            return
    key = [_key_of(v, c) for v, c in zip(values, constexpr)]
    compiled = _COMPILED.get((kernel, device, options, *key))
    if compiled is None:
        _COMPILED[(kernel, device, options, *key)] = kernel[grid](*args, **kwargs)
        return
    recent.insert(0, _RecentLaunch(device, options, values, key, compiled))
    del recent[RECENT_PER_KERNEL:]
    compiled[(*grid, 1, 1)[:3]](*values)


def _key_of(value, is_constexpr: bool):
    """One argument's part of a specialization key: a constexpr's value, else what Triton
    specializes it on (plain tensors, most arguments, inline: a function call per argument
    costs as much as the key)."""
    if is_constexpr:
        return value
    if type(value) is torch.Tensor:
        return value.dtype, value.data_ptr() % 16 == 0
    return _runtime_key(value)


class _RecentLaunch:
    """A launch straight to a compiled kernel. Most arguments of the next launch of the same
    specialization are the same objects (buffers, shapes, constexprs): only the others are
    keyed (perf log v55). An argument passed again is held, one that changed is held by
    weak reference: a call's own tensors are not kept alive, and a buffer replaced by
    another is let go at the launch that passes the other."""

    __slots__ = ("device", "options", "held", "key", "compiled")

    def __init__(self, device: int, options: tuple, values: list, key: list, compiled):
        self.device, self.options, self.key, self.compiled = device, options, key, compiled
        self.held = [weakref.ref(v) if type(v) is torch.Tensor else v for v in values]

    def same_key(self, values: list, constexpr: tuple) -> bool:
        """Whether ``values`` specialize as this launch's did."""
        held, key = self.held, self.key
        if len(values) != len(held):
            return False
        # Only an argument keyed as this launch's is ever held: holding one is skipping its key.
        for i in compress(range(len(values)), map(is_not, values, held)):
            value, kept = values[i], held[i]
            if type(kept) is weakref.ref and kept() is value:
                held[i] = value  # passed again: held from now on
                continue
            if _key_of(value, constexpr[i]) != key[i]:
                return False
            if type(value) is torch.Tensor and type(kept) is not weakref.ref:
                held[i] = weakref.ref(value)  # this argument changes between launches
        return True


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grids and sizes on the host: Triton's ``cdiv`` and
    ``next_power_of_2`` are constexpr functions whose host calls cost microseconds each."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1), on the host (``cdiv``)."""
    return 1 << max(n - 1, 0).bit_length()


def fork_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """A second stream of ``device`` (one per device, kept) that starts where the current
    stream is now: kernels queued on it run beside those the current stream queues next
    (``join_stream`` ends that). None off GPUs, where launches run in the order made."""
    if device.type != "cuda":
        return None
    side = _SIDE_STREAMS.get(device.index)
    if side is None:
        side = _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def join_stream(side: "torch.cuda.Stream | None") -> None:
    """The current stream waits for everything queued on ``side`` (``fork_stream``)."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)

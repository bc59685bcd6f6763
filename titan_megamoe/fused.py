"""The ``fused`` backend: the forward runs the Triton kernels of ``titan_megamoe.kernels``.

Buffers are allocated once per (group, shape) and reused by every layer and step; the
first call of each shape logs their size. Until the fused backward lands, the backward
is the reference one: it recomputes the routing and the expert GEMMs from the op's
inputs (the layer's inputs are all it keeps), with ``torch.distributed`` all-to-all.
The fused backward will keep, per layer, the routing order (T x k int32) and layout
(a few KB), plus GEMM1's output ``h`` (received rows x I) when
``gemm1_activations = "save"``.
"""

import logging

import torch
import torch.distributed as dist

from titan_megamoe import symm
from titan_megamoe.kernels.forward import INTERPRET, ForwardBuffers, ForwardShape, fused_forward
from titan_megamoe.precision import NATIVE, get_precision

logger = logging.getLogger(__name__)

DEFAULT_COMM_PROGRAMS = 1 if INTERPRET else 32
"""Programs that dispatch rows before joining GEMM1 when ``comm_sms`` is 0. The
interpreter runs programs one after another, so there a single sender must finish
everything before any GEMM tile waits."""

MAX_SPINS = 1 << 28
"""Polls of a flag before a wait gives up (minutes: long enough for a peer that is
compiling or loading data, short enough that a dead peer does not hang the job)."""

_BUFFERS: dict[tuple, ForwardBuffers] = {}


def unsupported_reason(device: torch.device, precision: str) -> str | None:
    """Why the fused backend cannot run on ``device`` in ``precision``, or None if it can."""
    if get_precision(precision).forward != NATIVE:
        return f"precision {precision!r} has a quantized forward, which it does not run yet"
    if INTERPRET:
        return None
    if device.type != "cuda":
        return f"it needs a CUDA GPU (the device is {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"it needs compute capability 9.0 or newer (this GPU is {major}.{minor})"
    return None


def _buffers(group: dist.ProcessGroup | None, device: torch.device, shape: ForwardShape) -> ForwardBuffers:
    key = ("" if group is None else group.group_name, str(device), shape)
    if key not in _BUFFERS:
        buffers = ForwardBuffers(shape, device, symm.allocator(group, device))
        logger.info(
            f"mega_moe fused: buffers for {shape.capacity_tokens} tokens/rank x top-{shape.top_k}, "
            f"hidden {shape.hidden}, EP {shape.ep}: "
            f"{buffers.symmetric_bytes / 2**30:.2f} GiB symmetric + "
            f"{buffers.local_bytes / 2**30:.2f} GiB local"
        )
        _BUFFERS[key] = buffers
    return _BUFFERS[key]


def symmetric_bytes(**shape_fields) -> int:
    """Bytes of the symmetric buffers this process holds (outside PyTorch's caching
    allocator) for shapes whose ``ForwardShape`` fields equal ``shape_fields``."""
    return sum(
        b.symmetric_bytes
        for b in _BUFFERS.values()
        if all(getattr(b.shape, k) == v for k, v in shape_fields.items())
    )


def _num_programs(device: torch.device) -> int:
    if INTERPRET:
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def moe_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    group: dist.ProcessGroup | None,
    score_before_experts: bool,
    precision: str,
    capacity_tokens: int,
    comm_sms: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    reason = unsupported_reason(x.device, precision)
    if reason:
        raise NotImplementedError(f"mega_moe fused backend cannot run: {reason}")
    ep = 1 if group is None else group.size()
    rank = 0 if group is None else group.rank()
    shape = ForwardShape(
        ep=ep,
        rank=rank,
        capacity_tokens=capacity_tokens or x.shape[0],
        top_k=topk_idx.shape[1],
        local_experts=w1.shape[0],
        hidden=x.shape[1],
        inter=w1.shape[1],
        dtype=x.dtype,
    )
    buffers = _buffers(group, x.device, shape)
    num_programs = _num_programs(x.device)
    comm_programs = comm_sms or min(DEFAULT_COMM_PROGRAMS, num_programs - 1)
    return fused_forward(
        x.contiguous(),
        topk_idx.contiguous(),
        topk_w.contiguous(),
        w1.contiguous(),
        w2.contiguous(),
        w3.contiguous(),
        buffers,
        score_before_experts,
        comm_programs,
        num_programs,
        MAX_SPINS,
    )

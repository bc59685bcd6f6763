"""The ``fused`` backend: forward and backward run the Triton kernels of
``titan_megamoe.kernels``.

Buffers are allocated once per (group, shape) and reused by every layer and step; the
first forward and the first backward of each shape log their size. Per layer, the
backward keeps nothing but the op's inputs (it re-derives the routing layout on the
device), plus, with ``save_gemm1``, GEMM1's pre-activations (``preact_shape``: receive
rows x 2I in the activation dtype), which spares it recomputing GEMM1.
"""

import logging

import torch
import torch.distributed as dist

from titan_megamoe import symm
from titan_megamoe.kernels.backward import GradBuffers, fused_backward, per_call_bytes
from titan_megamoe.kernels.forward import (
    INTERPRET,
    ForwardBuffers,
    ForwardShape,
    fused_forward,
    preact_shape,
    tile_config,
)
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
_GRAD_BUFFERS: dict[tuple, GradBuffers] = {}


def unsupported_reason(device: torch.device, precision: str) -> str | None:
    """Why the fused backend cannot run on ``device`` in ``precision``, or None if it can."""
    prec = get_precision(precision)
    if any(fmt != NATIVE for fmt in (prec.forward, prec.dgrad, prec.wgrad)):
        return f"precision {precision!r} quantizes GEMM operands, which it does not run yet"
    if INTERPRET:
        return None
    if device.type != "cuda":
        return f"it needs a CUDA GPU (the device is {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"it needs compute capability 9.0 or newer (this GPU is {major}.{minor})"
    return None


def _key(group: dist.ProcessGroup | None, device: torch.device, shape: ForwardShape) -> tuple:
    return ("" if group is None else group.group_name, str(device), shape)


def _buffers(group: dist.ProcessGroup | None, device: torch.device, shape: ForwardShape) -> ForwardBuffers:
    key = _key(group, device, shape)
    if key not in _BUFFERS:
        buffers = ForwardBuffers(shape, device, symm.allocator(group, device))
        logger.info(
            f"mega_moe fused: buffers for {shape.capacity_tokens} tokens/rank x top-{shape.top_k}, "
            f"hidden {shape.hidden}, EP {shape.ep}: "
            f"{buffers.symmetric_bytes / 2**30:.2f} GiB symmetric + "
            f"{buffers.local_bytes / 2**30:.2f} GiB local; saving GEMM1's pre-activations "
            f"would keep {_preact_bytes(buffers) / 2**30:.2f} GiB per layer"
        )
        _BUFFERS[key] = buffers
    return _BUFFERS[key]


def _grad_buffers(group: dist.ProcessGroup | None, device: torch.device, shape: ForwardShape) -> GradBuffers:
    key = _key(group, device, shape)
    if key not in _GRAD_BUFFERS:
        forward = _buffers(group, device, shape)
        grad = GradBuffers(forward, symm.allocator(group, device))
        logger.info(
            f"mega_moe fused: backward buffers {grad.symmetric_bytes / 2**30:.2f} GiB symmetric, "
            f"plus {per_call_bytes(forward) / 2**30:.2f} GiB per backward call"
        )
        _GRAD_BUFFERS[key] = grad
    return _GRAD_BUFFERS[key]


def _preact_bytes(buffers: ForwardBuffers) -> int:
    rows, cols = preact_shape(buffers.shape, buffers.tiles)
    return rows * cols * buffers.h.element_size()


def symmetric_bytes(**shape_fields) -> int:
    """Bytes of the symmetric buffers this process holds (outside PyTorch's caching
    allocator) for shapes whose ``ForwardShape`` fields equal ``shape_fields``."""
    every = list(_BUFFERS.items()) + list(_GRAD_BUFFERS.items())
    return sum(
        b.symmetric_bytes
        for (_, _, shape), b in every
        if all(getattr(shape, k) == v for k, v in shape_fields.items())
    )


def _num_programs(device: torch.device) -> int:
    if INTERPRET:
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def _shape(x, topk_idx, w1, group, capacity_tokens: int) -> ForwardShape:
    return ForwardShape(
        ep=1 if group is None else group.size(),
        rank=0 if group is None else group.rank(),
        capacity_tokens=capacity_tokens or x.shape[0],
        top_k=topk_idx.shape[1],
        local_experts=w1.shape[0],
        hidden=x.shape[1],
        inter=w1.shape[1],
        dtype=x.dtype,
    )


def saved_preact_shape(x, topk_idx, w1, group, capacity_tokens: int, save_gemm1: bool) -> tuple[int, int]:
    """Shape of the pre-activations the forward returns for its backward (0 rows when
    GEMM1 is recomputed instead)."""
    if not save_gemm1:
        return 0, 2 * w1.shape[1]
    return preact_shape(_shape(x, topk_idx, w1, group, capacity_tokens), tile_config())


def _programs(x: torch.Tensor, comm_sms: int) -> tuple[int, int]:
    num_programs = _num_programs(x.device)
    return comm_sms or min(DEFAULT_COMM_PROGRAMS, num_programs - 1), num_programs


def _check_runs(x: torch.Tensor, precision: str) -> None:
    reason = unsupported_reason(x.device, precision)
    if reason:
        raise NotImplementedError(f"mega_moe fused backend cannot run: {reason}")


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
    save_gemm1: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, tokens per local expert, saved pre-activations)``."""
    _check_runs(x, precision)
    shape = _shape(x, topk_idx, w1, group, capacity_tokens)
    buffers = _buffers(group, x.device, shape)
    preact = x.new_empty(saved_preact_shape(x, topk_idx, w1, group, capacity_tokens, save_gemm1))
    comm_programs, num_programs = _programs(x, comm_sms)
    y, tokens_per_expert = fused_forward(
        *(t.contiguous() for t in (x, topk_idx, topk_w, w1, w2, w3)),
        buffers,
        score_before_experts,
        comm_programs,
        num_programs,
        MAX_SPINS,
        preact=preact if save_gemm1 else None,
    )
    return y, tokens_per_expert, preact


def moe_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    preact: torch.Tensor,
    group: dist.ProcessGroup | None,
    score_before_experts: bool,
    precision: str,
    capacity_tokens: int,
    comm_sms: int,
) -> tuple[torch.Tensor, ...]:
    """``(dx, d_topk_w, dw1, dw2, dw3)``; ``preact`` as the forward returned it."""
    _check_runs(x, precision)
    shape = _shape(x, topk_idx, w1, group, capacity_tokens)
    buffers = _buffers(group, x.device, shape)
    grad = _grad_buffers(group, x.device, shape)
    comm_programs, num_programs = _programs(x, comm_sms)
    return fused_backward(
        *(t.contiguous() for t in (dy, x, topk_idx, topk_w, w1, w2, w3)),
        preact if preact.shape[0] else None,
        buffers,
        grad,
        score_before_experts,
        comm_programs,
        num_programs,
        MAX_SPINS,
    )

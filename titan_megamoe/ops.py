"""The MoE operator as ``torch.library`` custom ops, with an explicit backward.

``mega_moe(...)`` is the entry point: it checks its inputs, then calls
``torch.ops.titan_megamoe.moe_forward``, whose autograd formula calls
``torch.ops.titan_megamoe.moe_backward``. Both dispatch to a backend by name, so the
choice travels through ``torch.compile`` and activation checkpointing as a plain string,
and the forward op can be put in a selective-checkpointing save list
(``SAVE_LIST_OPS``) so that recomputation never repeats its transfers.
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from titan_megamoe import fused, reference
from titan_megamoe.precision import get_precision


@dataclass(frozen=True)
class Backend:
    """One implementation of the operator.

    ``forward(x, topk_idx, topk_w, w1, w2, w3, group, score_before_experts, precision,
    capacity_tokens, comm_sms, save_gemm1) -> (y, tokens per local expert, saved)``;
    ``backward(dy, x, topk_idx, topk_w, w1, w2, w3, saved, group, score_before_experts,
    precision, capacity_tokens, comm_sms) -> (dx, d_topk_w, dw1, dw2, dw3)``, where
    ``saved`` is what the forward kept for it (GEMM1's pre-activations, or 0 rows);
    ``saved_shape(x, topk_idx, w1, group, capacity_tokens, save_gemm1)`` is its shape.
    ``unsupported(device, precision, ep_within_node)`` says why it cannot run there, or
    None.
    """

    forward: Callable[..., tuple[Tensor, Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, ...]]
    saved_shape: Callable[..., tuple[int, int]]
    unsupported: Callable[[torch.device, str, bool], str | None]


def _nothing_saved(x, topk_idx, w1, *_):
    return 0, 2 * w1.shape[1]


def _reference_forward(x, topk_idx, topk_w, w1, w2, w3, *args, capacity_tokens, comm_sms, save_gemm1):
    y, tokens_per_expert = reference.moe_forward(x, topk_idx, topk_w, w1, w2, w3, *args)
    return y, tokens_per_expert, x.new_empty(_nothing_saved(x, topk_idx, w1))


def _reference_backward(dy, x, topk_idx, topk_w, w1, w2, w3, saved, *args, capacity_tokens, comm_sms):
    return reference.moe_backward(dy, x, topk_idx, topk_w, w1, w2, w3, *args)


def _fused_unsupported(device: torch.device, precision: str, ep_within_node: bool) -> str | None:
    if not ep_within_node:
        return "its EP group must be GPUs of one node (NVLink peers); this one spans nodes"
    return fused.unsupported_reason(device, precision)


def _fused_forward(*args, capacity_tokens, comm_sms, save_gemm1):
    return fused.moe_forward(*args, capacity_tokens, comm_sms, save_gemm1)


def _fused_backward(*args, capacity_tokens, comm_sms):
    return fused.moe_backward(*args, capacity_tokens, comm_sms)


BACKENDS: dict[str, Backend] = {
    "fused": Backend(_fused_forward, _fused_backward, fused.saved_preact_shape, _fused_unsupported),
    "reference": Backend(_reference_forward, _reference_backward, _nothing_saved, lambda *_: None),
}
"""Implementations, by name, fastest first (``auto`` takes the first that can run)."""


def resolve_backend(
    requested: str, device: torch.device, precision: str, ep_within_node: bool = True
) -> tuple[str, str]:
    """The backend to run for ``requested`` on ``device`` in ``precision`` (with the EP
    group inside one node or not), and why (for the log). Raises if ``requested`` names a
    backend that cannot run there."""
    if requested == "auto":
        skipped = []
        for name, backend in BACKENDS.items():
            reason = backend.unsupported(device, precision, ep_within_node)
            if reason is None:
                why = f"auto on {device.type}" + (f"; not {'; not '.join(skipped)}" if skipped else "")
                return name, why
            skipped.append(f"{name}: {reason}")
    if requested not in BACKENDS:
        raise ValueError(
            f"[mega_moe] backend = {requested!r} is unknown; known backends: "
            + ", ".join(["auto", *BACKENDS])
        )
    reason = BACKENDS[requested].unsupported(device, precision, ep_within_node)
    if reason is not None:
        raise NotImplementedError(f"[mega_moe] backend = {requested!r} cannot run here: {reason}")
    return requested, "asked for"


def _group(group_name: str) -> dist.ProcessGroup | None:
    if not group_name:
        return None
    return dist.distributed_c10d._resolve_process_group(group_name)


@torch.library.custom_op("titan_megamoe::moe_forward", mutates_args=())
def moe_forward(
    x: Tensor,
    topk_idx: Tensor,
    topk_w: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    group_name: str,
    score_before_experts: bool,
    precision: str,
    backend: str,
    capacity_tokens: int,
    comm_sms: int,
    save_gemm1: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return BACKENDS[backend].forward(
        x, topk_idx, topk_w, w1, w2, w3, _group(group_name), score_before_experts, precision,
        capacity_tokens=capacity_tokens, comm_sms=comm_sms, save_gemm1=save_gemm1,
    )


@moe_forward.register_fake
def _(x, topk_idx, topk_w, w1, w2, w3, group_name, score_before_experts, precision, backend,
      capacity_tokens, comm_sms, save_gemm1):
    saved = BACKENDS[backend].saved_shape(x, topk_idx, w1, _group(group_name), capacity_tokens, save_gemm1)
    return torch.empty_like(x), x.new_empty((w1.shape[0],), dtype=torch.int64), x.new_empty(saved)


@torch.library.custom_op("titan_megamoe::moe_backward", mutates_args=())
def moe_backward(
    dy: Tensor,
    x: Tensor,
    topk_idx: Tensor,
    topk_w: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    saved: Tensor,
    group_name: str,
    score_before_experts: bool,
    precision: str,
    backend: str,
    capacity_tokens: int,
    comm_sms: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return BACKENDS[backend].backward(
        dy, x, topk_idx, topk_w, w1, w2, w3, saved, _group(group_name), score_before_experts,
        precision, capacity_tokens=capacity_tokens, comm_sms=comm_sms,
    )


@moe_backward.register_fake
def _(dy, x, topk_idx, topk_w, w1, w2, w3, saved, group_name, score_before_experts, precision,
      backend, capacity_tokens, comm_sms):
    return tuple(torch.empty_like(t) for t in (x, topk_w, w1, w2, w3))


_NON_TENSOR_ARGS = (
    "group_name", "score_before_experts", "precision", "backend", "capacity_tokens", "comm_sms",
    "save_gemm1",
)


def _setup_context(ctx, inputs, output):
    x, topk_idx, topk_w, w1, w2, w3, *options = inputs
    ctx.save_for_backward(x, topk_idx, topk_w, w1, w2, w3, output[2])
    ctx.options = options[:-1]  # all but save_gemm1, which only the forward takes


def _backward(ctx, dy, _d_tokens_per_local_expert, _d_saved):
    grads = moe_backward(dy.contiguous(), *ctx.saved_tensors, *ctx.options)
    dx, d_topk_w, dw1, dw2, dw3 = grads
    return (dx, None, d_topk_w, dw1, dw2, dw3) + (None,) * len(_NON_TENSOR_ARGS)


moe_forward.register_autograd(_backward, setup_context=_setup_context)

SAVE_LIST_OPS = (torch.ops.titan_megamoe.moe_forward.default,)
"""Ops whose outputs selective activation checkpointing should save, not recompute."""


def _check_inputs(x, topk_idx, topk_w, w1, w2, w3) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden]; got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(
            f"topk_idx must be [{num_tokens}, top_k]; got shape {tuple(topk_idx.shape)}"
        )
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be int32 or int64; got {topk_idx.dtype}")
    if topk_w.shape != topk_idx.shape or topk_w.dtype != torch.float32:
        raise ValueError(
            f"topk_w must be float32 of shape {tuple(topk_idx.shape)}; "
            f"got {topk_w.dtype} of shape {tuple(topk_w.shape)}"
        )
    if w1.dim() != 3 or w1.shape[2] != hidden:
        raise ValueError(f"w1 must be [local_experts, inter, {hidden}]; got {tuple(w1.shape)}")
    experts, inter, _ = w1.shape
    expected = {"w3": (w3, (experts, inter, hidden)), "w2": (w2, (experts, hidden, inter))}
    for name, (w, shape) in expected.items():
        if tuple(w.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}; got {tuple(w.shape)}")
    if len({t.device for t in (x, topk_idx, topk_w, w1, w2, w3)}) != 1:
        raise ValueError("x, topk_idx, topk_w, w1, w2 and w3 must be on one device")


def mega_moe(
    x: Tensor,
    topk_idx: Tensor,
    topk_w: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    group: dist.ProcessGroup | None,
    *,
    score_before_experts: bool,
    precision: str,
    backend: str,
    capacity_tokens: int = 0,
    comm_sms: int = 0,
    save_gemm1: bool = False,
) -> tuple[Tensor, Tensor]:
    """Routed experts of one MoE layer, expert-parallel over ``group``.

    Args:
        x: ``[T, H]`` this rank's tokens.
        topk_idx: ``[T, k]`` global expert ids; expert ``e`` lives on rank ``e // E_local``.
        topk_w: ``[T, k]`` fp32 router scores (after route_norm / route_scale).
        w1, w3: ``[E_local, I, H]``; w2: ``[E_local, H, I]`` (TorchTitan's layout).
        group: the EP process group, or None for a single rank.
        score_before_experts: scale the expert input by the score instead of the output.
        precision: a name from ``titan_megamoe.precision.PRECISIONS``.
        backend: a name from ``BACKENDS``.
        capacity_tokens: (fused) most tokens any rank of ``group`` passes; sizes the
            buffers. 0: this call's token count (then every rank must pass as many).
        comm_sms: (fused) programs that dispatch before joining GEMM1; 0: the default.
        save_gemm1: (fused) keep GEMM1's pre-activations for the backward instead of
            recomputing them (more memory, less compute).

    Returns:
        ``y [T, H]`` and the rows received per local expert (int64, stays on the device).
    """
    _check_inputs(x, topk_idx, topk_w, w1, w2, w3)
    get_precision(precision)
    resolve_backend(backend, x.device, precision)  # raises with the reason
    group_name = "" if group is None else group.group_name
    y, tokens_per_local_expert, _saved = torch.ops.titan_megamoe.moe_forward(
        x, topk_idx, topk_w, w1, w2, w3, group_name, score_before_experts, precision, backend,
        capacity_tokens, comm_sms, save_gemm1,
    )
    return y, tokens_per_local_expert

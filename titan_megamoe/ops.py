"""The MoE operator as ``torch.library`` custom ops, with an explicit backward.

``mega_moe(...)`` is the entry point: it checks its inputs, then runs an autograd
Function whose forward calls ``torch.ops.titan_megamoe.moe_forward`` and whose backward
calls ``torch.ops.titan_megamoe.moe_backward``. Both ops take the layer's
:class:`~titan_megamoe.settings.OperatorSettings` as one string (``encode()``), so the
settings travel through ``torch.compile`` and activation checkpointing as a constant,
and the forward op can be put in a selective-checkpointing save list
(``SAVE_LIST_OPS``) so that recomputation never repeats its transfers.

Backends (``BACKENDS``): ``fused`` (the Triton kernels, imported on first use),
``reference`` (pure PyTorch, the specification) and ``stock`` (TorchTitan's own
all-to-all and grouped GEMMs, which the layer calls instead of this operator: the
installed TorchTitan's, ``titan_version.stock_path``). ``mega_moe`` takes ``backend="auto"`` and resolves it for the
inputs' device itself (``resolve_operator_backend``): the custom ops only ever carry a
resolved backend. This module and the reference backend need neither Triton nor
TorchTitan.
"""

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from titan_megamoe import fused_support, reference, titan_version
from titan_megamoe.inputs import check_inputs
from titan_megamoe.precision import Precision
from titan_megamoe.settings import OperatorSettings

logger = logging.getLogger(__name__)

Unsupported = Callable[[torch.device, torch.dtype, Precision, bool], str | None]


@dataclass(frozen=True)
class OpImpl:
    """What the custom ops run for one backend.

    ``forward(x, topk_idx, topk_w, w1, w2, w3, group, score_before_experts, settings) ->
    (y, tokens per local expert, saved, routing)``;
    ``backward(dy, x, topk_idx, topk_w, w1, w2, w3, saved, routing, group,
    score_before_experts, settings) -> (dx, d_topk_w, dw1, dw2, dw3)``, where ``saved`` and
    ``routing`` are what the forward kept for it (GEMM1's pre-activations, or 0 rows; the
    rows' order by expert, int32, or 0 elements);
    ``saved_shapes(x, topk_idx, w1, group, settings)`` are their shapes (for fake tensors).
    """

    forward: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, ...]]
    saved_shapes: Callable[..., tuple[tuple[int, int], tuple[int]]]


@dataclass(frozen=True)
class Backend:
    """One way to run the routed experts.

    ``unsupported(device, dtype, precision, ep_within_node[, weight_dtype,
    intermediate_size])`` says why it cannot run there (with these experts' weights, where
    given), or None. ``op`` is what the custom ops run, None for ``stock`` (the layer
    calls TorchTitan's path itself). ``auto`` says, in the same form, why
    ``resolve_backend("auto", ...)`` passes this backend over (None: it never takes it);
    backends are tried in ``BACKENDS`` order. ``auto_note(precision)``: what the reason
    ``resolve_backend`` returns adds when ``auto`` takes this backend, or None.
    """

    unsupported: Unsupported
    op: OpImpl | None
    auto: Unsupported | None
    auto_note: Callable[[Precision], str | None] = lambda precision: None


def _nothing_saved(x, topk_idx, w1, group, settings) -> tuple[tuple[int, int], tuple[int]]:
    return (0, 2 * w1.shape[1]), (0,)


def _reference_forward(x, topk_idx, topk_w, w1, w2, w3, group, score_before_experts, settings):
    y, tokens_per_expert = reference.moe_forward(
        x, topk_idx, topk_w, w1, w2, w3, group, score_before_experts, settings.precision
    )
    saved, routing = _nothing_saved(x, topk_idx, w1, group, settings)
    return y, tokens_per_expert, x.new_empty(saved), x.new_empty(routing, dtype=torch.int32)


def _reference_backward(dy, x, topk_idx, topk_w, w1, w2, w3, saved, routing, group, score_before_experts,
                        settings):
    return reference.moe_backward(
        dy, x, topk_idx, topk_w, w1, w2, w3, group, score_before_experts, settings.precision,
        settings.save_gemm1,
    )


# The fused backend imports Triton: only runs that use it load it.
def _fused_forward(*args):
    from titan_megamoe import fused

    return fused.moe_forward(*args)


def _fused_backward(*args):
    from titan_megamoe import fused

    return fused.moe_backward(*args)


def _fused_saved_shapes(*args):
    from titan_megamoe import fused

    return fused.saved_shapes(*args)


def _fused_unsupported(device, dtype, precision, ep_within_node, weight_dtype=None, intermediate_size=None):
    return fused_support.why_not(device, dtype, precision, weight_dtype=weight_dtype,
                                 intermediate_size=intermediate_size, ep_within_node=ep_within_node)


def _fused_auto_unsupported(*args) -> str | None:
    return fused_support.auto_unsupported_reason(*args)


# The stock path is the installed TorchTitan's, imported on first use: the operator itself
# needs no TorchTitan.
def _stock_unsupported(device, dtype, precision, ep_within_node, *_experts) -> str | None:
    return titan_version.stock_path().unsupported_reason(device, dtype, precision, ep_within_node)


def _stock_auto_note(precision: Precision) -> str | None:
    return titan_version.stock_path().auto_note(precision)


BACKENDS: dict[str, Backend] = {
    "fused": Backend(
        _fused_unsupported, OpImpl(_fused_forward, _fused_backward, _fused_saved_shapes), auto=_fused_auto_unsupported
    ),
    "stock": Backend(_stock_unsupported, op=None, auto=_stock_unsupported, auto_note=_stock_auto_note),
    "reference": Backend(
        lambda *_: None, OpImpl(_reference_forward, _reference_backward, _nothing_saved), auto=None
    ),
}
"""Every backend by name; ``auto`` takes the first ``auto`` one that can run."""


def resolve_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    precision: Precision,
    ep_within_node: bool = True,
) -> tuple[str, str]:
    """The backend that runs ``requested`` (a ``BACKENDS`` name or ``auto``) on
    ``device`` with experts computing in ``dtype`` and ``precision`` (the EP group inside
    one node or not), and why, for the log.

    ``auto`` takes ``fused`` where it can run, else ``stock``; never ``reference``, which
    runs only when asked for. Raises ``NotImplementedError`` with the reason if the
    backend asked for (or every ``auto`` one) cannot run there. This is how a MoE layer
    (the converter, the layer bench) resolves its backend; ``mega_moe`` resolves ``auto``
    among the operator's own backends (``resolve_operator_backend``).
    """
    if requested == "auto":
        skipped = []
        for name, backend in BACKENDS.items():
            if backend.auto is None:
                continue
            reason = backend.auto(device, dtype, precision, ep_within_node)
            if reason is None:
                note = backend.auto_note(precision)
                return name, "auto" + "".join(f"; skipped {s}" for s in skipped) + (f"; {note}" if note else "")
            skipped.append(f"{name}: {reason}")
        raise NotImplementedError(
            "[mega_moe] backend = 'auto' found no backend that can run here: " + "; ".join(skipped)
        )
    if requested not in BACKENDS:
        raise ValueError(
            f"[mega_moe] backend = {requested!r} is unknown; known backends: "
            + ", ".join(repr(name) for name in ("auto", *BACKENDS))
        )
    reason = BACKENDS[requested].unsupported(device, dtype, precision, ep_within_node)
    if reason is not None:
        raise NotImplementedError(f"[mega_moe] backend = {requested!r} cannot run here: {reason}")
    return requested, "asked for"


def _group(group_name: str) -> dist.ProcessGroup | None:
    if not group_name:
        return None
    return dist.distributed_c10d._resolve_process_group(group_name)


def _op(settings: OperatorSettings) -> OpImpl:
    return BACKENDS[settings.backend].op


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
    settings: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    decoded = OperatorSettings.decode(settings)
    return _op(decoded).forward(x, topk_idx, topk_w, w1, w2, w3, _group(group_name), score_before_experts, decoded)


@moe_forward.register_fake
def _(x, topk_idx, topk_w, w1, w2, w3, group_name, score_before_experts, settings):
    decoded = OperatorSettings.decode(settings)
    saved, routing = _op(decoded).saved_shapes(x, topk_idx, w1, _group(group_name), decoded)
    return (torch.empty_like(x), x.new_empty((w1.shape[0],), dtype=torch.int64), x.new_empty(saved),
            x.new_empty(routing, dtype=torch.int32))


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
    routing: Tensor,
    group_name: str,
    score_before_experts: bool,
    settings: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    decoded = OperatorSettings.decode(settings)
    return _op(decoded).backward(
        dy, x, topk_idx, topk_w, w1, w2, w3, saved, routing, _group(group_name), score_before_experts, decoded
    )


@moe_backward.register_fake
def _(dy, x, topk_idx, topk_w, w1, w2, w3, saved, routing, group_name, score_before_experts, settings):
    return tuple(torch.empty_like(t) for t in (x, topk_w, w1, w2, w3))


class _MoEFunction(torch.autograd.Function):
    """The operator's autograd: ``moe_forward``, then ``moe_backward`` on what it kept.
    A Function around the ops rather than a formula registered on them: torch's path for a
    registered formula rebuilds the schema's defaults and wraps the op in a generated
    Function in Python at every call: 70-125 us per forward + backward, measured with the
    kernels left out, of the 1.5-2.3 ms of host time a small layer's call takes (perf log
    v26)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_w, w1, w2, w3, group_name, score_before_experts, settings):
        y, tokens_per_local_expert, saved, routing = torch.ops.titan_megamoe.moe_forward(
            x, topk_idx, topk_w, w1, w2, w3, group_name, score_before_experts, settings
        )
        ctx.save_for_backward(x, topk_idx, topk_w, w1, w2, w3, saved, routing)
        ctx.mark_non_differentiable(tokens_per_local_expert)
        ctx.set_materialize_grads(False)
        ctx.group_name = group_name
        ctx.score_before_experts = score_before_experts
        ctx.settings = settings
        return y, tokens_per_local_expert

    @staticmethod
    def backward(ctx, dy, _d_tokens_per_local_expert):
        if dy is None:  # no gradient reached y (gradients are not materialized): none flows on
            return (None,) * 9
        dx, d_topk_w, dw1, dw2, dw3 = torch.ops.titan_megamoe.moe_backward(
            dy.contiguous(), *ctx.saved_tensors, ctx.group_name, ctx.score_before_experts, ctx.settings
        )
        return dx, None, d_topk_w, dw1, dw2, dw3, None, None, None


SAVE_LIST_OPS = (torch.ops.titan_megamoe.moe_forward.default,)
"""Ops whose outputs selective activation checkpointing should save, not recompute."""


def resolve_operator_backend(device: torch.device, dtype: torch.dtype, precision: Precision,
                             intermediate_size: int, weight_dtype: torch.dtype | None = None) -> tuple[str, str]:
    """The operator backend that ``backend="auto"`` runs experts of ``intermediate_size``
    computing in ``dtype`` (weights in ``weight_dtype``, default ``dtype``) and
    ``precision`` with on ``device``, and why: ``fused`` where it can run, else
    ``reference``, which runs on any device (``stock`` is not this operator: a MoE layer
    calls it instead, ``resolve_backend``)."""
    reason = BACKENDS["fused"].unsupported(device, dtype, precision, True, weight_dtype or dtype, intermediate_size)
    if reason is None:
        return "fused", "the fused kernels run here"
    return "reference", (f"the fused backend cannot run here ({reason}); the reference backend, pure PyTorch "
                         "and slow, runs on any device")


_AUTO_SETTINGS: dict[tuple, str] = {}
"""Encoded settings with ``backend="auto"`` -> encoded resolved settings, by the inputs'
device, dtypes, intermediate size and EP size."""
_logged_auto: set[tuple[str, str]] = set()
"""(backend, why) of each ``auto`` resolution already logged."""


@torch.compiler.assume_constant_result
def _resolve_auto(encoded: str, device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype,
                  intermediate_size: int, ep: int) -> str:
    """``encoded`` settings (backend ``auto``) with the backend ``resolve_operator_backend``
    picks, encoded; checked as ``_check_settings`` checks a named backend and logged once.
    A constant to ``torch.compile`` (a string: it cannot trace the lookup), like the
    settings string it replaces."""
    key = (encoded, device, dtype, weight_dtype, intermediate_size, ep)
    resolved = _AUTO_SETTINGS.get(key)
    if resolved is None:
        settings = OperatorSettings.decode(encoded)
        name, why = resolve_operator_backend(device, dtype, settings.precision, intermediate_size, weight_dtype)
        _check_capacity(name, settings, ep)
        if (name, why) not in _logged_auto:
            _logged_auto.add((name, why))
            (logger.info if name == "fused" else logger.warning)(
                f"mega_moe: backend 'auto' runs the operator on '{name}' for {dtype} experts in precision "
                f"{settings.precision.name!r}{_reference_gemms(name, dtype, settings.precision)} on {device.type}: "
                f"{why}")
        resolved = _AUTO_SETTINGS[key] = settings.replace(backend=name).encode()
    return resolved


def _reference_gemms(name: str, dtype: torch.dtype, precision: Precision) -> str:
    """For the log: the dtype the reference's GEMMs multiply in where an unquantized
    precision's name (``bf16``) is not it."""
    if name != "reference" or precision.quantized or dtype == torch.bfloat16:
        return ""
    return f" (unquantized: the GEMMs run in {dtype})"


def _what_auto_runs(x: Tensor, w1: Tensor, settings: OperatorSettings) -> str:
    """What to pass instead of a backend that cannot run here: ``auto`` and what it picks."""
    name, _ = resolve_operator_backend(x.device, x.dtype, settings.precision, w1.shape[1], w1.dtype)
    return f"pass backend='auto' (here it runs {name!r})"


def _check_capacity(name: str, settings: OperatorSettings, ep: int) -> None:
    if name == "fused" and ep > 1 and settings.capacity_tokens_per_rank <= 0:
        raise ValueError(
            f"settings.capacity_tokens_per_rank = {settings.capacity_tokens_per_rank} with the "
            f"fused backend on {ep} ranks: every rank must size the symmetric buffers "
            "alike, so set it to the most tokens any rank passes one call"
        )


def _check_settings(settings: OperatorSettings, x: Tensor, w1: Tensor, ep: int) -> None:
    """Raise if the named ``settings.backend`` cannot run these inputs, saying what can."""
    name = settings.backend
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValueError(
            f"settings.backend = {name!r} is not a backend the operator runs; "
            f"{_what_auto_runs(x, w1, settings)}, or one of "
            f"{', '.join(repr(n) for n, b in BACKENDS.items() if b.op)}"
        )
    if backend.op is None:
        raise ValueError(
            f"settings.backend = {name!r} is TorchTitan's own path, which a MoE layer runs instead of this "
            f"operator; {_what_auto_runs(x, w1, settings)}, or call titan_megamoe.{name}.routed_experts for "
            f"{name}'s computation"
        )
    # Whether the EP group spans nodes is the caller's to check (the converter does).
    reason = backend.unsupported(x.device, x.dtype, settings.precision, True, w1.dtype, w1.shape[1])
    if reason is not None:
        raise NotImplementedError(
            f"settings.backend = {name!r} cannot run here: {reason}; {_what_auto_runs(x, w1, settings)}")
    _check_capacity(name, settings, ep)


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
    settings: OperatorSettings,
) -> tuple[Tensor, Tensor]:
    """Routed experts of one MoE layer, expert-parallel over ``group``.

    Args:
        x: ``[T, H]`` this rank's tokens.
        topk_idx: ``[T, k]`` global expert ids; expert ``e`` lives on rank ``e // E_local``.
        topk_w: ``[T, k]`` fp32 router scores (after route_norm / route_scale).
        w1, w3: ``[E_local, I, H]``; w2: ``[E_local, H, I]`` (TorchTitan's layout).
        group: the EP process group, or None for a single rank.
        score_before_experts: scale the expert input by the score instead of the output.
        settings: how to run. ``settings.backend``: ``"auto"`` runs ``fused`` where it
            can run these inputs and ``reference`` elsewhere (``resolve_operator_backend``;
            logged once), or name ``fused`` or ``reference``. With ``fused`` on more than
            one rank, ``capacity_tokens_per_rank`` must be set.

    Returns:
        ``y [T, H]`` and the rows received per local expert (int64, stays on the device).

    An expert id outside ``[0, E)`` raises ``ValueError`` naming it. The reference backend
    raises from the call that holds it. The fused backend never waits for the device: the
    id poisons its buffers, the call's outputs (and those of any call made before the host
    finds it) are NaN, and the first later call whose host finds the record raises, on
    every rank of ``group`` (``kernels.sync``).
    """
    check_inputs(x, topk_idx, topk_w, w1, w2, w3)
    ep = 1 if group is None else group.size()
    if settings.backend == "auto":
        encoded = _resolve_auto(settings.encode(), x.device, x.dtype, w1.dtype, w1.shape[1], ep)
    else:
        _check_settings(settings, x, w1, ep)
        encoded = settings.encode()
    group_name = "" if group is None else group.group_name
    return _MoEFunction.apply(x, topk_idx, topk_w, w1, w2, w3, group_name, score_before_experts, encoded)

"""What one call of a converted layer's routed experts runs, and running the operator on
the layer's local weights: what the TorchTitan adapters' layers share.

The converter resolved the backend for the dtype it expected the experts to compute in;
a call can bring another (autocast keeps float32 parameters, a job without FSDP), and
the device and the experts' sizes are facts of the call. :class:`CallPlans` decides,
once per (device, dtypes), whether the fused backend runs the call on copies of its
tokens (and weights) in another dtype (``fused_support.operand_cast``), or, where it
cannot run it at all, whether the layer runs ``stock`` instead (where the adapter allows
it: TorchTitan 0.2.2 when ``auto`` chose the backend; logged once per job) or raises.

Needs no TorchTitan.
"""

import logging

import torch

from titan_megamoe import fused_support, ops
from titan_megamoe.ops import mega_moe
from titan_megamoe.settings import OperatorSettings

logger = logging.getLogger(__name__)

_logged_fallbacks: set[tuple[torch.dtype, str]] = set()
"""(dtype, reason) of each fallback to ``stock`` already logged: one line per job, not per layer."""
_logged_casts: set[tuple[torch.dtype, fused_support.OperandCasts]] = set()
"""(experts' dtype, casts) of each operand cast already logged."""

CallPlan = tuple[OperatorSettings, fused_support.OperandCasts | None]
"""The settings a call runs with, and the copies of the tokens and weights the fused
backend takes (or None)."""


class RouterScores:
    """fp32 router scores on their way into the experts module.

    FSDP2's mixed precision casts every floating-point tensor among a module's forward
    inputs to the parameter dtype; the operator needs the scores in fp32, as stock
    TorchTitan keeps them. The cast maps over pytrees, and this holder is a leaf that is
    not a tensor, so the scores pass through untouched (gradients included).
    """

    __slots__ = ("scores",)

    def __init__(self, scores: torch.Tensor):
        self.scores = scores


class CallPlans:
    """The plan of each call of one layer's routed experts, decided once per device and dtypes.

    ``settings``: what the converter resolved. Where the fused backend cannot run a call:
    with ``stock_fallback`` the layer runs ``stock`` (logged once per job); without, the
    call raises, saying that ``fused_by`` (what asked for the fused backend) cannot run it,
    and ``advice``.
    """

    def __init__(self, settings: OperatorSettings, stock_fallback: bool, fused_by: str, advice: str):
        self.settings = settings
        self.stock_fallback = stock_fallback
        self.fused_by = fused_by
        self.advice = advice
        self._plans: dict[tuple, CallPlan] = {}

    def plan(self, x: torch.Tensor, weight_dtype: torch.dtype, intermediate_size: int) -> CallPlan:
        """The plan of a call with tokens ``x`` on weights of ``weight_dtype`` and experts of
        ``intermediate_size``."""
        key = (self.settings, x.device, x.dtype, weight_dtype)
        decided = self._plans.get(key)  # one lookup: hashing the key is most of the cost
        if decided is None:
            decided = self._plans[key] = self._decide(x.device, x.dtype, weight_dtype, intermediate_size)
        return decided

    def _decide(self, device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype,
                intermediate_size: int) -> CallPlan:
        settings = self.settings
        if settings.backend != "fused":
            return settings, None
        # float32 tokens or weights (autocast keeps the parameters in float32).
        computes = torch.float32 if torch.float32 in (dtype, weight_dtype) else dtype
        cast = fused_support.operand_cast(device, computes, settings.precision)
        if cast is None and dtype != weight_dtype:
            cast = fused_support.OperandCasts(computes, computes)
        # The converter checked the EP group; the device, dtype and shapes are new here.
        reason = fused_support.why_not(device, cast.tokens if cast else dtype, settings.precision,
                                       intermediate_size=intermediate_size)
        if reason is None:
            if cast is not None and (computes, cast) not in _logged_casts:
                _logged_casts.add((computes, cast))
                logger.info(f"mega_moe: experts computing in {computes} run on the fused backend: "
                            f"{cast.describe(computes)}; the output is cast back to the tokens' dtype")
            return settings, cast
        if not self.stock_fallback:
            raise NotImplementedError(
                f"{self.fused_by} cannot run these experts ({dtype} inputs): {reason}; {self.advice}"
            )
        if (dtype, reason) not in _logged_fallbacks:
            _logged_fallbacks.add((dtype, reason))
            note = ops.BACKENDS["stock"].auto_note(settings.precision)
            logger.warning(
                f"mega_moe: backend 'fused' (chosen by auto) cannot run these experts ({dtype} inputs): "
                f"{reason}; those layers run backend 'stock'" + (f" ({note})" if note else "")
            )
        return settings.replace(backend="stock"), None


def run_operator(x: torch.Tensor, topk_idx: torch.Tensor, scores: torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor, w3: torch.Tensor, group, score_before_experts: bool,
                 plan: CallPlan) -> torch.Tensor:
    """The routed experts' output for this rank's tokens ``x`` through the operator, on the
    local expert weights, as ``plan`` says (a backend other than ``stock``)."""
    settings, cast = plan
    tokens = x
    if cast is not None:
        tokens = x.to(cast.tokens)
        if cast.weights is not None:
            w1, w2, w3 = (w.to(cast.weights) for w in (w1, w2, w3))
    y, _tokens_per_local_expert = mega_moe(
        tokens, topk_idx, scores, w1, w2, w3, group, score_before_experts=score_before_experts, settings=settings,
    )
    return y.to(x.dtype)

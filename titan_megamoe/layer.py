"""``MegaMoE``: TorchTitan's MoE layer with the routed experts run as one
``OperatorSettings`` says: by the ``mega_moe`` operator or by TorchTitan's own path.

Parameter and buffer names are TorchTitan's (``experts.w1/w2/w3``, ``router.gate.weight``,
``expert_bias``, ``tokens_per_expert``, ``shared_experts.*``), so checkpoints move freely
between stock and converted models. The experts stay a module of their own, called once
per forward, so FSDP2's hooks and prefetch lists treat them exactly as stock.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.moe import MoE
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.tools.logging import logger

from titan_megamoe import fused_support, stock
from titan_megamoe.ops import mega_moe
from titan_megamoe.settings import OperatorSettings

_logged_fallbacks: set[tuple[torch.dtype, str]] = set()
"""(dtype, reason) of each fallback to ``stock`` already logged: one line per job, not per layer."""
_logged_casts: set[tuple[torch.dtype, torch.dtype]] = set()
"""(experts' dtype, cast) of each operand cast already logged (``MegaExperts._decide``)."""


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


class MegaExperts(GroupedExperts):
    """The routed experts: owns ``w1, w2, w3`` and runs them on the routed tokens, through
    the operator (``mega_moe``) or, with ``settings.backend == "stock"``, TorchTitan's own
    path (``titan_megamoe.stock``).

    Under expert parallelism the weights are DTensors sharded ``Shard(0)`` on a mesh
    named ``ep`` (see ``titan_megamoe.parallel``); the backend gets the local shards and
    that mesh's process group, and moves the tokens itself.

    ``auto_backend``: ``settings.backend`` was chosen by ``auto`` for the dtype the
    converter expected. If ``fused`` then cannot run the dtype a call brings, the layer
    runs ``stock`` instead (logged once); without ``auto_backend`` that call raises.
    """

    def __init__(
        self,
        source: GroupedExperts,
        settings: OperatorSettings,
        score_before_experts: bool,
        auto_backend: bool = False,
    ):
        nn.Module.__init__(self)
        self.num_experts = source.num_experts  # read by TorchTitan's apply_fsdp
        self.w1, self.w2, self.w3 = source.w1, source.w2, source.w3
        self.settings = settings
        self.score_before_experts = score_before_experts
        self.auto_backend = auto_backend
        self._call_settings: dict[tuple, tuple[OperatorSettings, torch.dtype | None]] = {}

    def _settings_for(self, x: torch.Tensor, weight_dtype: torch.dtype) -> tuple[OperatorSettings, torch.dtype | None]:
        """The settings a call with ``x`` runs with, and the dtype the fused backend takes
        copies of the tokens and weights in (``fused_support.operand_cast``) or None:
        decided once per device and dtypes."""
        key = (self.settings, x.device, x.dtype, weight_dtype)
        decided = self._call_settings.get(key)  # one lookup: hashing the key is most of the cost
        if decided is None:
            decided = self._call_settings[key] = self._decide(x.device, x.dtype, weight_dtype)
        return decided

    def _decide(self, device: torch.device, dtype: torch.dtype,
                weight_dtype: torch.dtype) -> tuple[OperatorSettings, torch.dtype | None]:
        settings = self.settings
        if settings.backend != "fused":
            return settings, None
        # float32 tokens or weights (autocast keeps the parameters in float32).
        computes = torch.float32 if torch.float32 in (dtype, weight_dtype) else dtype
        cast = fused_support.operand_cast(device, computes, settings.precision)
        if cast is None and dtype != weight_dtype:
            cast = computes
        # The converter checked the EP group; the device, dtype and shapes are new here.
        reason = (fused_support.unsupported_reason(device, cast or dtype, settings.precision, True)
                  or fused_support.shape_unsupported_reason(settings.precision, self.w1.shape[1]))
        if reason is None:
            if cast is not None and (computes, cast) not in _logged_casts:
                _logged_casts.add((computes, cast))
                logger.info(f"mega_moe: experts computing in {computes} run on the fused backend with {cast} "
                            "copies of their tokens and weights, as TorchTitan's grouped-MM path runs its GEMMs; "
                            "the output is cast back to the tokens' dtype")
            return settings, cast
        if not self.auto_backend:
            raise NotImplementedError(
                f"[mega_moe] backend = 'fused' cannot run these experts ({dtype} inputs): {reason}; "
                "set [mega_moe] backend = 'auto' to run them on 'stock' instead"
            )
        if (dtype, reason) not in _logged_fallbacks:
            _logged_fallbacks.add((dtype, reason))
            logger.warning(
                f"mega_moe: backend 'fused' (chosen by auto) cannot run these experts ({dtype} inputs): "
                f"{reason}; those layers run backend 'stock'"
            )
        return settings.replace(backend="stock"), None

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: RouterScores) -> torch.Tensor:
        group = None
        if isinstance(self.w1, DTensor):
            mesh = self.w1.device_mesh
            if mesh.mesh_dim_names != ("ep",):
                raise RuntimeError(
                    f"mega_moe experts must be sharded on a 1-D mesh named 'ep'; got mesh "
                    f"dims {mesh.mesh_dim_names}"
                )
            group = mesh.get_group()
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        settings, cast = self._settings_for(x, w1.dtype)
        if settings.backend == "stock":
            return stock.routed_experts(
                x, topk_idx, topk_w.scores, w1, w2, w3, group, self.score_before_experts, settings.precision
            )
        tokens = x
        if cast is not None:
            tokens, w1, w2, w3 = (t.to(cast) for t in (x, w1, w2, w3))
        y, _tokens_per_local_expert = mega_moe(
            tokens, topk_idx, topk_w.scores, w1, w2, w3, group,
            score_before_experts=self.score_before_experts, settings=settings,
        )
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, precision={self.settings.precision.name}, "
            f"backend={self.settings.backend}"
        )


class TokenSlicer(nn.Module):
    """Which of the layer's tokens this rank routes: all of them, unless TorchTitan's
    ``ReordererSequenceParallel`` (installed on ``moe.reorderer`` when EP borrows the TP
    ranks) splits them across the TP group.

    Returns ``(top_scores, token_positions, topk_idx)``: the same shape of result as
    TorchTitan's reorderer, so that style's input split and position offset apply as is.
    """

    def forward(self, top_scores: torch.Tensor, topk_idx: torch.Tensor):
        positions = torch.arange(top_scores.shape[0], device=top_scores.device)
        return top_scores, positions, topk_idx


class MegaMoE(MoE):
    """Router -> routed experts (``MegaExperts``) (+ shared experts), as TorchTitan's ``MoE``."""

    def __init__(self, source: MoE, settings: OperatorSettings, auto_backend: bool = False):
        nn.Module.__init__(self)
        # Registered in stock order, so state dicts list keys identically.
        self.experts = MegaExperts(source.experts, settings, source.score_before_experts, auto_backend)
        self.router = source.router
        self.reorderer = TokenSlicer()
        self.shared_experts = source.shared_experts
        self.score_before_experts = source.score_before_experts
        self.load_balance_coeff = source.load_balance_coeff
        if source.expert_bias is not None:
            self.register_buffer("expert_bias", source.expert_bias, persistent=True)
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", source.tokens_per_expert, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, topk_idx, num_tokens_per_expert = self.router(x, self.expert_bias)
        # Counted once per routing, as stock TorchTitan does; the expert-bias update only
        # reads its sign, so activation-checkpoint recomputation does not change training.
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)

        top_scores, positions, topk_idx = self.reorderer(top_scores, topk_idx)
        sliced = positions.shape[0] != x.shape[0]
        routed = self.experts(x[positions] if sliced else x, topk_idx, RouterScores(top_scores))
        if sliced:
            # The other TP ranks add the rest: the layer's output is Partial over TP.
            routed = routed.new_zeros(x.shape).index_copy(0, positions, routed)

        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed.reshape(bs, slen, dim)

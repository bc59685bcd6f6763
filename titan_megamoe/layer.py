"""``MegaMoE``: TorchTitan 0.2.2's MoE layer with the routed experts run as one
``OperatorSettings`` says: by the ``mega_moe`` operator or by TorchTitan's own path.

Parameter and buffer names are TorchTitan's (``experts.w1/w2/w3``, ``router.gate.weight``,
``expert_bias``, ``tokens_per_expert``, ``shared_experts.*``), so checkpoints move freely
between stock and converted models. The experts stay a module of their own, called once
per forward, so FSDP2's hooks and prefetch lists treat them exactly as stock.
"""

from titan_megamoe import titan_version

titan_version.require("0.2", __name__)

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.moe import MoE
from torchtitan.models.moe.moe import GroupedExperts

from titan_megamoe import stock
from titan_megamoe.config import MegaMoE as MegaMoESection
from titan_megamoe.expert_calls import CallPlan, CallPlans, RouterScores, run_operator
from titan_megamoe.settings import OperatorSettings


class MegaExperts(GroupedExperts):
    """The routed experts: owns ``w1, w2, w3`` and runs them on the routed tokens, through
    the operator (``mega_moe``) or, with ``settings.backend == "stock"``, TorchTitan's own
    path (``titan_megamoe.stock``).

    Under expert parallelism the weights are DTensors sharded ``Shard(0)`` on a mesh
    named ``ep`` (see ``titan_megamoe.parallel``); the backend gets the local shards and
    that mesh's process group, and moves the tokens itself.

    ``auto_backend``: ``settings.backend`` was chosen by ``auto`` for the dtype the
    converter expected. If ``fused`` then cannot run the dtype a call brings, the layer
    runs ``stock`` instead (logged once); without ``auto_backend`` that call raises
    (``titan_megamoe.expert_calls``).
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
        section = MegaMoESection.SETTINGS_NAME
        self._plans = CallPlans(settings, stock_fallback=auto_backend, fused_by=f"{section} backend = 'fused'",
                                advice=f"set {section} backend = 'auto' to run them on 'stock' instead")

    def _settings_for(self, x: torch.Tensor, weight_dtype: torch.dtype) -> CallPlan:
        """The settings a call with ``x`` runs with, and the copies of the tokens and weights
        the fused backend takes (``fused_support.operand_cast``) or None."""
        return self._plans.plan(x, weight_dtype, self.w1.shape[1])

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
        plan = self._settings_for(x, w1.dtype)
        settings, _ = plan
        if settings.backend == "stock":
            return stock.routed_experts(
                x, topk_idx, topk_w.scores, w1, w2, w3, group, self.score_before_experts, settings.precision
            )
        return run_operator(x, topk_idx, topk_w.scores, w1, w2, w3, group, self.score_before_experts, plan)

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

"""TorchTitan 0.3.0's routed experts (``RoutedExperts``: a token dispatcher and
``GroupedExperts``) run as one call of the operator.

``MegaRoutedExperts`` takes the place of ``moe.routed_experts`` in the model config
(``titan_megamoe.torchtitan03.converter``). Its forward has ``RoutedExperts``' signature,
so TorchTitan's MoE sharding (``set_moe_sharding_config``: the ``local_map`` region, the
experts' ``Shard(0)`` placement on the EP mesh) and FSDP2 (``apply_fsdp_to_decoder``
wraps ``moe.routed_experts.inner_experts``) apply to it unchanged. Parameter names stay
``routed_experts.inner_experts.{w1_EFD, w2_EDF, w3_EFD}``, so checkpoints move freely
between stock and converted models.

With the backend ``stock`` the module is ``RoutedExperts`` itself, built from the experts
config the converters before ``MegaMoEConverter`` left (torchao's where one of its
grouped-experts converters ran) with TorchTitan's own token dispatcher. Otherwise the
experts are ``MegaGroupedExperts``, and the operator dispatches, computes and combines
this rank's tokens itself; the dispatcher is not built.
"""

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.protocols.module import Module

from titan_megamoe.config import MegaMoE
from titan_megamoe.expert_calls import CallPlans, RouterScores, run_operator
from titan_megamoe.job_settings import ResolvedSettings


def _local(weight: torch.Tensor) -> torch.Tensor:
    # DTensor backends hand the local_map region DTensor weights; spmd_types, local ones.
    return weight.to_local() if isinstance(weight, DTensor) else weight


class MegaGroupedExperts(GroupedExperts):
    """The routed experts' weights (``GroupedExperts``' parameters and initialization), run
    on the tokens of this rank by the operator. Called once per forward, as TorchTitan calls
    ``GroupedExperts``, so that FSDP2's hooks gather and free the weights as stock.

    ``plans`` says what each call runs; ``ep_group`` is the EP process group
    (``MegaRoutedExperts.parallelize``), None without expert parallelism.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def __init__(self, config: Config, *, plans: CallPlans):
        super().__init__(config)
        self.plans = plans
        self.ep_group: torch.distributed.ProcessGroup | None = None

    def forward(self, x_TD: torch.Tensor, topk_expert_ids_TK: torch.Tensor,
                topk_scores: RouterScores) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        plan = self.plans.plan(x_TD, w1.dtype, w1.shape[1])
        # TorchTitan 0.3.0 weights the expert outputs by the scores (no score_before_experts).
        return run_operator(x_TD, topk_expert_ids_TK, topk_scores.scores, w1, w2, w3, self.ep_group, False, plan)

    def extra_repr(self) -> str:
        settings = self.plans.settings
        return f"num_experts={self.num_experts}, precision={settings.precision.name}, backend={settings.backend}"


@dataclass(frozen=True)
class StockExperts:
    """The experts config the ``stock`` backend builds. Not a config itself, so that config
    traversals skip it: a converter listed after ``MegaMoEConverter`` finds only the experts
    the operator runs (and is refused, naming the order to use)."""

    config: GroupedExperts.Config


class MegaRoutedExperts(RoutedExperts):
    """``RoutedExperts`` whose experts the operator runs (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        inner_experts: MegaGroupedExperts.Config
        """The experts the operator runs."""
        stock_experts: StockExperts
        """The experts as the converters before ``MegaMoEConverter`` left them (torchao's
        where one of its grouped-experts converters ran)."""
        section: MegaMoE
        """The converter's settings."""
        auto_precision: tuple[str, str]
        """(precision, what it was mapped from) that ``precision = "auto"`` stands for."""
        resolved: ResolvedSettings | None = None
        """The settings of the job, set by the model config's ``update_from_config``
        (``titan_megamoe.torchtitan03.converter``)."""

    def __init__(self, config: Config):
        if config.resolved is None:
            raise RuntimeError(
                "MegaRoutedExperts built before its settings were resolved for the job: the model config's "
                "update_from_config(config=<Trainer.Config>) resolves them, as TorchTitan's Trainer calls it "
                "before building the model; call it before build()"
            )
        settings = config.resolved.settings
        nn.Module.__init__(self)
        if settings.backend == "stock":
            # RoutedExperts' own members; TorchTitan set the experts' sharding on inner_experts.
            self.inner_experts = replace(config.stock_experts.config,
                                         sharding_config=config.inner_experts.sharding_config).build()
            self.token_dispatcher = config.token_dispatcher.build()
            return
        section = config.section.SETTINGS_NAME
        fused_by = (f"backend 'fused' (chosen by {section} backend = 'auto')" if config.resolved.auto_backend
                    else f"{section} backend = 'fused'")
        plans = CallPlans(settings, stock_fallback=False, fused_by=fused_by,
                          advice=f"set {section} backend = 'stock' to run them on TorchTitan's own path")
        self.inner_experts = config.inner_experts.build(plans=plans)
        self.token_dispatcher = None

    @property
    def runs_stock(self) -> bool:
        return self.token_dispatcher is not None

    def forward(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        if self.runs_stock:
            return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.size(-1)
        # The router computes its scores under float32 autocast, which the CPU does not
        # honour; stock multiplies the expert outputs by them in float32 either way.
        out_TD = self.inner_experts(
            x_BLD.reshape(B * L, D),
            topk_expert_ids_BLK.reshape(B * L, K),
            RouterScores(topk_scores_BLK.reshape(B * L, K).float()),
        )
        # (B, L, D) as stock returns it, so that the local_map output sharding stays a plain Shard.
        return out_TD.view(B, -1, D)

    def parallelize(self, parallel_dims) -> None:
        """Parallelize the experts as stock, then hand them the EP group."""
        if self.runs_stock:
            super().parallelize(parallel_dims)
            return
        Module.parallelize(self, parallel_dims)
        ep_mesh = parallel_dims.get_optional_mesh("ep")
        self.inner_experts.ep_group = ep_mesh.get_group() if ep_mesh is not None else None

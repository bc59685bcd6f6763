"""TorchTitan 0.3.0 overrides for A/B runs: the stock twin of a config with mega_moe.

    --override.imports titan_megamoe.torchtitan03.overrides.stock_routed_experts
    --override.imports 'titan_megamoe.torchtitan03.overrides.stock_routed_experts={"drop_quantize": true}'

TorchTitan applies overrides to the config tree before it builds anything: every
``MegaRoutedExperts`` config becomes the ``RoutedExperts`` config the converters before
``MegaMoEConverter`` left (torchao's quantized experts and token dispatcher where one of
its grouped-experts converters ran), with the sharding TorchTitan gave the layer; with
``drop_quantize`` also without torchao (stock TorchTitan in bf16).
``scripts/ab_train_torchtitan03.sh`` trains a config as written and with this override.
"""

from dataclasses import fields, replace

from torchtitan.config.override import override
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, TorchAOTokenDispatcher

from titan_megamoe.torchtitan03.routed_experts import MegaRoutedExperts


def mega_moe_layers(trainer_config) -> int:
    """How many routed-experts configs of ``trainer_config`` (a ``Trainer.Config``) mega_moe runs."""
    return sum(1 for _ in trainer_config.model_spec.model.traverse(MegaRoutedExperts.Config))


@override(target=MegaRoutedExperts.Config, description="mega_moe's stock twin: TorchTitan's own routed experts")
def stock_routed_experts(config: MegaRoutedExperts.Config, drop_quantize: bool = False) -> RoutedExperts.Config:
    experts, dispatcher = config.stock_experts.config, config.token_dispatcher
    if drop_quantize:
        experts = GroupedExperts.Config(**{f.name: getattr(experts, f.name)
                                           for f in fields(GroupedExperts.Config) if f.init})
        if isinstance(dispatcher, TorchAOTokenDispatcher.Config):  # torchao's converters pad the expert groups
            dispatcher = AllToAllTokenDispatcher.Config(num_experts=dispatcher.num_experts, top_k=dispatcher.top_k)
    return RoutedExperts.Config(
        param_init=config.param_init,
        sharding_config=config.sharding_config,
        inner_experts=replace(experts, sharding_config=config.inner_experts.sharding_config),
        token_dispatcher=dispatcher,
    )

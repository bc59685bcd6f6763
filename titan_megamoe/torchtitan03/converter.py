"""The ``mega_moe`` converter of TorchTitan 0.3.0: ``MegaMoEConverter``.

A 0.3.0 config function lists its Config among the model's converters, after any torchao
grouped-experts converter::

    from titan_megamoe.torchtitan03 import MegaMoEConverter

    model_spec = model_registry("30B-A3B", converters=[MegaMoEConverter.Config(precision="auto", backend="auto")])

The Config's fields are those of TorchTitan 0.2.2's ``[mega_moe]`` section
(``titan_megamoe.config.MegaMoE``). ``convert`` rewrites the model config before it is built:

- every ``moe.routed_experts`` whose experts are ``GroupedExperts`` (SwiGLU experts, as
  qwen3, qwen3_5, deepseek_v3 and kimi_k2_7 build them) becomes a ``MegaRoutedExperts``
  config; other experts (gpt_oss's) and other token dispatchers are refused;
- a torchao grouped-experts converter listed before it (``TORCHAO_GROUPED_EXPERTS``) is
  the precision ``precision = "auto"`` stands for; its quantized experts config is kept
  for the ``stock`` backend only, so that torchao never wraps the weights the operator reads;
- the root config's ``update_from_config`` (its class becomes a subclass of its own),
  which TorchTitan's Trainer calls with the ``Trainer.Config`` before it builds the model,
  then resolves the layers' settings from the job (``titan_megamoe.job_settings``: one log
  line), refusing what the operator cannot serve;
- the operator's forward joins selective activation checkpointing's save ops, so that
  recomputation never repeats its transfers.
"""

import functools
from dataclasses import dataclass, fields

import torch

import torchtitan.distributed.activation_checkpoint as activation_checkpoint
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module
from torchtitan.tools import utils as titan_utils
from torchtitan.tools.logging import logger

from titan_megamoe import job_settings, ops
from titan_megamoe.config import MegaMoE
from titan_megamoe.precision import precision_from_recipe
from titan_megamoe.torchtitan03.routed_experts import MegaGroupedExperts, MegaRoutedExperts, StockExperts
from titan_megamoe.torchtitan03.stock import STOCK_RECIPES, TORCHAO_GROUPED_EXPERTS, TorchaoGroupedExperts


def _torchao_converter_of(experts_config) -> TorchaoGroupedExperts | None:
    return next((entry for entry in TORCHAO_GROUPED_EXPERTS if entry.made(experts_config)), None)


_save_ops_installed = False


def _save_operator_outputs() -> None:
    """Add the operator's forward to selective AC's save ops (idempotent)."""
    global _save_ops_installed
    if _save_ops_installed:
        return
    default_save_ops = activation_checkpoint._get_default_save_ops

    @functools.wraps(default_save_ops)
    def save_ops_with_operator() -> set:
        return default_save_ops() | set(ops.SAVE_LIST_OPS)

    activation_checkpoint._get_default_save_ops = save_ops_with_operator
    _save_ops_installed = True


def _experts_problem(fqn: str, routed: RoutedExperts.Config) -> str | None:
    experts = routed.inner_experts
    torchao = _torchao_converter_of(experts)
    owner = type(experts)._owner.__bases__[0] if torchao else type(experts)._owner
    if owner is not GroupedExperts:
        return (f"{fqn}.inner_experts are {owner.__name__}: mega_moe runs SwiGLU grouped experts "
                "(GroupedExperts: w1, w2, w3, no biases, plain SwiGLU); leave MegaMoEConverter out of this "
                "model's converters")
    dispatcher = routed.token_dispatcher
    if not (isinstance(dispatcher, AllToAllTokenDispatcher.Config) or type(dispatcher) is LocalTokenDispatcher.Config):
        return (f"{fqn}.token_dispatcher is {type(dispatcher).__qualname__}: mega_moe does its own dispatch and "
                "combine; build the model with model_registry(..., moe_comm_backend='standard')")
    return None


def _auto_precision(experts_config) -> tuple[str, str]:
    torchao = _torchao_converter_of(experts_config)
    if torchao is None:
        return precision_from_recipe([], "")
    name, source = precision_from_recipe([torchao.grouped_mm], getattr(experts_config, "recipe_name", ""))
    return name, f"{torchao.converter}, as {source}"


def _plain_experts(experts_config) -> MegaGroupedExperts.Config:
    """The operator's experts config with ``experts_config``'s shapes, initialization and sharding."""
    return MegaGroupedExperts.Config(**{f.name: getattr(experts_config, f.name)
                                        for f in fields(GroupedExperts.Config) if f.init})


def _tokens_per_rank(trainer_config) -> int:
    # As TorchTitan sizes its dispatchers' buffers: CP and TP shard the tokens before MoE.
    p, training = trainer_config.parallelism, trainer_config.training
    return training.local_batch_size * training.seq_len // (p.context_parallel_degree * p.tensor_parallel_degree)


def _expert_dtype(trainer_config) -> torch.dtype:
    # TorchTitan 0.3.0 wraps every decoder in fully_shard (a size-1 mesh without data
    # parallelism), so the experts compute in the mixed-precision parameter dtype.
    training = trainer_config.training
    return torch.bfloat16 if "bfloat16" in (training.dtype, training.mixed_precision_param) else torch.float32


def _job_problems(trainer_config, layers: list[tuple[str, MegaRoutedExperts.Config]]) -> list[str]:
    """What in the job mega_moe cannot serve, each with what to change."""
    p = trainer_config.parallelism
    problems = []
    if p.pipeline_parallel_degree > 1:
        problems.append(f"parallelism.pipeline_parallel_degree = {p.pipeline_parallel_degree}: mega_moe is not "
                        "tested with pipeline schedules; set it to 1")
    if p.tensor_parallel_degree > 1 and p.expert_parallel_degree == 1:
        problems.append(f"parallelism.tensor_parallel_degree = {p.tensor_parallel_degree} with "
                        "expert_parallel_degree = 1: TorchTitan then shards each expert over TP, and mega_moe runs "
                        "whole experts per rank; set expert_parallel_degree > 1 (experts then shard by expert) or "
                        "tensor_parallel_degree = 1")
    for fqn, layer in layers:
        torchao = _torchao_converter_of(layer.inner_experts)
        if torchao is not None or not isinstance(layer.inner_experts, MegaGroupedExperts.Config):
            name = torchao.converter if torchao else type(layer.inner_experts).__qualname__
            problems.append(f"{fqn}.inner_experts were converted again after MegaMoEConverter (by {name}); list "
                            f"{name}.Config() before MegaMoEConverter.Config() in converters")
            break
    return problems


def _stock_problem(resolved: job_settings.ResolvedSettings, layer: MegaRoutedExperts.Config) -> str | None:
    settings = resolved.settings
    if settings.backend != "stock":
        return None
    recipe = STOCK_RECIPES[settings.precision.name]  # the stock backend's check refused the others
    if recipe is None or recipe.made(layer.stock_experts.config):
        return None
    return (f"backend 'stock' runs precision {settings.precision.name!r} as stock TorchTitan does, through torchao's "
            f"{recipe.converter}: list {recipe.converter}.Config() before MegaMoEConverter.Config() in "
            f"converters, or set {layer.section.SETTINGS_NAME} precision = 'bf16'")


def resolve_for_job(model_config, trainer_config) -> None:
    """Resolve the settings of every ``MegaRoutedExperts`` in ``model_config`` for the job
    ``trainer_config`` describes (a ``Trainer.Config``), logging what was chosen."""
    if not hasattr(trainer_config, "training"):
        raise TypeError(
            f"mega_moe resolves its settings from the training job; update_from_config got a "
            f"{type(trainer_config).__qualname__} without a training section (expected a Trainer.Config)"
        )
    layers = [(fqn, cfg) for fqn, cfg, _, _ in model_config.traverse(MegaRoutedExperts.Config)]
    job_settings.refuse_unservable(_job_problems(trainer_config, layers))
    first = layers[0][1]
    facts = job_settings.JobFacts(
        tokens_per_rank=_tokens_per_rank(trainer_config),
        expert_dtype=_expert_dtype(trainer_config),
        device=torch.device(titan_utils.device_type),
        ep_within_node=job_settings.ep_within_node(trainer_config.parallelism.expert_parallel_degree),
    )
    resolved = job_settings.resolve(first.section, lambda: first.auto_precision, facts)
    job_settings.refuse_unservable([problem for problem in [_stock_problem(resolved, first)] if problem])
    for _, layer in layers:
        layer.resolved = resolved


@functools.cache
def _resolving_config_class(base: type) -> type:
    """``base`` (a model's Config class) whose ``update_from_config`` also resolves the
    mega_moe settings for the job; it builds the same model."""

    @dataclass(kw_only=True, slots=True)
    class ResolvingConfig(base):
        def update_from_config(self, *, config, **kwargs) -> None:
            base.update_from_config(self, config=config, **kwargs)
            resolve_for_job(self, config)

    ResolvingConfig.__name__ = base.__name__
    ResolvingConfig.__qualname__ = f"MegaMoE{base.__qualname__}"
    return ResolvingConfig


class MegaMoEConverter(ModelConfigConverter):
    """Swaps the routed experts of TorchTitan 0.3.0's MoE models for the ``mega_moe``
    operator (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config, MegaMoE):
        SETTINGS_NAME = "MegaMoEConverter.Config"

    def __init__(self, config: Config):
        self.config = config

    def convert(self, model_config: Module.Config) -> Module.Config:
        targets = list(model_config.traverse(RoutedExperts.Config))
        if not targets:
            raise ValueError(
                f"MegaMoEConverter found no routed experts in {type(model_config).__qualname__}; is the model an "
                "MoE flavor (e.g. qwen3 debugmodel_moe)?"
            )
        problems = []
        for fqn, routed, _, _ in targets:
            if isinstance(routed, MegaRoutedExperts.Config):
                problems.append(f"{fqn} is converted already: converters lists MegaMoEConverter.Config more than "
                                "once; list it once")
                break
            problems.append(_experts_problem(fqn, routed))
        job_settings.refuse_unservable([problem for problem in problems if problem])

        for _fqn, routed, parent, attr in targets:
            layer = MegaRoutedExperts.Config(
                param_init=routed.param_init,
                sharding_config=routed.sharding_config,
                inner_experts=_plain_experts(routed.inner_experts),
                token_dispatcher=routed.token_dispatcher,
                stock_experts=StockExperts(routed.inner_experts),
                section=self.config,
                auto_precision=_auto_precision(routed.inner_experts),
            )
            if isinstance(parent, list):
                parent[attr] = layer
            else:
                setattr(parent, attr, layer)
        _save_operator_outputs()
        logger.info(f"mega_moe: converted {len(targets)} MoE layers")
        # The root config itself becomes the resolving class (a subclass without fields of
        # its own, so the instance keeps its layout): some model registries (kimi_k2_7)
        # apply converters for their effect on the config and drop what convert returns.
        model_config.__class__ = _resolving_config_class(type(model_config))
        return model_config



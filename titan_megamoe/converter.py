"""The ``mega_moe`` model converter.

Listed in ``model.converters``, it
- swaps every ``torchtitan.models.moe.MoE`` for ``MegaMoE`` (same parameter names);
- makes TorchTitan's own parallelize functions shard converted experts without the
  stock all-to-all hooks (``titan_megamoe.parallel``);
- adds the operator to the selective-activation-checkpoint save lists;
- maps the torchao grouped-MM converter in the same list to a kernel precision, and
  keeps that converter off the routed experts, which it now owns;
- refuses, at convert time, the combinations it cannot serve.
"""

import importlib
import os

import torch
from torch import nn

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.moe import MoE
from torchtitan.protocols import model_converter
from torchtitan.tools.logging import logger
from torchtitan.tools import utils as titan_utils

from titan_megamoe import parallel
from titan_megamoe.layer import MegaMoE, OperatorSettings
from titan_megamoe.ops import resolve_backend, SAVE_LIST_OPS
from titan_megamoe.precision import GROUPED_MM_FLOAT8, GROUPED_MM_MX, precision_from_recipe

CONVERTER_NAME = "mega_moe"

SAC_SAVE_LIST_MODULES = (
    "torchtitan.models.qwen3.infra.parallelize",
    "torchtitan.models.llama4.infra.parallelize",
    "torchtitan.models.deepseek_v3.infra.parallelize",
)
"""Modules whose ``_op_sac_save_list`` TorchTitan's selective AC reads."""


def _unsupported_settings(job_config: JobConfig) -> list[str]:
    """What in ``job_config`` mega_moe cannot serve, each with what to change."""
    p = job_config.parallelism
    problems = []
    if p.expert_parallel_degree > 1 and p.expert_tensor_parallel_degree > 1:
        problems.append(
            f"parallelism.expert_tensor_parallel_degree = {p.expert_tensor_parallel_degree}: "
            "mega_moe runs whole experts per EP rank; set it to 1"
        )
    if p.expert_parallel_comm_backend != "standard":
        problems.append(
            f"parallelism.expert_parallel_comm_backend = {p.expert_parallel_comm_backend!r}: "
            "mega_moe does its own dispatch and combine; set it to 'standard'"
        )
    if p.pipeline_parallel_degree > 1:
        problems.append(
            f"parallelism.pipeline_parallel_degree = {p.pipeline_parallel_degree}: mega_moe is "
            "not tested with pipeline schedules; set it to 1"
        )
    return problems


FUSED_ONLY_SETTINGS = ("capacity_tokens_per_rank", "comm_sms", "gemm1_activations")
"""``[mega_moe]`` keys that only the fused backend reads."""


def _note_fused_only_settings(cfg, backend: str) -> None:
    if backend == "fused":
        return
    defaults = type(cfg)()
    changed = [f"{k} = {getattr(cfg, k)!r}" for k in FUSED_ONLY_SETTINGS if getattr(cfg, k) != getattr(defaults, k)]
    if changed:
        logger.warning(
            f"mega_moe: {', '.join(changed)} only affect the fused backend; backend "
            f"'{backend}' ignores them"
        )


def _ep_within_node(job_config: JobConfig) -> bool:
    """Whether each EP group is GPUs of one node. TorchTitan builds EP from the innermost
    mesh dimensions, so its groups are runs of consecutive ranks of length ep."""
    ep = job_config.parallelism.expert_parallel_degree
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ep))
    return ep <= local and local % ep == 0


class MegaMoEConverter:
    """Model converter ``mega_moe`` (see the module docstring)."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims):
        if not hasattr(job_config, "mega_moe"):
            raise ValueError(
                "model.converters lists 'mega_moe' but the job config has no [mega_moe] "
                "section: add  [job] custom_config_module = \"titan_megamoe.config\""
            )
        problems = _unsupported_settings(job_config)
        if problems:
            raise ValueError("mega_moe cannot serve this job:\n  " + "\n  ".join(problems))

        cfg = job_config.mega_moe
        if cfg.precision == "auto":
            precision, source = precision_from_recipe(
                job_config.model.converters, job_config.quantize.grouped_mm.mx.recipe_name
            )
        else:
            precision, source = cfg.precision, "[mega_moe] precision"
        backend, why = resolve_backend(
            cfg.backend, torch.device(titan_utils.device_type), precision, _ep_within_node(job_config)
        )
        capacity = cfg.capacity_tokens_per_rank or (
            job_config.training.local_batch_size * job_config.training.seq_len
        )
        self.settings = OperatorSettings(
            precision=precision,
            backend=backend,
            capacity_tokens=capacity,
            comm_sms=cfg.comm_sms,
            save_gemm1=cfg.gemm1_activations == "save",
        )
        logger.info(
            f"mega_moe: routed experts run precision '{precision}' (from {source}) "
            f"on backend '{backend}' ({why})"
        )
        _note_fused_only_settings(cfg, backend)
        parallel.install()
        for name in SAC_SAVE_LIST_MODULES:
            importlib.import_module(name)._op_sac_save_list.update(SAVE_LIST_OPS)

    def convert(self, model: nn.Module) -> None:
        targets = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, MoE) and not isinstance(module, MegaMoE)
        ]
        if not targets:
            raise ValueError(
                f"mega_moe found no torchtitan MoE layer in {type(model).__name__}; "
                "is the model an MoE flavor (e.g. qwen3 debugmodel_moe)?"
            )
        for name, moe in targets:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, MegaMoE(moe, self.settings))
        logger.info(f"mega_moe: converted {len(targets)} MoE layers")

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        return


class GroupedMMDefersToMegaMoE(QuantizationConverter):
    """Stand-in for a torchao grouped-MM converter: when ``mega_moe`` is in the same
    converter list, mega_moe owns the routed experts and runs the recipe itself, so the
    stock converter is neither built (its GPU-capability checks would refuse hosts that
    mega_moe serves) nor applied. Otherwise the stock converter runs unchanged."""

    stock_cls: type

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims):
        super().__init__(job_config, parallel_dims)
        self.stock = None
        if CONVERTER_NAME not in job_config.model.converters:
            self.stock = self.stock_cls(job_config, parallel_dims)

    def convert(self, model: nn.Module) -> None:
        if self.stock is not None:
            self.stock.convert(model)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        if self.stock is not None:
            self.stock.post_optimizer_hook(model)


def _register() -> None:
    registry = model_converter._registry_model_converter_cls
    if CONVERTER_NAME in registry:
        return
    model_converter.register_model_converter(MegaMoEConverter, CONVERTER_NAME)
    for name in (GROUPED_MM_FLOAT8, GROUPED_MM_MX):
        stock_cls = registry[name]
        registry[name] = type(
            f"{stock_cls.__name__}DefersToMegaMoE", (GroupedMMDefersToMegaMoE,), {"stock_cls": stock_cls}
        )


_register()

"""The ``mega_moe`` model converter of TorchTitan 0.2.2.

Listed in ``model.converters``, it
- swaps every ``torchtitan.models.moe.MoE`` for ``MegaMoE`` (same parameter names);
- makes TorchTitan's own parallelize functions shard converted experts without the
  stock all-to-all hooks (``titan_megamoe.parallel``);
- adds the operator to the selective-activation-checkpoint save lists;
- maps the torchao grouped-MM converter in the same list to a kernel precision, and
  keeps that converter off the routed experts, which it now owns;
- builds the layers' ``OperatorSettings`` once from ``[mega_moe]``, resolving the
  backend for the device and the dtype the experts will compute in, and logs one line
  saying what it chose and why (``titan_megamoe.job_settings``);
- refuses, at convert time, the combinations it cannot serve.

``titan_megamoe.registry`` registers it with TorchTitan.
"""

from titan_megamoe import titan_version

titan_version.require("0.2", __name__)

import importlib

import torch
from torch import nn

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.moe import MoE
from torchtitan.tools.logging import logger
from torchtitan.tools import utils as titan_utils

from titan_megamoe import job_settings, parallel
from titan_megamoe.layer import MegaMoE
from titan_megamoe.ops import SAVE_LIST_OPS
from titan_megamoe.precision import precision_from_recipe

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
    count = job_config.model.converters.count(CONVERTER_NAME)
    if count > 1:
        problems.append(f"model.converters lists {CONVERTER_NAME!r} {count} times; list it once")
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


def _expert_dtype(job_config: JobConfig, parallel_dims: ParallelDims | None) -> torch.dtype:
    """The dtype the routed experts will compute in: FSDP2's mixed-precision parameter
    dtype where TorchTitan wraps them with ``fully_shard``, else fp32 (its AMP autocast,
    single device or DDP, leaves the expert weights in fp32). No ``parallel_dims``: one
    device."""
    # llama4 and deepseek_v3 apply fully_shard whenever EP is on; qwen3 does only with
    # FSDP, and where the guess is wrong the layer falls back at its first call.
    fsdp = parallel_dims is not None and (parallel_dims.fsdp_enabled or parallel_dims.ep_enabled)
    if fsdp and job_config.training.mixed_precision_param == "bfloat16":
        return torch.bfloat16
    return torch.float32


def _job_facts(job_config: JobConfig, parallel_dims: ParallelDims | None) -> job_settings.JobFacts:
    return job_settings.JobFacts(
        tokens_per_rank=job_config.training.local_batch_size * job_config.training.seq_len,
        expert_dtype=_expert_dtype(job_config, parallel_dims),
        device=torch.device(titan_utils.device_type),
        ep_within_node=job_settings.ep_within_node(job_config.parallelism.expert_parallel_degree),
    )


class MegaMoEConverter:
    """Model converter ``mega_moe`` (see the module docstring).

    ``settings`` is what every converted layer runs with; ``auto_backend`` says its
    backend was chosen by ``[mega_moe] backend = "auto"``.
    """

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims | None):
        if not hasattr(job_config, "mega_moe"):
            raise ValueError(
                "model.converters lists 'mega_moe' but the job config has no [mega_moe] "
                "section: add  [job] custom_config_module = \"titan_megamoe.config\""
            )
        job_settings.refuse_unservable(_unsupported_settings(job_config))
        resolved = job_settings.resolve(
            job_config.mega_moe,
            lambda: precision_from_recipe(job_config.model.converters, job_config.quantize.grouped_mm.mx.recipe_name),
            _job_facts(job_config, parallel_dims),
        )
        self.settings = resolved.settings
        self.auto_backend = resolved.auto_backend
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
            setattr(parent, child, MegaMoE(moe, self.settings, self.auto_backend))
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

"""Expert-parallel plan for converted layers (TorchTitan 0.2.2).

TorchTitan's ``apply_moe_ep_tp`` (used by ``parallelize_qwen3``, ``parallelize_llama``
and ``parallelize_deepseekv3``) applies ``ExpertParallel()`` to every
``moe.experts``: it shards the weights ``Shard(0)`` on the EP mesh and all-to-alls the
tokens in forward hooks. The fused operator moves tokens itself, so converted experts
need the sharding without the hooks.

``install()`` swaps the ``ExpertParallel`` name that ``apply_moe_ep_tp`` looks up for
``ExpertParallelForMegaMoE``, which serves ``MegaExperts`` with ``MegaExpertParallel``
and every other module exactly as stock. TorchTitan's parallelize functions thus run
unchanged, and unconverted layers keep the stock style.
"""

from titan_megamoe import titan_version

titan_version.require("0.2", __name__)

import importlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_module, distribute_tensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.distributed.expert_parallel import ExpertParallel

from titan_megamoe.layer import MegaExperts

PLAN_MODULES = ("torchtitan.models.llama4.infra.parallelize",)
"""Modules whose ``apply_moe_ep_tp`` builds the experts' plan (qwen3 and deepseek_v3
import theirs from llama4)."""


class MegaExpertParallel(ParallelStyle):
    """Shards every expert weight ``Shard(0)`` (by expert) on the EP mesh; no token hooks."""

    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters(recurse=False):
            module.register_parameter(
                param_name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]))
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"mega_moe shards experts on a 1-D EP mesh; got mesh dims {device_mesh.mesh_dim_names}"
            )
        return distribute_module(module, device_mesh, partition_fn=self._partition_fn)


class ExpertParallelForMegaMoE(ExpertParallel):
    """TorchTitan's ``ExpertParallel`` that hands converted experts to ``MegaExpertParallel``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, MegaExperts):
            return MegaExpertParallel()._apply(module, device_mesh)
        return super()._apply(module, device_mesh)


def install() -> None:
    """Make TorchTitan's MoE parallelization serve converted layers (idempotent)."""
    for name in PLAN_MODULES:
        module = importlib.import_module(name)
        if module.ExpertParallel is not ExpertParallelForMegaMoE:
            module.ExpertParallel = ExpertParallelForMegaMoE

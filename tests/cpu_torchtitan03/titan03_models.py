"""TorchTitan 0.3.0 models for the CPU tests: qwen3 ``debugmodel_moe`` cut to a few layers,
built and parallelized as TorchTitan's Trainer builds them.

The CPU cannot run TorchTitan's attention backward (FlexAttention), so the layers attend
with ``ScaledDotProductAttention`` (causal, no document masks), as TorchTitan's own CPU
tests do. gloo's list all-to-all takes equal splits only, which TorchTitan's
``spmd_types`` backend uses for its stock dispatch, so stock models run the
``partial_dtensor`` backend.
"""

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims, utils as dist_utils
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts
from torchtitan.models.qwen3 import model_registry, parallelize_qwen3
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from titan_megamoe.torchtitan03 import MegaRoutedExperts

VOCAB = 2048
"""debugmodel_moe's vocabulary."""


class Float32GroupedExperts(GroupedExperts):
    """The SwiGLU experts in the parameters' dtype (TorchTitan's ``GroupedExperts`` casts
    every GEMM to bf16): the stock side of comparisons at float32 tolerances."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        gate = torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offsets)
        up = torch._grouped_mm(x_RD, w3.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)


def debug_moe_spec(converters=(), n_layers: int = 2, float32_experts: bool = False, flavor: str = "debugmodel_moe",
                   family=None) -> ModelSpec:
    """``flavor`` of ``family`` (a ``torchtitan.models`` package, qwen3 by default) with
    ``converters``, cut to ``n_layers`` layers, attending with SDPA; with
    ``float32_experts`` its stock experts compute in the parameters' dtype."""
    registry = family.model_registry if family is not None else model_registry
    spec = registry(flavor, converters=list(converters))
    config = spec.model
    config.layers = config.layers[:n_layers]
    for layer in config.layers:
        attention = getattr(layer, "attention", None)
        if attention is not None and hasattr(attention, "inner_attention"):
            attention.inner_attention = ScaledDotProductAttention.Config()
    if float32_experts:
        for _, routed, _, _ in config.traverse(RoutedExperts.Config):
            routed.inner_experts = Float32GroupedExperts.Config(
                **{f.name: getattr(routed.inner_experts, f.name) for f in fields(GroupedExperts.Config) if f.init})
    return spec


def shrink_moe(spec: ModelSpec, num_experts: int, top_k: int, hidden_dim: int) -> None:
    """Give every MoE layer of ``spec`` ``num_experts`` experts of ``hidden_dim``, ``top_k``
    of them per token (tests under the Triton interpreter, which is slow)."""
    for _, moe, _, _ in spec.model.traverse(MoE.Config):
        moe.num_experts = num_experts
        moe.router.num_experts = moe.router.gate.out_features = num_experts
        moe.router.top_k = top_k
        routed = moe.routed_experts
        experts_configs = [routed.inner_experts]
        if isinstance(routed, MegaRoutedExperts.Config):
            experts_configs.append(routed.stock_experts.config)
        for experts in experts_configs:
            experts.num_experts, experts.hidden_dim = num_experts, hidden_dim
        routed.token_dispatcher.num_experts, routed.token_dispatcher.top_k = num_experts, top_k


def trainer_config(spec: ModelSpec, *, seq_len: int = 32, local_batch_size: int = 2, ep: int = 2, tp: int = 1,
                   pp: int = 1, param_dtype: str = "float32", spmd_backend: str = "partial_dtensor",
                   steps: int = 3) -> Trainer.Config:
    return Trainer.Config(
        model_spec=spec,
        training=TrainingConfig(local_batch_size=local_batch_size, seq_len=seq_len, steps=steps,
                                mixed_precision_param=param_dtype, disable_cuda_graphs=True),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1, expert_parallel_degree=ep,
                                      tensor_parallel_degree=tp, pipeline_parallel_degree=pp,
                                      spmd_backend=spmd_backend),
        activation_checkpoint=None,
    )


def build(spec: ModelSpec, config: Trainer.Config, world_size: int, state: dict | None = None):
    """``spec``'s model as the Trainer builds it for ``config`` on ``world_size`` ranks
    (``update_from_config``, build, parallelize), with weights from ``state`` (full
    tensors) or a seeded initialization."""
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    dims = ParallelDims.from_config(config.parallelism, world_size)
    dims.build_mesh()
    spec.model.update_from_config(config=config)
    torch.manual_seed(0)
    model = spec.model.build()
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    if state is not None:
        model.load_state_dict(state)
    return parallelize_qwen3(
        model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=config.dump_folder,
    )

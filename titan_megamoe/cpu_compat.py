"""Lets stock TorchTitan 0.2.2 run its MoE layer on a host without CUDA (gloo ranks).

Used by the CPU layer A/B and the CPU tests; on a CUDA host ``apply()`` does nothing.
Each patch works around one TorchTitan 0.2.2 assumption:

- ``torchtitan.tools.utils`` picks "cuda" as device type when no accelerator is found,
  and the mesh builders import that value;
- the router counts tokens per expert with ``torch.histc`` on integers, which PyTorch
  implements on CUDA only;
- ``generate_permute_indices`` runs a Triton kernel unless told ``use_cpu=True``;
- its attention wrapper prefers the CPU flash kernel, which DTensor cannot shard
  (tensor parallelism), so the math kernel is chosen instead;
- gloo has no PREMUL_SUM reduction, which FSDP2 uses for gradient averaging
  (``force_sum_reduction`` below, called on the model after parallelization).
"""

import functools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

_applied = False


def _histc_accepting_integers(histc):
    @functools.wraps(histc)
    def wrapper(input, *args, **kwargs):
        if input.is_floating_point():
            return histc(input, *args, **kwargs)
        # CUDA returns integer counts for integer input; so does this.
        return histc(input.float(), *args, **kwargs).to(input.dtype)

    return wrapper


def apply() -> None:
    """Patch TorchTitan for CPU-only hosts (idempotent; no-op where CUDA is available)."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.moe.utils as moe_utils
    from torch.nn.attention import SDPBackend
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper
    import torchtitan.tools.utils as titan_utils

    for module in (titan_utils, parallel_dims, dist_utils, metrics):
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu
    torch.histc = _histc_accepting_integers(torch.histc)
    moe_utils.generate_permute_indices = functools.partial(
        moe_utils.generate_permute_indices, use_cpu=True
    )
    ScaledDotProductAttentionWrapper.sdpa_backends = [SDPBackend.MATH]
    _applied = True


def force_sum_reduction(model: nn.Module) -> None:
    """Have every FSDP2 module of ``model`` reduce gradients with SUM (gloo lacks PREMUL_SUM)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)

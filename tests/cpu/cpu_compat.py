"""Lets stock TorchTitan run its MoE layers (0.2.2) and its trainer (0.3.0) on a host
without CUDA (gloo ranks).

Support code of the CPU tests and of the CPU layer A/B (``scripts/bench_layer.py``), not
of the package: nothing a user's job runs patches torch or TorchTitan. On a CUDA host
``apply()`` does nothing.
It applies the patches of the installed TorchTitan (``PATCHES``); each works around one
assumption of that release:

- both pick "cuda" as device type when no accelerator is found
  (``torchtitan.tools.utils``), and other modules import that value;
- 0.2.2's router counts tokens per expert with ``torch.histc`` on integers, which
  PyTorch implements on CUDA only;
- 0.2.2's ``generate_permute_indices`` runs a Triton kernel unless told ``use_cpu=True``;
- 0.2.2's attention wrapper prefers the CPU flash kernel, which DTensor cannot shard
  (tensor parallelism), so the math kernel is chosen instead;
- 0.3.0's trainer sets the device, and its metrics read the device's name, capacity and
  memory statistics, through the device module, which ``torch.cpu`` only partly has
  (``CpuDeviceModule``: capacity is the host's memory, statistics are empty);
- gloo has no PREMUL_SUM reduction, which FSDP2 uses for gradient averaging
  (``force_sum_reduction`` below, called on the model after parallelization; 0.3.0's
  trainer parallelizes the model itself, so its ``fully_shard`` is patched to do it).
"""

import functools
import importlib
import os
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from titan_megamoe import titan_version

_applied = False


def _histc_accepting_integers(histc):
    @functools.wraps(histc)
    def wrapper(input, *args, **kwargs):
        if input.is_floating_point():
            return histc(input, *args, **kwargs)
        # CUDA returns integer counts for integer input; so does this.
        return histc(input.float(), *args, **kwargs).to(input.dtype)

    return wrapper


def _set_cpu_device(module_names: tuple[str, ...], device_module) -> None:
    for name in module_names:
        module = importlib.import_module(name)
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = device_module


def _patch_torchtitan_0_2() -> None:
    import torchtitan.models.moe.utils as moe_utils
    from torch.nn.attention import SDPBackend
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    _set_cpu_device(("torchtitan.tools.utils", "torchtitan.distributed.parallel_dims",
                     "torchtitan.distributed.utils", "torchtitan.components.metrics"), torch.cpu)
    torch.histc = _histc_accepting_integers(torch.histc)
    moe_utils.generate_permute_indices = functools.partial(
        moe_utils.generate_permute_indices, use_cpu=True
    )
    ScaledDotProductAttentionWrapper.sdpa_backends = [SDPBackend.MATH]


class CpuDeviceModule:
    """``torch.cpu`` with what TorchTitan 0.3.0's trainer and metrics call on a device
    module: device index 0 (``torch.cpu.current_device()`` is the string "cpu", which a
    barrier's ``device_ids`` refuses), the host's memory as capacity, no memory
    statistics (the step lines then show -0.00GiB), nothing to reset or empty."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None) -> SimpleNamespace:
        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def _fully_shard_reducing_with_sum(fully_shard):
    @functools.wraps(fully_shard)
    def wrapper(module, *args, **kwargs):
        sharded = fully_shard(module, *args, **kwargs)
        for part in sharded if isinstance(sharded, list) else [sharded]:  # fully_shard takes a module or a list
            force_sum_reduction(part)
        return sharded

    return wrapper


def _patch_torchtitan_0_3() -> None:
    import torchtitan.distributed.fsdp as titan_fsdp

    titan_fsdp.fully_shard = _fully_shard_reducing_with_sum(titan_fsdp.fully_shard)
    _set_cpu_device(("torchtitan.tools.utils", "torchtitan.distributed.parallel_dims",
                     "torchtitan.distributed.utils", "torchtitan.components.metrics",
                     "torchtitan.models.common.token_dispatcher", "torchtitan.tools.profiler"),
                    CpuDeviceModule())


PATCHES = {"0.2": _patch_torchtitan_0_2, "0.3": _patch_torchtitan_0_3}
"""TorchTitan series -> what it needs patched on a CPU-only host."""


def apply() -> None:
    """Patch the installed TorchTitan for CPU-only hosts (idempotent; no-op where CUDA is available)."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    PATCHES[titan_version.installed_series()]()
    _applied = True


def force_sum_reduction(model: nn.Module) -> None:
    """Have every FSDP2 module of ``model`` reduce gradients with SUM (gloo lacks PREMUL_SUM)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)

"""Symmetric buffers: memory that every rank of an EP group can address over NVLink.

Allocated through ``torch.distributed._symmetric_memory`` (CUDA backend, NVLink
multicast off: the operator only needs peer loads and stores) and exchanged once with
``rendezvous``; the kernels then receive an int64 tensor of every rank's address. A
single-rank group (or a CPU run under the Triton interpreter) gets plain local memory
behind the same interface.
"""

import os
import socket

import torch
import torch.distributed as dist

from titan_megamoe.kernels.forward import SymmetricAllocator


def _local(device: torch.device) -> SymmetricAllocator:
    def allocate(shape: tuple[int, ...], dtype: torch.dtype):
        t = torch.zeros(shape, dtype=dtype, device=device)
        return t, torch.tensor([t.data_ptr()], dtype=torch.int64, device=device)

    return allocate


def _nvlink(group: dist.ProcessGroup, device: torch.device) -> SymmetricAllocator:
    # Read by the allocator when it first runs; multicast objects are never used here.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed._symmetric_memory as symm_mem

    if symm_mem.get_backend(device) != "CUDA":
        symm_mem.set_backend("CUDA")

    def allocate(shape: tuple[int, ...], dtype: torch.dtype):
        t = symm_mem.empty(shape, dtype=dtype, device=device)
        t.zero_()
        # Peers may write into ``t`` as soon as the rendezvous returns: zero it first.
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(t, group.group_name)
        return t, torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)

    return allocate


def _check_one_node(group: dist.ProcessGroup) -> None:
    hosts = [None] * group.size()
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        raise RuntimeError(
            f"mega_moe fused backend: the EP group spans hosts {sorted(set(hosts))}; its "
            "buffers need NVLink peers on one node. Use an EP degree within a node or "
            "backend = 'reference'"
        )


def allocator(group: dist.ProcessGroup | None, device: torch.device) -> SymmetricAllocator:
    """The allocator for buffers shared by ``group`` (None: this rank alone). Called once
    per buffer set; checks (collectively) that the group is on one node."""
    if group is None or group.size() == 1:
        return _local(device)
    _check_one_node(group)
    if device.type != "cuda":
        raise ValueError(f"symmetric buffers over {group.size()} ranks need CUDA devices; got {device}")
    return _nvlink(group, device)

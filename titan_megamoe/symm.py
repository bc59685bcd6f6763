"""Symmetric buffers: memory that every rank of an EP group can address over NVLink.

Allocated through ``torch.distributed._symmetric_memory`` (CUDA backend, NVLink
multicast off: the operator only needs peer loads and stores) and exchanged once with
``rendezvous``; the kernels then receive an int64 tensor of every rank's address. A
single-rank group (or a CPU run under the Triton interpreter) gets plain local memory
behind the same interface.

:class:`VirtualGroup` runs ``ep`` ranks of one group inside one process on one GPU (torch's
symmetric memory refuses two processes on one GPU): each virtual rank's buffers are its
own allocations, its peers' addresses are those of the other ranks' allocations, each rank
launches on its own stream, and each gets ``1 / ep`` of the GPU's SMs, so that every rank's
spinning programs are resident at once. Each rank's calls are made from a thread of its
own: a rank's allocations (and growth, ``kernels.buffers``) synchronise the device, which
must not happen while another rank's thread has not yet launched what this one waits for.
It exists to exercise the layouts and the flag protocol at EP = 4 and 8 where fewer GPUs
are at hand (and, on the CPU under the Triton interpreter, a rank that never arrives).
"""

import os
import socket
import threading

import torch
import torch.distributed as dist

from titan_megamoe.kernels.buffers import SymmetricAllocator


class VirtualGroup:
    """``ep`` ranks of one EP group inside this process, on ``device``."""

    def __init__(self, ep: int, device: torch.device, name: str = "virtual"):
        if device.type == "cuda":
            # Kernels of streams that share one of the GPU's hardware queues run in launch
            # order: a rank's kernel queued behind a peer's spinning kernel would never start.
            connections = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))
            if connections < ep + 1:
                raise ValueError(
                    f"{ep} virtual ranks need a hardware queue per stream: set "
                    f"CUDA_DEVICE_MAX_CONNECTIONS >= {ep + 1} before CUDA starts (it is {connections})"
                )
        self.ep, self.device, self.name = ep, device, name
        self._sets: list[list[torch.Tensor]] = []
        """Every allocation made so far: one copy per rank, in allocation order."""
        self._next = [0] * ep
        self._lock = threading.Lock()
        """Held while a rank's thread takes an allocation: the first to ask makes every
        rank's copy and synchronises the device before any other rank may use one."""
        self.ranks = [VirtualRank(self, r) for r in range(ep)]

    def _allocate(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype):
        with self._lock:
            index = self._next[rank]
            self._next[rank] += 1
            if index == len(self._sets):
                # Every copy at once, zeroed before any rank's stream may write into a peer's.
                self._sets.append([torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.ep)])
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            copies = self._sets[index]
        if copies[rank].shape != torch.Size(shape) or copies[rank].dtype != dtype:
            raise ValueError(
                f"virtual rank {rank} asked for allocation {index} as {tuple(shape)} {dtype}; "
                f"rank 0 made it {tuple(copies[rank].shape)} {copies[rank].dtype}: the ranks disagree"
            )
        ptrs = torch.tensor([c.data_ptr() for c in copies], dtype=torch.int64, device=self.device)
        return copies[rank], ptrs


class VirtualRank:
    """One rank of a :class:`VirtualGroup`: what the fused backend takes as ``group``."""

    def __init__(self, group: VirtualGroup, rank: int):
        self._group, self._rank = group, rank
        self.group_name = f"{group.name}:{group.ep}"
        self.stream = torch.cuda.Stream(group.device) if group.device.type == "cuda" else None
        """The stream this rank's calls must be made on (GPUs)."""

    def size(self) -> int:
        return self._group.ep

    def rank(self) -> int:
        return self._rank

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype):
        return self._group._allocate(self._rank, shape, dtype)


Group = dist.ProcessGroup | VirtualRank | None


def in_caching_allocator(group: Group) -> bool:
    """Whether ``group``'s symmetric buffers are allocations of PyTorch's caching allocator
    (a single rank, virtual ranks), which ``torch.cuda.memory_allocated`` counts, rather
    than torch's symmetric memory, which it does not."""
    return not isinstance(group, dist.ProcessGroup) or group.size() == 1


def ranks_per_device(group: Group) -> int:
    """How many ranks of ``group`` share this GPU (its SMs are split between them)."""
    return group.size() if isinstance(group, VirtualRank) else 1


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


def _check_agreement(group: dist.ProcessGroup, sized_for: str) -> None:
    """Every rank of ``group`` is on one host and sizes its buffers alike (collective)."""
    gathered = [None] * group.size()
    dist.all_gather_object(gathered, (socket.gethostname(), sized_for), group=group)
    hosts = sorted({host for host, _ in gathered})
    if len(hosts) > 1:
        raise RuntimeError(
            f"mega_moe fused backend: the EP group spans hosts {hosts}; its buffers need "
            "NVLink peers on one node. Use an EP degree within a node or backend = 'stock'"
        )
    sizes = {what for _, what in gathered}
    if len(sizes) > 1:
        by_rank = "\n  ".join(f"rank {r}: {what}" for r, (_, what) in enumerate(gathered))
        raise ValueError(
            "mega_moe fused backend: the ranks of the EP group would size their symmetric "
            f"buffers differently (every rank must pass the same capacity_tokens_per_rank, "
            f"expert count and shapes):\n  {by_rank}"
        )


def allocator(group: Group, device: torch.device, sized_for: str) -> SymmetricAllocator:
    """The allocator for one buffer set shared by ``group`` (None: this rank alone).
    ``sized_for`` describes what the set is sized for; for a real group of several ranks
    this checks, collectively and once per set, that every rank is on one host and
    describes the same thing."""
    if isinstance(group, VirtualRank):
        return group.allocate
    if group is None or group.size() == 1:
        return _local(device)
    _check_agreement(group, sized_for)
    if device.type != "cuda":
        raise ValueError(f"symmetric buffers over {group.size()} ranks need CUDA devices; got {device}")
    return _nvlink(group, device)

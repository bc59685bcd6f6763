"""Host side of the fused forward: the buffers it needs and the four launches.

Nothing here synchronises with the host: counts, offsets and tile counts are computed
and read on the device, and every grid is sized by capacity.
"""

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import triton

from titan_megamoe.kernels.configs import TILE_CONFIGS
from titan_megamoe.kernels.dispatch_gemm1 import dispatch_gemm1_kernel
from titan_megamoe.kernels.gemm2_combine import combine_reduce_kernel, gemm2_combine_kernel
from titan_megamoe.kernels.layout import STATE_WORDS, layout_kernel
from titan_megamoe.kernels.sync import STATUS_WORDS, TIMEOUT_COUNTERS, FlagLayout

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

SymmetricAllocator = Callable[[tuple[int, ...], torch.dtype], tuple[torch.Tensor, torch.Tensor]]
"""``(shape, dtype) -> (this rank's zeroed buffer, int64 tensor of every rank's address)``."""


@dataclass(frozen=True)
class ForwardShape:
    """What the buffers are sized for. Every rank of the group must use the same one."""

    ep: int
    rank: int
    capacity_tokens: int
    """Most tokens any rank passes in one call."""
    top_k: int
    local_experts: int
    hidden: int
    inter: int
    dtype: torch.dtype

    @property
    def rows_per_rank(self) -> int:
        return self.capacity_tokens * self.top_k

    def receive_rows(self, block_m: int) -> int:
        """Rows of the receive buffer: every source's every row (any routing fits) plus
        each expert's alignment padding."""
        rows = self.ep * self.rows_per_rank + self.local_experts * (block_m - 1)
        return math.ceil(rows / block_m) * block_m


def _pad(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


class ForwardBuffers:
    """Everything one (group, shape) needs, allocated once and reused by every call.

    Symmetric (peers write into them): the receive buffer and the origin of each of its
    rows, the combine buffer, the flag buffer. Local: GEMM1's output ``h``, the layout
    arrays, the per-call state and the status record (in host memory on GPUs, so the host
    can read a timeout without synchronising).
    """

    def __init__(self, shape: ForwardShape, device: torch.device, symmetric: SymmetricAllocator):
        self.shape = shape
        self.tiles = TILE_CONFIGS["interpret" if INTERPRET else "sm90"]
        bm = self.tiles.block_m
        rows = shape.receive_rows(bm)
        self.flag_layout = FlagLayout(
            ep=shape.ep,
            local_experts=shape.local_experts,
            max_chunks=math.ceil(shape.rows_per_rank / bm),
        )
        self.recv, self.recv_ptrs = symmetric((rows, shape.hidden), shape.dtype)
        self.recv_meta, self.recv_meta_ptrs = symmetric((rows,), torch.int32)
        self.combine, self.combine_ptrs = symmetric((shape.rows_per_rank, shape.hidden), shape.dtype)
        self.flags, self.flag_ptrs = symmetric((self.flag_layout.words,), torch.int32)

        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        num_experts = shape.ep * shape.local_experts
        self.h = torch.empty(rows, shape.inter, dtype=shape.dtype, device=device)
        self.state = ints(STATE_WORDS)
        self.dest_start = ints(num_experts)
        self.item_start = ints(num_experts)
        self.local_base = ints(shape.local_experts)
        self.local_rows = ints(shape.local_experts)
        self.src_offset = ints(shape.ep * shape.local_experts)
        self.src_rows = ints(shape.ep * shape.local_experts)
        self.expert_edges = torch.arange(num_experts + 1, dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        self.status = torch.zeros(STATUS_WORDS, dtype=torch.int32, pin_memory=pinned)

    @property
    def symmetric_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.recv, self.recv_meta, self.combine, self.flags))

    @property
    def local_bytes(self) -> int:
        return self.h.numel() * self.h.element_size()

    def raise_if_timed_out(self) -> None:
        """Raise if a wait of an earlier call timed out (reads host memory only)."""
        code, rank, index, seen, expected = self.status[:5].tolist()
        if code:
            raise RuntimeError(
                f"mega_moe fused forward: rank {rank} timed out waiting for "
                f"{TIMEOUT_COUNTERS.get(code, code)}[{index}] (value {seen}, expected {expected}); "
                "a peer stopped or fell far behind. The operator's results since then are invalid."
            )


def fused_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    buffers: ForwardBuffers,
    score_before_experts: bool,
    comm_programs: int,
    num_programs: int,
    max_spins: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y [T, H]`` and the rows received per local expert (int64), see ``reference``.

    ``num_programs`` persistent programs run each GEMM; the first ``comm_programs`` of
    them dispatch before they join GEMM1.
    """
    shape, tiles, flags = buffers.shape, buffers.tiles, buffers.flag_layout
    num_tokens, top_k = topk_idx.shape
    if num_tokens > shape.capacity_tokens:
        raise ValueError(
            f"mega_moe fused forward: {num_tokens} tokens exceed the capacity of "
            f"{shape.capacity_tokens} tokens per rank its buffers were sized for"
        )
    if not 0 < comm_programs < num_programs:
        raise ValueError(f"comm_programs = {comm_programs} must be in [1, {num_programs - 1}]")
    buffers.raise_if_timed_out()
    ep_pad, local_pad = _pad(shape.ep), _pad(shape.local_experts)
    status_addr = buffers.status.data_ptr()

    flat = topk_idx.reshape(-1).to(torch.int32)
    sorted_experts, order = torch.sort(flat, stable=True)
    send_start = torch.searchsorted(sorted_experts, buffers.expert_edges, out_int32=True)
    order = order.to(torch.int32)
    tokens_per_expert = torch.empty(shape.local_experts, dtype=torch.int64, device=x.device)

    layout_kernel[(1,)](
        send_start, buffers.flags, buffers.flag_ptrs, buffers.state, buffers.dest_start,
        buffers.item_start, buffers.local_base, buffers.local_rows, buffers.src_offset,
        buffers.src_rows, tokens_per_expert, status_addr, shape.rank, shape.ep,
        shape.local_experts, max_spins,
        COUNTS=flags.counts, COUNT_READY=flags.count_ready, EP_PAD=ep_pad,
        LOCAL_PAD=local_pad, BLOCK_M=tiles.block_m, num_warps=4,
    )
    dispatch_gemm1_kernel[(num_programs,)](
        x, topk_w, order, send_start, buffers.dest_start, buffers.item_start,
        buffers.recv_ptrs, buffers.recv_meta_ptrs, buffers.flag_ptrs, buffers.recv,
        buffers.recv_meta, buffers.flags, buffers.state, buffers.local_base, buffers.src_offset,
        buffers.src_rows, w1, w3, buffers.h, status_addr, shape.rank, shape.ep,
        shape.local_experts, shape.rows_per_rank, max_spins,
        HIDDEN=shape.hidden, INTER=shape.inter, TOP_K=top_k,
        SCORE_BEFORE_EXPERTS=score_before_experts, COMM_PROGRAMS=comm_programs,
        CHUNK_READY=flags.chunk_ready, MAX_CHUNKS=flags.max_chunks,
        EP_PAD=ep_pad, LOCAL_PAD=local_pad, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.gemm1_n, BLOCK_K=tiles.gemm1_k, COPY_ROWS=tiles.copy_rows,
        COPY_COLS=tiles.copy_cols, UPCAST_DOT=INTERPRET,
        num_warps=tiles.gemm1_warps, num_stages=tiles.gemm1_stages,
    )
    gemm2_combine_kernel[(num_programs,)](
        buffers.h, w2, buffers.recv_meta, buffers.combine, buffers.combine_ptrs, buffers.flags,
        buffers.flag_ptrs,
        buffers.state, buffers.local_base, buffers.local_rows, shape.rank, shape.ep,
        shape.local_experts, shape.rows_per_rank,
        HIDDEN=shape.hidden, INTER=shape.inter, COMBINE_READY=flags.combine_ready,
        LOCAL_PAD=local_pad, BLOCK_M=tiles.block_m, BLOCK_N=tiles.gemm2_n,
        BLOCK_K=tiles.gemm2_k, UPCAST_DOT=INTERPRET,
        num_warps=tiles.gemm2_warps, num_stages=tiles.gemm2_stages,
    )
    y = torch.empty_like(x)
    grid = (max(1, triton.cdiv(num_tokens, tiles.reduce_tokens)), triton.cdiv(shape.hidden, tiles.reduce_cols))
    combine_reduce_kernel[grid](
        buffers.combine, topk_w, y, buffers.flags, buffers.state, num_tokens, status_addr,
        shape.rank, shape.ep, max_spins,
        HIDDEN=shape.hidden, TOP_K=top_k, SCORE_BEFORE_EXPERTS=score_before_experts,
        COMBINE_READY=flags.combine_ready, EP_PAD=ep_pad,
        BLOCK_T=tiles.reduce_tokens, BLOCK_H=tiles.reduce_cols, num_warps=4,
    )
    return y, tokens_per_expert

"""Host side of the fused forward: the buffers it needs, the routing layout (shared with
the backward) and the four launches.

Nothing here synchronises with the host: counts, offsets and tile counts are computed
and read on the device, and every grid is sized by capacity.
"""

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import triton

from titan_megamoe.kernels.configs import TILE_CONFIGS, TileConfig
from titan_megamoe.kernels.dispatch_gemm1 import dispatch_gemm1_kernel
from titan_megamoe.kernels.gemm2_combine import combine_reduce_kernel, rows_gemm_combine_kernel
from titan_megamoe.kernels.layout import STATE_WORDS, layout_kernel
from titan_megamoe.kernels.sync import STATUS_WORDS, TIMEOUT_COUNTERS, FlagLayout

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def tile_config() -> TileConfig:
    """The tile table row for where the kernels run: the GPU, or the interpreter."""
    return TILE_CONFIGS["interpret" if INTERPRET else "sm90"]


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


class ForwardBuffers:
    """Everything one (group, shape) needs, allocated once and reused by every call.

    Symmetric (peers write into them): the receive buffer and the origin of each of its
    rows, the combine buffer, the flag buffer. Local: GEMM1's output ``h``, the layout
    arrays, the per-call state and the status record (in host memory on GPUs, so the host
    can read a timeout without synchronising).
    """

    def __init__(self, shape: ForwardShape, device: torch.device, symmetric: SymmetricAllocator):
        self.shape = shape
        self.tiles = tile_config()
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
        self.calls = 0
        """Calls (forward or backward) made on these buffers, counted on the host."""
        self.resident = None
        """``(call, inputs_key)`` of the forward whose expert inputs the receive buffer holds."""

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
                f"mega_moe fused kernels: rank {rank} timed out waiting for "
                f"{TIMEOUT_COUNTERS.get(code, code)}[{index}] (value {seen}, expected {expected}); "
                "a peer stopped or fell far behind. The operator's results since then are invalid."
            )


def pad(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def check_call(num_tokens: int, buffers: ForwardBuffers, comm_programs: int, num_programs: int, what: str) -> None:
    """Raise before any launch if this call cannot run on ``buffers``."""
    if num_tokens > buffers.shape.capacity_tokens:
        raise ValueError(
            f"mega_moe fused {what}: {num_tokens} tokens exceed the capacity of "
            f"{buffers.shape.capacity_tokens} tokens per rank its buffers were sized for"
        )
    if not 0 < comm_programs < num_programs:
        raise ValueError(f"comm_programs = {comm_programs} must be in [1, {num_programs - 1}]")
    buffers.raise_if_timed_out()


def inputs_key(x, topk_idx, topk_w, w1, w3, score_before_experts: bool) -> tuple:
    """What identifies the expert inputs a forward dispatched: each tensor's storage and
    version (a tensor changed in place, or freed and replaced, gives another key)."""
    return (score_before_experts,) + tuple(
        (t.data_ptr(), -1 if t.is_inference() else t._version) for t in (x, topk_idx, topk_w, w1, w3)
    )


def route(topk_idx: torch.Tensor, buffers: ForwardBuffers, max_spins: int, needs_input: bool = True):
    """Sort this rank's rows by expert and run the layout kernel (a new epoch; its count
    exchange is also the call's start barrier, see ``sync``). ``needs_input``: whether
    the peers must send this rank its expert inputs (published as NEEDS_INPUT).

    Returns the rows' send order (flat slot ids), each expert's first position in it, and
    the rows received per local expert (int64)."""
    shape, flags = buffers.shape, buffers.flag_layout
    flat = topk_idx.reshape(-1).to(torch.int32)
    sorted_experts, order = torch.sort(flat, stable=True)
    send_start = torch.searchsorted(sorted_experts, buffers.expert_edges, out_int32=True)
    tokens_per_expert = torch.empty(shape.local_experts, dtype=torch.int64, device=topk_idx.device)
    buffers.calls += 1
    layout_kernel[(1,)](
        send_start, buffers.flags, buffers.flag_ptrs, buffers.state, buffers.dest_start,
        buffers.item_start, buffers.local_base, buffers.local_rows, buffers.src_offset,
        buffers.src_rows, tokens_per_expert, buffers.status.data_ptr(), shape.rank, shape.ep,
        shape.local_experts, int(needs_input), max_spins,
        COUNTS=flags.counts, COUNT_READY=flags.count_ready, NEEDS_INPUT=flags.needs_input,
        EP_PAD=pad(shape.ep), LOCAL_PAD=pad(shape.local_experts), BLOCK_M=buffers.tiles.block_m,
        num_warps=4,
    )
    return order.to(torch.int32), send_start, tokens_per_expert


def preact_shape(shape: ForwardShape, tiles: TileConfig) -> tuple[int, int]:
    """Shape of the saved pre-activations ``[gate | up]`` of one call."""
    return shape.receive_rows(tiles.block_m), 2 * shape.inter


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
    preact: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y [T, H]`` and the rows received per local expert (int64), see ``reference``.

    ``num_programs`` persistent programs run each GEMM; the first ``comm_programs`` of
    them dispatch before they join GEMM1. ``preact`` (``preact_shape``), when given,
    receives GEMM1's pre-activations for the backward.
    """
    shape, tiles, flags = buffers.shape, buffers.tiles, buffers.flag_layout
    num_tokens, top_k = topk_idx.shape
    check_call(num_tokens, buffers, comm_programs, num_programs, "forward")
    ep_pad, local_pad = pad(shape.ep), pad(shape.local_experts)
    status_addr = buffers.status.data_ptr()
    order, send_start, tokens_per_expert = route(topk_idx, buffers, max_spins)
    buffers.resident = (buffers.calls, inputs_key(x, topk_idx, topk_w, w1, w3, score_before_experts))

    dispatch_gemm1_kernel[(num_programs,)](
        x, topk_w, order, send_start, buffers.dest_start, buffers.item_start,
        buffers.recv_ptrs, buffers.recv_meta_ptrs, buffers.flag_ptrs, buffers.recv,
        buffers.recv_meta, buffers.flags, buffers.state, buffers.local_base, buffers.src_offset,
        buffers.src_rows, w1, w3, buffers.h, buffers.h if preact is None else preact,
        status_addr, shape.rank, shape.ep, shape.local_experts, shape.rows_per_rank, max_spins,
        HIDDEN=shape.hidden, INTER=shape.inter, TOP_K=top_k,
        SCORE_BEFORE_EXPERTS=score_before_experts, SAVE_PREACT=preact is not None,
        COMM_PROGRAMS=comm_programs, CHUNK_READY=flags.chunk_ready, MAX_CHUNKS=flags.max_chunks,
        EP_PAD=ep_pad, LOCAL_PAD=local_pad, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.gemm1_n, BLOCK_K=tiles.gemm1_k, COPY_ROWS=tiles.copy_rows,
        COPY_COLS=tiles.copy_cols, UPCAST_DOT=INTERPRET,
        num_warps=tiles.gemm1_warps, num_stages=tiles.gemm1_stages,
    )
    rows_gemm_combine_kernel[(num_programs,)](
        buffers.h, w2, buffers.recv_meta, buffers.combine, buffers.combine_ptrs,
        buffers.h, buffers.flags, buffers.flag_ptrs, buffers.flags, buffers.flag_ptrs,
        buffers.state, buffers.local_base, buffers.local_rows, shape.rank, shape.ep,
        shape.local_experts, shape.rows_per_rank,
        N=shape.hidden, K=shape.inter, SCORE_PARTS=0, PARTS_PAD=1,
        COMBINE_READY=flags.combine_ready, LOCAL_PAD=local_pad, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.gemm2_n, BLOCK_K=tiles.gemm2_k, UPCAST_DOT=INTERPRET,
        num_warps=tiles.gemm2_warps, num_stages=tiles.gemm2_stages,
    )
    y = torch.empty_like(x)
    reduce(buffers, topk_w, x, y, topk_w, num_tokens, top_k, scale_by_score=not score_before_experts,
           score_dot=False, max_spins=max_spins)
    return y, tokens_per_expert


def reduce(buffers: ForwardBuffers, topk_w, x, out, dot_out, num_tokens: int, top_k: int,
           scale_by_score: bool, score_dot: bool, max_spins: int) -> None:
    """Sum each token's k combined rows into ``out``; ``score_dot``: also ``<row, x>`` per
    slot into ``dot_out [T, k]`` (see ``combine_reduce_kernel``)."""
    shape, tiles = buffers.shape, buffers.tiles
    combine_reduce_kernel[(max(1, triton.cdiv(num_tokens, tiles.reduce_tokens)),)](
        buffers.combine, topk_w, x, out, dot_out, buffers.flags, buffers.state, num_tokens,
        buffers.status.data_ptr(), shape.rank, shape.ep, max_spins,
        HIDDEN=shape.hidden, TOP_K=top_k, K_PAD=pad(top_k), SCALE_BY_SCORE=scale_by_score,
        SCORE_DOT=score_dot, COMBINE_READY=buffers.flag_layout.combine_ready,
        EP_PAD=pad(shape.ep), BLOCK_T=tiles.reduce_tokens, BLOCK_H=tiles.reduce_cols, num_warps=4,
    )

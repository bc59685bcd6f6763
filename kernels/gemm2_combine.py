"""GEMM2 with the combine push, and the final per-token reduction.

``gemm2_combine_kernel``: persistent tiles of ``h W2^T`` over the receive buffer's rows;
each output row goes straight to the combine buffer of the rank it came from, at row
``token * k + slot`` (the origin the dispatch stored beside the row). Padding rows of a
block are computed but never stored. The last program to finish releases every peer's
COMBINE_READY flag (protocol: ``sync``).

``combine_reduce_kernel``: once every owner has released COMBINE_READY, each token's k
rows are summed in fp32 in slot order 0..k-1 (times the scores unless they were applied
before the experts): the result does not depend on arrival order, bit for bit.
"""

import triton
import triton.language as tl

from titan_megamoe.kernels.layout import EPOCH, GEMM2_FINISHED, NUM_BLOCKS, expert_of_row
from titan_megamoe.kernels.sync import peer_pointer, signal, wait_all


@triton.jit
def gemm2_combine_kernel(
    h, w2, recv_meta, combine, combine_ptrs, flags, flag_ptrs, state, local_base, local_rows,
    rank, ep, local_experts, rows_per_rank,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, COMBINE_READY: tl.constexpr,
    LOCAL_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    n_tiles: tl.constexpr = tl.cdiv(HIDDEN, BLOCK_N)
    num_tiles = tl.load(state + NUM_BLOCKS) * n_tiles
    out_dtype = h.dtype.element_ty
    # A static stride (not a shared tile counter) lets the compiler flatten the tile and
    # K loops into one pipeline: the next tile's loads overlap this tile's epilogue.
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        row0 = (tile // n_tiles) * BLOCK_M
        n0 = (tile % n_tiles) * BLOCK_N
        le = expert_of_row(local_base, local_experts, row0, LOCAL_PAD)
        end = tl.load(local_base + le) + tl.load(local_rows + le)

        rows = row0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = (cols < HIDDEN) | (HIDDEN % BLOCK_N == 0)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = h + rows[:, None].to(tl.int64) * INTER + ks[None, :]
        b_ptrs = w2 + le.to(tl.int64) * HIDDEN * INTER + cols[None, :] * INTER + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k_ok = (k0 + ks < INTER) | (INTER % BLOCK_K == 0)
            a = tl.load(a_ptrs + k0, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST_DOT:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)

        live = rows < end
        origin = tl.load(recv_meta + rows, mask=live, other=0)
        source = origin // rows_per_rank
        slot_row = (origin % rows_per_rank).to(tl.int64)
        # Offsets from the local copy keep the 16-byte alignment known (see peer_pointer).
        offset = tl.load(combine_ptrs + source, mask=live, other=0) - tl.load(combine_ptrs + rank)
        offset = tl.multiple_of(offset // (tl.constexpr(out_dtype.primitive_bitwidth) // 8), 8)
        tl.store(
            combine + (offset + slot_row * HIDDEN)[:, None] + cols[None, :],
            acc.to(out_dtype),
            mask=live[:, None] & col_ok[None, :],
        )

    tl.debug_barrier()
    finished = tl.atomic_add(state + GEMM2_FINISHED, 1, sem="acq_rel", scope="sys")
    if finished == tl.num_programs(0) - 1:
        epoch = tl.load(state + EPOCH)
        for peer in range(ep):
            signal(peer_pointer(flags, flag_ptrs, peer, rank) + COMBINE_READY + rank, epoch)


@triton.jit
def combine_reduce_kernel(
    combine, topk_w, y, flags, state, num_tokens, status_addr, rank, ep, max_spins,
    HIDDEN: tl.constexpr, TOP_K: tl.constexpr, SCORE_BEFORE_EXPERTS: tl.constexpr,
    COMBINE_READY: tl.constexpr, EP_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    owners = tl.arange(0, EP_PAD)
    epoch = tl.load(state + EPOCH)
    wait_all(flags + COMBINE_READY + owners, owners, owners < ep, epoch, status_addr, rank, 3, max_spins)
    tl.debug_barrier()

    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = tokens < num_tokens
    mask = live[:, None] & (cols[None, :] < HIDDEN)
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        row = tokens.to(tl.int64) * TOP_K + slot
        v = tl.load(combine + row[:, None] * HIDDEN + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if SCORE_BEFORE_EXPERTS:
            acc += v
        else:
            acc += v * tl.load(topk_w + row, mask=live, other=0.0)[:, None]
    tl.store(y + tokens.to(tl.int64)[:, None] * HIDDEN + cols[None, :], acc.to(y.dtype.element_ty), mask=mask)

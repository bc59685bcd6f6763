"""Expert rows times a weight, pushed back to the rows' source ranks, and the final
per-token reduction. Used by the forward (GEMM2 + combine) and the backward (dgrad + its
combine).

``rows_gemm_combine_kernel``: persistent tiles of ``A W^T`` over the receive buffer's rows
(``W`` per local expert ``[N, K]``, K-major; or, unquantized, ``W^T`` as two weights stored
``[K / 2, N]`` each, the dgrad GEMM's ``[W1 | W3]``: ``W_AS_STORED``); each output row goes
straight to the combine buffer of
the rank it came from, at row ``token * k + slot`` (the origin the dispatch stored beside
the row). Padding rows of a block are computed but never stored. With ``SCORE_PARTS``,
the programs then also sum each row's score-gradient parts in fixed order and push the
sum to the source's ``score_grad[token * k + slot]``. The last program
to finish releases every peer's COMBINE_READY flag (protocol: ``sync``).

``combine_release_kernel``: the score sums and the release alone (``release_combine``),
after a rows GEMM of another kernel, Hopper's Gluon core (``kernels.gluon.sm90``, its
combine epilogue), stored every row; stream order puts it after the last store.

``combine_reduce_kernel``: once every owner has released COMBINE_READY, each token's k
rows are summed in fp32 in slot order 0..k-1, times the scores when ``SCALE_BY_SCORE``: the
result does not depend on arrival order, bit for bit. With ``SCORE_DOT`` it also writes
``<row_j, x_t>`` per slot (the score gradient when the score scaled the expert input).
"""

import triton
import triton.language as tl

from titan_megamoe.kernels.layout import tile_rows
from titan_megamoe.kernels.mainloop import tile_gemm
from titan_megamoe.kernels.sync import (
    COMBINE_READY_TIMEOUT,
    EPOCH,
    GEMM2_FINISHED,
    NUM_BLOCKS,
    POISONED,
    peer_pointer,
    signal,
    wait_all,
)


@triton.jit
def _peer_offset(ptrs, source, rank, live, ELEM_BYTES: tl.constexpr, ALIGN: tl.constexpr):
    """Per row: element offset from my copy of a symmetric buffer to ``source``'s copy
    (offsets from the local copy keep the alignment known, see ``peer_pointer``)."""
    offset = tl.load(ptrs + source, mask=live, other=0) - tl.load(ptrs + rank)
    return tl.multiple_of(offset // ELEM_BYTES, ALIGN)


@triton.jit
def rows_gemm_combine_kernel(
    a, a_scales, w, w_scales, w_rest, recv_meta, combine, combine_ptrs, score_parts, score_grad,
    score_grad_ptrs, flags, flag_ptrs, state, local_base, block_base, local_rows,
    rank, ep, local_experts, rows_per_rank,
    N: tl.constexpr, K: tl.constexpr, SCORE_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr, COMBINE_READY: tl.constexpr,
    LOCAL_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr, SCALE_K: tl.constexpr, W_SCALE_N: tl.constexpr,
    MX_DOT: tl.constexpr, W_AS_STORED: tl.constexpr,
):
    """``a``: ``[rows, K]``; ``w``: ``[local experts, N, K]``; with ``SCALE_K`` > 0 both
    e4m3, scaled as ``tile_gemm`` describes. ``W_AS_STORED``: ``w`` and ``w_rest`` are
    ``[local experts, K / 2, N]``, the columns ``0 .. K / 2`` of ``a`` multiplying ``w``, the
    others ``w_rest`` (unscaled; ``w_rest`` unused otherwise). Tiles are ``TILE_M`` rows
    (dividing the receive layout's ``BLOCK_M``, so a tile never spans two experts:
    ``layout``) by ``BLOCK_N``, in a static stride over the programs."""
    tl.static_assert(BLOCK_M % TILE_M == 0, "TILE_M must divide BLOCK_M")
    K_SPLIT: tl.constexpr = K // 2 if W_AS_STORED else 0
    n_tiles: tl.constexpr = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.load(state + NUM_BLOCKS).to(tl.int32) * (BLOCK_M // TILE_M) * n_tiles
    out_dtype = combine.dtype.element_ty
    elem: tl.constexpr = out_dtype.primitive_bitwidth // 8
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        n0 = (tile % n_tiles) * BLOCK_N
        le, _, end, row0 = tile_rows(block_base, local_base, local_rows, local_experts,
                                     (tile // n_tiles) * TILE_M, LOCAL_PAD)

        rows = row0 + tl.arange(0, TILE_M)
        # The hints restate the columns' alignment: an N-major B tile is built from these
        # columns too, and where the compiler carried that value into the stores it lost
        # it (they fell to 2 bytes each, docs/perf-history.md v24).
        cols = tl.max_contiguous(tl.multiple_of(n0 + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
        col_ok = (cols < N) | (N % BLOCK_N == 0)
        # Where each row goes, loaded before the mainloop, whose MMAs hide the latency of
        # these two dependent loads (the row's origin, then its source's buffer); after
        # it they held up every tile's stores (docs/perf-history.md v29).
        live = rows < end
        origin = tl.load(recv_meta + rows, mask=live, other=0)
        offset = _peer_offset(combine_ptrs, origin // rows_per_rank, rank, live, ELEM_BYTES=elem, ALIGN=16 // elem)
        dest = offset + (origin % rows_per_rank).to(tl.int64) * N
        acc = tile_gemm(
            a, a_scales, rows, w, w_scales, b2=w_rest, b2_scale=None, expert=le, n0=n0, k_start=0, k_end=K,
            N=N, K=K, BLOCK_M=TILE_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, TWO_B=False, SCALE_K=SCALE_K,
            B_SCALE_N=W_SCALE_N, MX_DOT=MX_DOT, QUANTIZE_A=0, UPCAST_DOT=UPCAST_DOT, B_N_MAJOR=W_AS_STORED,
            B_K_SPLIT=K_SPLIT,
        )
        tl.store(combine + dest[:, None] + cols[None, :], acc.to(out_dtype), mask=live[:, None] & col_ok[None, :])

    release_combine(score_parts, score_grad, score_grad_ptrs, recv_meta, flags, flag_ptrs, state, local_base,
                    block_base, local_rows, rank, ep, local_experts, rows_per_rank, SCORE_PARTS=SCORE_PARTS,
                    PARTS_PAD=PARTS_PAD, COMBINE_READY=COMBINE_READY, LOCAL_PAD=LOCAL_PAD, BLOCK_M=BLOCK_M)


@triton.jit
def release_combine(score_parts, score_grad, score_grad_ptrs, recv_meta, flags, flag_ptrs, state, local_base,
                    block_base, local_rows, rank, ep, local_experts, rows_per_rank, SCORE_PARTS: tl.constexpr,
                    PARTS_PAD: tl.constexpr, COMBINE_READY: tl.constexpr, LOCAL_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """Once a program has stored its rows: with ``SCORE_PARTS``, its share of the rows'
    score-gradient sums; then the last program to get here releases every peer's
    COMBINE_READY flag."""
    if SCORE_PARTS > 0:
        # A loop of its own, over whole blocks: every column tile's parts are summed.
        parts = tl.arange(0, PARTS_PAD)
        for block in range(tl.program_id(0), tl.load(state + NUM_BLOCKS).to(tl.int32), tl.num_programs(0)):
            _, _, end, row0 = tile_rows(block_base, local_base, local_rows, local_experts,
                                        block * BLOCK_M, LOCAL_PAD)
            rows = row0 + tl.arange(0, BLOCK_M)
            live = rows < end
            ds = tl.sum(
                tl.load(
                    score_parts + rows[:, None].to(tl.int64) * SCORE_PARTS + parts[None, :],
                    mask=live[:, None] & (parts[None, :] < SCORE_PARTS),
                    other=0.0,
                ),
                axis=1,
            )
            origin = tl.load(recv_meta + rows, mask=live, other=0)
            source = origin // rows_per_rank
            offset = _peer_offset(score_grad_ptrs, source, rank, live, ELEM_BYTES=4, ALIGN=1)
            tl.store(score_grad + offset + (origin % rows_per_rank), ds, mask=live)

    tl.debug_barrier()
    finished = tl.atomic_add(state + GEMM2_FINISHED, 1, sem="acq_rel", scope="sys")
    # A poisoned round (``sync``) writes nothing to a peer.
    if (finished == tl.num_programs(0) - 1) & (tl.load(state + POISONED) == 0):
        epoch = tl.load(state + EPOCH)
        for peer in range(ep):
            signal(peer_pointer(flags, flag_ptrs, peer, rank) + COMBINE_READY + rank, epoch)


@triton.jit
def combine_release_kernel(score_parts, score_grad, score_grad_ptrs, recv_meta, flags, flag_ptrs, state, local_base,
                           block_base, local_rows, rank, ep, local_experts, rows_per_rank, SCORE_PARTS: tl.constexpr,
                           PARTS_PAD: tl.constexpr, COMBINE_READY: tl.constexpr, LOCAL_PAD: tl.constexpr,
                           BLOCK_M: tl.constexpr):
    """``release_combine`` after a rows GEMM of another kernel (the Gluon core, launched
    before it on the stream) stored every row to its combine buffer."""
    release_combine(score_parts, score_grad, score_grad_ptrs, recv_meta, flags, flag_ptrs, state, local_base,
                    block_base, local_rows, rank, ep, local_experts, rows_per_rank, SCORE_PARTS=SCORE_PARTS,
                    PARTS_PAD=PARTS_PAD, COMBINE_READY=COMBINE_READY, LOCAL_PAD=LOCAL_PAD, BLOCK_M=BLOCK_M)


@triton.jit
def combine_reduce_kernel(
    combine, topk_w, x, out, score_out, score_src, flags, flag_ptrs, state, num_tokens, rank, ep,
    HIDDEN: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, SCALE_BY_SCORE: tl.constexpr,
    SCORE_DOT: tl.constexpr, SCORE_COPY: tl.constexpr, COMBINE_READY: tl.constexpr, EP_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out[t] = sum_j c_j * combine[t * k + j]`` with ``c_j = topk_w[t, j]`` when
    ``SCALE_BY_SCORE`` else 1; ``SCORE_DOT``: ``score_out[t, j] = <combine[t * k + j], x[t]>``;
    ``SCORE_COPY``: ``score_out[t, j] = score_src[t * k + j]`` (the score gradients the
    owners pushed back). Persistent over blocks of BLOCK_T tokens: its programs spin on
    COMBINE_READY, so the grid stays within the SMs the caller gives the operator. On
    poisoned buffers (``sync``) it waits for no one and every output is NaN."""
    owners = tl.arange(0, EP_PAD)
    epoch = tl.load(state + EPOCH)
    poisoned = tl.load(state + POISONED)
    if poisoned == 0:
        wait_all(flags + COMBINE_READY + owners, owners, owners < ep, epoch, COMBINE_READY_TIMEOUT,
                 flags, flag_ptrs, state, rank, ep, EP_PAD)
    tl.debug_barrier()
    # Added to every output: 0, or NaN where the buffers are poisoned.
    poison = tl.where(poisoned != 0, float("nan"), 0.0)

    slots = tl.arange(0, K_PAD)
    for block in range(tl.program_id(0), tl.cdiv(num_tokens, BLOCK_T), tl.num_programs(0)):
        tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
        live = tokens < num_tokens
        dots = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
        for c0 in range(0, HIDDEN, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            mask = live[:, None] & (cols[None, :] < HIDDEN)
            at = tokens.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
            if SCORE_DOT:
                xt = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
            acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
            for slot in tl.static_range(TOP_K):
                row = tokens.to(tl.int64) * TOP_K + slot
                v = tl.load(combine + row[:, None] * HIDDEN + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if SCALE_BY_SCORE:
                    acc += v * tl.load(topk_w + row, mask=live, other=0.0)[:, None]
                else:
                    acc += v
                if SCORE_DOT:
                    dots += tl.where(slots[None, :] == slot, tl.sum(v * xt, axis=1)[:, None], 0.0)
            tl.store(out + at, (acc + poison).to(out.dtype.element_ty), mask=mask)
        at = tokens.to(tl.int64)[:, None] * TOP_K + slots[None, :]
        scores = live[:, None] & (slots[None, :] < TOP_K)
        if SCORE_COPY:
            dots = tl.load(score_src + at, mask=scores, other=0.0)
        if SCORE_DOT or SCORE_COPY:
            tl.store(score_out + at, dots + poison, mask=scores)

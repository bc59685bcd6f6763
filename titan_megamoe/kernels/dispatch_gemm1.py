"""Dispatch + GEMM1 + SwiGLU in one persistent kernel.

Programs ``0 .. COMM_PROGRAMS-1`` first push this rank's routed rows into their owners'
receive buffers, one *item* (<= BLOCK_M rows of one expert) at a time, and release the
item's CHUNK_READY flag on the owner (protocol: ``sync``). Then every program, those
included, takes GEMM1 tiles from a device counter, in expert-major order: a tile waits
for the chunks its rows come from, computes ``x W1^T`` and ``x W3^T`` for BLOCK_N
intermediate columns, and stores ``h = silu(g) * u`` in the activation dtype. The
[rows, 2I] pre-activation reaches memory only with ``SAVE_GEMM1`` (for the backward).
``dispatch_item``, ``wait_rows`` and ``gate_up`` are shared with the backward's first
kernel, its transpose.

Tiles are handed out in the order the rows arrive (every source sends expert 0 first),
so compute on arrived blocks overlaps the transfer of later ones. With a single sending
program, waits only depend on program 0, so the kernel also runs under the Triton
interpreter, where programs run one after another in id order.
"""

import triton
import triton.language as tl

from titan_megamoe.kernels.layout import tile_rows
from titan_megamoe.kernels.mainloop import tile_gemm
from titan_megamoe.kernels.quantize import quantize_tile, round_rows
from titan_megamoe.kernels.sync import (
    CHUNK_READY_TIMEOUT,
    EPOCH,
    GEMM1_NEXT_TILE,
    NUM_BLOCKS,
    NUM_ITEMS,
    peer_pointer,
    signal,
    wait_all,
)


@triton.jit
def _scale_chunk(rows, c0, live, HIDDEN: tl.constexpr, SCALE_K: tl.constexpr, COPY_COLS: tl.constexpr):
    """Offsets and mask of the scales of columns ``[c0, c0 + COPY_COLS)`` of ``rows`` in a
    ``[*, cdiv(HIDDEN, SCALE_K)]`` scale tensor."""
    SCALE_COLS: tl.constexpr = tl.cdiv(HIDDEN, SCALE_K)
    kb = c0 // SCALE_K + tl.arange(0, COPY_COLS // SCALE_K)
    return rows[:, None] * SCALE_COLS + kb[None, :], live[:, None] & (kb[None, :] < SCALE_COLS)


@triton.jit
def dispatch_item(
    item, x, x_scales, dy, dy_scales, topk_w, order, send_first, send_end, dest_start, item_start,
    recv, recv_scales, recv_grad, recv_grad_scales, recv_score, recv_meta, flags, recv_ptrs,
    grad_ptrs, score_ptrs, meta_ptrs, flag_ptrs, epoch, rank, ep, local_experts, rows_per_rank,
    HIDDEN: tl.constexpr, TOP_K: tl.constexpr, SCORE_BEFORE_EXPERTS: tl.constexpr,
    WITH_GRAD: tl.constexpr, NEEDS_INPUT: tl.constexpr, CHUNK_READY: tl.constexpr,
    MAX_CHUNKS: tl.constexpr, EXPERT_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    COPY_ROWS: tl.constexpr, COPY_COLS: tl.constexpr, ROW_SCALE_K: tl.constexpr,
    GRAD_SCALE_K: tl.constexpr, POWER_OF_TWO: tl.constexpr, ROW_ROUND_K: tl.constexpr,
):
    """Push one item (<= BLOCK_M of my rows for one expert) to the expert's owner: the
    expert input rows and their origins, plus, ``WITH_GRAD`` (the backward), the output
    gradient rows ``dy`` and the scores, and then only the inputs the owner's
    NEEDS_INPUT flag asks for; then release the item's CHUNK_READY.

    ``ROW_SCALE_K`` > 0: expert inputs cross quantized (e4m3, one scale per ROW_SCALE_K
    columns into ``recv_scales``). Without ``SCORE_BEFORE_EXPERTS`` they were quantized
    once per token before the kernel (``x`` e4m3 with ``x_scales``) and are copied as they
    are; with it each (token, slot) row differs, so it is quantized here, after scaling.
    ``ROW_ROUND_K`` > 0: expert inputs cross as MX values held in the activation dtype,
    rounded once per token before the kernel, or here, after scaling, likewise.
    ``GRAD_SCALE_K`` > 0: the ``dy`` rows, quantized once per token before the kernel
    (``dy`` e4m3 with ``dy_scales``), are copied with their scales the same way."""
    lane = tl.arange(0, EXPERT_PAD)
    starts = tl.load(item_start + lane, mask=lane < ep * local_experts, other=2147483647)
    o = tl.sum((starts <= item).to(tl.int32)) - 1
    chunk = item - tl.load(item_start + o)
    le = o // ep
    owner = o % ep
    expert = owner * local_experts + le
    first = tl.load(send_first + expert) + chunk * BLOCK_M
    rows = tl.minimum(tl.load(send_end + expert) - first, BLOCK_M)
    dest0 = tl.load(dest_start + expert) + chunk * BLOCK_M
    recv = peer_pointer(recv, recv_ptrs, owner, rank)
    if ROW_SCALE_K > 0:
        recv_scales = peer_pointer(recv_scales, recv_ptrs, owner, rank)
    meta = peer_pointer(recv_meta, meta_ptrs, owner, rank)
    input_rows = rows  # the rows whose expert inputs this call sends
    if WITH_GRAD:
        recv_grad = peer_pointer(recv_grad, grad_ptrs, owner, rank)
        if GRAD_SCALE_K > 0:
            recv_grad_scales = peer_pointer(recv_grad_scales, grad_ptrs, owner, rank)
        recv_score = peer_pointer(recv_score, score_ptrs, owner, rank)
        input_rows = rows * (tl.load(flags + NEEDS_INPUT + owner, volatile=True) != 0).to(tl.int32)
    # A copy is bound by the latency of its loads, not by bandwidth: each step issues
    # every load it can (the next step's row indices, a column chunk of x and of dy with
    # their scales) before its first store, since a load written after a store waits for it.
    COPY_X_SCALES: tl.constexpr = (ROW_SCALE_K > 0) & (not SCORE_BEFORE_EXPERTS)
    COPY_DY_SCALES: tl.constexpr = WITH_GRAD & (GRAD_SCALE_K > 0)
    steps = tl.arange(0, COPY_ROWS)
    next_flat = tl.load(order + first + steps, mask=steps < rows, other=0)
    for r0 in range(0, rows, COPY_ROWS):
        r = r0 + steps
        live = r < rows
        x_live = r < input_rows
        flat = next_flat
        next_flat = tl.load(order + first + COPY_ROWS + r, mask=r + COPY_ROWS < rows, other=0)
        token = (flat // TOP_K).to(tl.int64)
        dest = (dest0 + r).to(tl.int64)
        score = tl.load(topk_w + flat, mask=live & (SCORE_BEFORE_EXPERTS | WITH_GRAD), other=1.0)
        tl.store(meta + dest, rank * rows_per_rank + flat, mask=x_live)
        if WITH_GRAD:
            tl.store(recv_score + dest, score, mask=live)
        for c0 in range(0, HIDDEN, COPY_COLS):
            c = c0 + tl.arange(0, COPY_COLS)
            c_ok = c[None, :] < HIDDEN
            mask = live[:, None] & c_ok
            x_mask = x_live[:, None] & c_ok
            src = token[:, None] * HIDDEN + c[None, :]
            dst = dest[:, None] * HIDDEN + c[None, :]
            v = tl.load(x + src, mask=x_mask, other=0.0)
            if COPY_X_SCALES:
                x_scale_src, x_scale_mask = _scale_chunk(token, c0, x_live, HIDDEN=HIDDEN, SCALE_K=ROW_SCALE_K,
                                                         COPY_COLS=COPY_COLS)
                x_scale_dst, _ = _scale_chunk(dest, c0, x_live, HIDDEN=HIDDEN, SCALE_K=ROW_SCALE_K, COPY_COLS=COPY_COLS)
                x_scale = tl.load(x_scales + x_scale_src, mask=x_scale_mask)
            if WITH_GRAD:
                g = tl.load(dy + src, mask=mask)
            if COPY_DY_SCALES:
                dy_scale_src, dy_scale_mask = _scale_chunk(token, c0, live, HIDDEN=HIDDEN, SCALE_K=GRAD_SCALE_K,
                                                           COPY_COLS=COPY_COLS)
                dy_scale_dst, _ = _scale_chunk(dest, c0, live, HIDDEN=HIDDEN, SCALE_K=GRAD_SCALE_K, COPY_COLS=COPY_COLS)
                dy_scale = tl.load(dy_scales + dy_scale_src, mask=dy_scale_mask)
            if SCORE_BEFORE_EXPERTS:
                v = (v.to(tl.float32) * score[:, None]).to(v.dtype)
            if (ROW_SCALE_K > 0) & SCORE_BEFORE_EXPERTS:
                # Each (token, slot) row differs: quantized here, after scaling.
                q, scales = quantize_tile(v.to(tl.float32), SCALE_K=ROW_SCALE_K, POWER_OF_TWO=POWER_OF_TWO)
                scale_dst, scale_mask = _scale_chunk(dest, c0, x_live, HIDDEN=HIDDEN, SCALE_K=ROW_SCALE_K,
                                                     COPY_COLS=COPY_COLS)
                tl.store(recv + dst, q, mask=x_mask)
                tl.store(recv_scales + scale_dst, scales, mask=scale_mask)
            elif (ROW_ROUND_K > 0) & SCORE_BEFORE_EXPERTS:
                tl.store(recv + dst, round_rows(v.to(tl.float32), ROW_ROUND_K).to(v.dtype), mask=x_mask)
            else:
                tl.store(recv + dst, v, mask=x_mask)
            if COPY_X_SCALES:
                tl.store(recv_scales + x_scale_dst, x_scale, mask=x_scale_mask)
            if WITH_GRAD:
                tl.store(recv_grad + dst, g, mask=mask)
            if COPY_DY_SCALES:
                tl.store(recv_grad_scales + dy_scale_dst, dy_scale, mask=dy_scale_mask)
    peer_flags = peer_pointer(flags, flag_ptrs, owner, rank)
    signal(peer_flags + CHUNK_READY + (rank * local_experts + le) * MAX_CHUNKS + chunk, epoch)


@triton.jit
def wait_rows(
    flags, flag_ptrs, state, src_offset, src_rows, base, le, row0, epoch, rank, ep, local_experts,
    CHUNK_READY: tl.constexpr, MAX_CHUNKS: tl.constexpr, EP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_M: tl.constexpr,
):
    """Wait until every source's chunks that overlap rows [row0, row0 + TILE_M) arrived.
    Chunks are BLOCK_M rows long and TILE_M <= BLOCK_M, so each source contributes at most
    two."""
    s = tl.arange(0, EP_PAD)[:, None]
    second = tl.arange(0, 2)[None, :]
    seg = base + tl.load(src_offset + s * local_experts + le, mask=s < ep, other=0)
    n = tl.load(src_rows + s * local_experts + le, mask=s < ep, other=0)
    lo = tl.maximum(row0, seg)
    hi = tl.minimum(row0 + TILE_M, seg + n)
    c0 = (lo - seg) // BLOCK_M
    c1 = (hi - 1 - seg) // BLOCK_M
    chunk = c0 + second
    need = (s < ep) & (lo < hi) & (chunk <= c1)
    ids = (s * local_experts + le) * MAX_CHUNKS + chunk
    wait_all(flags + CHUNK_READY + ids, ids, need, epoch, CHUNK_READY_TIMEOUT, flags, flag_ptrs, state, rank, ep, EP_PAD)
    tl.debug_barrier()


@triton.jit
def dispatch_gemm1_kernel(
    x, x_scales, topk_w, order, send_first, send_end, dest_start, item_start, recv_ptrs, meta_ptrs, flag_ptrs,
    recv, recv_scales, recv_meta, flags, state, local_base, block_base, local_rows, src_offset, src_rows,
    w1, w1_scales, w3, w3_scales, h, h_scales, preact, saved_rows,
    rank, ep, local_experts, rows_per_rank,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
    SCORE_BEFORE_EXPERTS: tl.constexpr, SAVE_GEMM1: tl.constexpr, COMM_PROGRAMS: tl.constexpr,
    CHUNK_READY: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    EP_PAD: tl.constexpr, LOCAL_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COPY_ROWS: tl.constexpr, COPY_COLS: tl.constexpr, UPCAST_DOT: tl.constexpr,
    SCALE_K: tl.constexpr, W_SCALE_N: tl.constexpr, MX_DOT: tl.constexpr, POWER_OF_TWO: tl.constexpr,
    ACT_DTYPE: tl.constexpr, ROUND_K: tl.constexpr, CLAIM_AHEAD: tl.constexpr, DISPATCH_ONLY: tl.constexpr,
):
    """A tile is ``TILE_M`` rows (dividing the layout's ``BLOCK_M``) by ``BLOCK_N``
    intermediate columns. ``SAVE_GEMM1``: also store the pre-activations ``[gate | up]``
    of the receive buffer's first ``saved_rows`` rows into ``preact`` ``[saved_rows, 2 *
    INTER]`` for the backward, which recomputes the others.

    ``SCALE_K`` > 0 (a quantized forward format): the rows cross quantized (see
    ``dispatch_item``), W1 and W3 are e4m3 with one scale per ``W_SCALE_N x SCALE_K``
    block (``MX_DOT``: see ``tile_gemm``), and ``h`` is stored quantized for GEMM2, one scale per SCALE_K columns into
    ``h_scales``, after rounding to the activation dtype ``ACT_DTYPE`` as the reference
    rounds it. ``ROUND_K`` > 0 (MX held in the activation dtype, ``SCALE_K`` 0): the rows
    arrive so, and ``h`` is stored so, rounded in blocks of ``ROUND_K`` columns.
    ``CLAIM_AHEAD``: a program claims its next tile before the mainloop, not after the
    tile's stores (``TileConfig.gemm1_claim_ahead``). ``DISPATCH_ONLY``: no tiles, the rows
    dispatched alone, where Hopper's Gluon core computes GEMM1
    (``kernels.gluon.sm90.gate_up_gemm``)."""
    pid = tl.program_id(0)
    epoch = tl.load(state + EPOCH)
    if pid < COMM_PROGRAMS:
        for item in range(pid, tl.load(state + NUM_ITEMS).to(tl.int32), COMM_PROGRAMS):
            dispatch_item(
                item, x, x_scales, x, None, topk_w, order, send_first, send_end, dest_start, item_start, recv,
                recv_scales, recv,
                None, topk_w, recv_meta, flags, recv_ptrs, recv_ptrs, recv_ptrs, meta_ptrs, flag_ptrs, epoch, rank, ep,
                local_experts, rows_per_rank, HIDDEN=HIDDEN, TOP_K=TOP_K, SCORE_BEFORE_EXPERTS=SCORE_BEFORE_EXPERTS,
                WITH_GRAD=False, NEEDS_INPUT=0, CHUNK_READY=CHUNK_READY, MAX_CHUNKS=MAX_CHUNKS,
                EXPERT_PAD=EP_PAD * LOCAL_PAD, BLOCK_M=BLOCK_M, COPY_ROWS=COPY_ROWS, COPY_COLS=COPY_COLS,
                ROW_SCALE_K=SCALE_K, GRAD_SCALE_K=0, POWER_OF_TWO=POWER_OF_TWO, ROW_ROUND_K=ROUND_K,
            )
    if not DISPATCH_ONLY:
        n_tiles: tl.constexpr = tl.cdiv(INTER, BLOCK_N)
        num_tiles = tl.load(state + NUM_BLOCKS).to(tl.int32) * (BLOCK_M // TILE_M) * n_tiles
        tile = tl.atomic_add(state + GEMM1_NEXT_TILE, 1, sem="relaxed").to(tl.int32)
        while tile < num_tiles:
            n0 = (tile % n_tiles) * BLOCK_N
            le, base, end, row0 = tile_rows(block_base, local_base, local_rows, local_experts,
                                            (tile // n_tiles) * TILE_M, LOCAL_PAD)
            wait_rows(
                flags, flag_ptrs, state, src_offset, src_rows, base, le, row0, epoch, rank, ep, local_experts,
                CHUNK_READY=CHUNK_READY, MAX_CHUNKS=MAX_CHUNKS, EP_PAD=EP_PAD, BLOCK_M=BLOCK_M, TILE_M=TILE_M,
            )

            if CLAIM_AHEAD:  # the mainloop hides the atomic's round trip
                next_tile = tl.atomic_add(state + GEMM1_NEXT_TILE, 1, sem="relaxed").to(tl.int32)
            rows = (row0 + tl.arange(0, TILE_M)).to(tl.int64)
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = (cols < INTER) | (INTER % BLOCK_N == 0)
            g, u = gate_up(recv, recv_scales, w1, w1_scales, w3, w3_scales, le, rows, n0, HIDDEN=HIDDEN, INTER=INTER,
                           BLOCK_M=TILE_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, UPCAST_DOT=UPCAST_DOT, SCALE_K=SCALE_K,
                           W_SCALE_N=W_SCALE_N, MX_DOT=MX_DOT, QUANTIZE_A=False)
            out = g * tl.sigmoid(g) * u
            live = rows < end
            mask = live[:, None] & col_ok[None, :]
            if SCALE_K == 0:
                if ROUND_K > 0:
                    tl.static_assert(BLOCK_N % ROUND_K == 0, "a GEMM1 tile must hold whole MX blocks of h")
                    out = round_rows(out.to(ACT_DTYPE).to(tl.float32), ROUND_K)
                tl.store(h + rows[:, None] * INTER + cols[None, :], out.to(h.dtype.element_ty), mask=mask)
            else:
                tl.static_assert(BLOCK_N % SCALE_K == 0, "a GEMM1 tile must hold whole scale blocks of h")
                H_SCALE_COLS: tl.constexpr = tl.cdiv(INTER, SCALE_K)
                hq, hs = quantize_tile(out.to(ACT_DTYPE).to(tl.float32), SCALE_K=SCALE_K, POWER_OF_TWO=POWER_OF_TWO)
                tl.store(h + rows[:, None] * INTER + cols[None, :], hq, mask=mask)
                kb = n0 // SCALE_K + tl.arange(0, BLOCK_N // SCALE_K)
                tl.store(h_scales + rows[:, None] * H_SCALE_COLS + kb[None, :], hs,
                         mask=live[:, None] & (kb[None, :] < H_SCALE_COLS))
            if SAVE_GEMM1:
                if row0 < saved_rows:
                    at = preact + rows[:, None] * (2 * INTER) + cols[None, :]
                    saved = mask & (rows < saved_rows)[:, None]
                    tl.store(at, g.to(preact.dtype.element_ty), mask=saved)
                    tl.store(at + INTER, u.to(preact.dtype.element_ty), mask=saved)
            if CLAIM_AHEAD:
                tile = next_tile
            else:
                tile = tl.atomic_add(state + GEMM1_NEXT_TILE, 1, sem="relaxed").to(tl.int32)


@triton.jit
def gate_up(
    recv, recv_scales, w1, w1_scales, w3, w3_scales, le, rows, n0,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr, SCALE_K: tl.constexpr, W_SCALE_N: tl.constexpr,
    MX_DOT: tl.constexpr, QUANTIZE_A: tl.constexpr,
):
    """GEMM1 of one tile: ``x W1^T`` and ``x W3^T`` (fp32) for ``rows`` x the BLOCK_N
    columns from ``n0``, in one mainloop (both weights share each tile of ``x``); scaled
    when ``SCALE_K`` > 0, the rows quantized as they are read with ``QUANTIZE_A`` > 0
    (``tile_gemm``)."""
    return tile_gemm(
        recv, recv_scales, rows, w1, w1_scales, b2=w3, b2_scale=w3_scales, expert=le, n0=n0, k_start=0, k_end=HIDDEN,
        N=INTER, K=HIDDEN, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, TWO_B=True, SCALE_K=SCALE_K,
        B_SCALE_N=W_SCALE_N, MX_DOT=MX_DOT, QUANTIZE_A=QUANTIZE_A, UPCAST_DOT=UPCAST_DOT, B_N_MAJOR=False,
        B_K_SPLIT=0,
    )

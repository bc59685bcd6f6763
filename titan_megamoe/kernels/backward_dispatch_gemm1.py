"""Backward, first half: dispatch + GEMM1 (recomputed or read back) + ``dY W2`` + SwiGLU
backward, in one persistent kernel, the transpose of ``dispatch_gemm1``.

Programs ``0 .. COMM_PROGRAMS-1`` push, per item (<= BLOCK_M rows of one expert), the
output-gradient rows ``dy`` and the scores into the owner's receive buffers, and the
expert input rows (as the forward did) unless the owner still holds them from the
forward (its NEEDS_INPUT flag), then release CHUNK_READY (protocol: ``sync``). Every
program then takes tiles (TILE_M rows x BLOCK_N intermediate columns) from a device
counter in arrival order; a tile waits only for the chunks its rows come from, and:

- has the pre-activations ``g = x W1^T``, ``u = x W3^T`` (recomputed, or read from the
  forward's ``preact`` when it saved them; where it saved only the receive buffer's first
  rows, a second launch with no dispatching programs recomputes the tiles that reach past
  them: ``TILES``);
- computes ``d = dy W2`` (the gradient reaching ``h`` before the score), from ``w2_operand``:
  W2 transposed per expert to ``[I, H]`` (K-major), or, unquantized, from W2 as stored
  (``W2_AS_STORED``: an N-major B operand);
- stores the partial score gradient ``<h, d>`` over its columns (``score_parts``, summed
  in fixed order by the next kernel), and with ``dh = score * d`` (or ``d`` when the score
  was applied before the experts), ``da = dh * u * silu'(g)``, ``db = dh * silu(g)``, into
  ``dab = [da | db]`` (``[rows, 2I]``, the A operand of ``dx = dab [W1 | W3]``);
- stores ``h_wgrad = score * h`` (or ``h``), the operand of ``dW2 = dy^T h_wgrad``.

Where GEMM1 was saved the SwiGLU backward may run over each half of the tile's columns in
turn (``EPILOGUE_PARTS``): the ``dy W2`` accumulator stays whole, but only one half's
temporaries are live beside it, so 128-column tiles keep to the registers.

An expert's padding rows (up to its next multiple of ``ROW_ALIGN``) are stored as zeros
(``dab``, ``h_wgrad``, and, for torch's bf16 grouped GEMMs, the received ``x`` and ``dy``
rows), so the weight-gradient GEMMs may run over whole alignments whatever the buffers
held before; a tile's rows past those belong to the next expert and are never stored.

Quantized: the ``dy`` rows arrive as e4m3 with their scales, GEMM1 and ``dy W2`` are
scaled GEMMs (``tile_gemm``), and ``[da | db]`` is stored twice: in the activation dtype
for the weight gradients (``wgrad``), and quantized along I for the dgrad GEMM
(``dab_q``, ``dab_scales``). With native weight gradients after a quantized forward
(``mxfp8_wgrad_bf16``) the expert inputs and ``dy`` arrive in the activation dtype, as
the weight gradients read them, and GEMM1 and ``dy W2`` quantize them as they read them.
"""

import triton
import triton.language as tl

from titan_megamoe.kernels.dispatch_gemm1 import dispatch_item, gate_up, wait_rows
from titan_megamoe.kernels.layout import saved_tile_rows, tile_rows
from titan_megamoe.kernels.mainloop import tile_gemm
from titan_megamoe.kernels.quantize import quantize_tile, round_rows
from titan_megamoe.kernels.sync import EPOCH, NUM_BLOCKS, NUM_ITEMS

ALL_TILES = tl.constexpr(0)
"""``TILES``: every tile, GEMM1 recomputed (nothing was saved)."""
SAVED_TILES = tl.constexpr(1)
"""``TILES``: the tiles whose rows all lie below ``saved_rows``, GEMM1 read from ``preact``."""
PAST_SAVED_TILES = tl.constexpr(2)
"""``TILES``: the others, GEMM1 recomputed and rounded as the forward saved it."""
DISPATCH_ONLY = tl.constexpr(3)
"""``TILES``: none: the rows dispatched alone (and ``ZERO_PADDING``'s zeros), where Hopper's
Gluon core computes the saved tiles (``kernels.gluon.sm90.swiglu_grad_gemm``)."""


@triton.jit
def dispatch_grad_gemm1_kernel(
    x, x_scales, dy, dy_scales, topk_w, order, send_first, send_end, dest_start, item_start,
    recv_ptrs, grad_ptrs, score_ptrs, meta_ptrs, flag_ptrs,
    recv, recv_scales, recv_grad, recv_grad_scales, recv_score, recv_meta, flags, state,
    local_base, block_base, local_rows, src_offset, src_rows, w1, w1_scales, w2_operand, w2_operand_scales,
    w3, w3_scales,
    preact, h_wgrad, dab, dab_q, dab_scales, score_parts,
    rank, ep, local_experts, rows_per_rank, saved_rows,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
    SCORE_BEFORE_EXPERTS: tl.constexpr, TILES: tl.constexpr,
    NEXT_TILE: tl.constexpr, COMM_PROGRAMS: tl.constexpr,
    NEEDS_INPUT: tl.constexpr, CHUNK_READY: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    EP_PAD: tl.constexpr, LOCAL_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, ROW_ALIGN: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, COPY_ROWS: tl.constexpr, COPY_COLS: tl.constexpr, UPCAST_DOT: tl.constexpr,
    X_SCALE_K: tl.constexpr, GRAD_SCALE_K: tl.constexpr, W_SCALE_N: tl.constexpr,
    MX_DOT: tl.constexpr, QUANTIZE_ON_READ: tl.constexpr, POWER_OF_TWO: tl.constexpr, ACT_DTYPE: tl.constexpr,
    ZERO_PADDING: tl.constexpr, X_ROUND_K: tl.constexpr, GRAD_ROUND_K: tl.constexpr,
    W2_AS_STORED: tl.constexpr, EPILOGUE_PARTS: tl.constexpr,
):
    """The tiles ``TILES`` names (``ALL_TILES``, ``SAVED_TILES``: those whose rows all lie
    below the forward's ``saved_rows`` saved rows, ``PAST_SAVED_TILES``: the others,
    ``DISPATCH_ONLY``: none), taken
    from the state counter ``NEXT_TILE``. GEMM1 is read from ``preact`` for the saved
    tiles, else recomputed (past the saved ones, rounded to ``ACT_DTYPE`` as the forward
    would have saved it).

    ``X_SCALE_K`` > 0: the expert inputs cross quantized and GEMM1 is scaled (the
    forward format). ``GRAD_SCALE_K`` > 0 (a quantized dgrad format): the ``dy`` rows cross
    quantized, ``dy W2`` is scaled, and ``[da | db]`` is also stored quantized for the
    dgrad GEMM (``dab_q``, ``dab_scales``, after rounding to ``ACT_DTYPE``); weights are
    e4m3 with one scale per ``W_SCALE_N x`` scale-width block (``MX_DOT``: ``tile_gemm``).
    ``QUANTIZE_ON_READ`` (native weight gradients, which read the rows as they crossed):
    the expert inputs and ``dy`` cross in the activation dtype, and the scaled GEMMs
    quantize them as they read them. ``ZERO_PADDING``: zero the received rows past each
    expert's end up to its alignment (for weight-gradient GEMMs over whole alignments).
    ``X_ROUND_K``, ``GRAD_ROUND_K`` > 0 (MX held in the activation dtype, the scale widths 0): the expert
    inputs, and the ``dy`` rows, arrive so, and ``[da | db]`` is also stored so for the
    dgrad GEMM, rounded in blocks of ``GRAD_ROUND_K`` columns into ``dab_q``."""
    pid = tl.program_id(0)
    epoch = tl.load(state + EPOCH)
    RECOMPUTE: tl.constexpr = TILES != SAVED_TILES
    ROUND_PREACT: tl.constexpr = TILES == PAST_SAVED_TILES
    # What the rows cross the link in: quantized, or the activation dtype.
    LINK_X_SCALE_K: tl.constexpr = 0 if QUANTIZE_ON_READ else X_SCALE_K
    LINK_GRAD_SCALE_K: tl.constexpr = 0 if QUANTIZE_ON_READ else GRAD_SCALE_K
    LINK_X_ROUND_K: tl.constexpr = 0 if QUANTIZE_ON_READ else X_ROUND_K
    # MX block widths the GEMMs quantize their A rows in as they read them (0: none).
    X_READ_K: tl.constexpr = (X_SCALE_K + X_ROUND_K) if QUANTIZE_ON_READ else 0
    GRAD_READ_K: tl.constexpr = (GRAD_SCALE_K + GRAD_ROUND_K) if QUANTIZE_ON_READ else 0
    if pid < COMM_PROGRAMS:
        for item in range(pid, tl.load(state + NUM_ITEMS).to(tl.int32), COMM_PROGRAMS):
            dispatch_item(
                item, x, x_scales, dy, dy_scales, topk_w, order, send_first, send_end, dest_start, item_start, recv,
                recv_scales,
                recv_grad, recv_grad_scales, recv_score, recv_meta, flags, recv_ptrs, grad_ptrs, score_ptrs, meta_ptrs,
                flag_ptrs, epoch, rank, ep, local_experts, rows_per_rank, HIDDEN=HIDDEN, TOP_K=TOP_K,
                SCORE_BEFORE_EXPERTS=SCORE_BEFORE_EXPERTS, WITH_GRAD=True, NEEDS_INPUT=NEEDS_INPUT,
                CHUNK_READY=CHUNK_READY, MAX_CHUNKS=MAX_CHUNKS, EXPERT_PAD=EP_PAD * LOCAL_PAD, BLOCK_M=BLOCK_M,
                COPY_ROWS=COPY_ROWS, COPY_COLS=COPY_COLS, ROW_SCALE_K=LINK_X_SCALE_K, GRAD_SCALE_K=LINK_GRAD_SCALE_K,
                POWER_OF_TWO=POWER_OF_TWO, ROW_ROUND_K=LINK_X_ROUND_K,
            )

    if TILES == DISPATCH_ONLY:
        if ZERO_PADDING:
            _zero_padding(recv, recv_grad, local_base, local_rows, local_experts, HIDDEN=HIDDEN, ROW_ALIGN=ROW_ALIGN,
                          BLOCK_K=BLOCK_K)
    else:
        n_tiles: tl.constexpr = tl.cdiv(INTER, BLOCK_N)
        # The tiles' virtual rows (``layout``): the saved ones are a prefix.
        first_row = 0
        last_row = tl.load(state + NUM_BLOCKS).to(tl.int32) * BLOCK_M
        if TILES != ALL_TILES:
            saved_end = saved_tile_rows(block_base, local_base, local_rows, local_experts, saved_rows,
                                        TILE_M=TILE_M, BLOCK_M=BLOCK_M, LOCAL_PAD=LOCAL_PAD)
            if TILES == SAVED_TILES:
                last_row = saved_end
            else:
                first_row = saved_end
        num_tiles = (last_row - first_row) // TILE_M * n_tiles
        tile = tl.atomic_add(state + NEXT_TILE, 1, sem="relaxed").to(tl.int32)
        while tile < num_tiles:
            n_tile = tile % n_tiles
            le, base, end, row0 = tile_rows(block_base, local_base, local_rows, local_experts,
                                            first_row + (tile // n_tiles) * TILE_M, LOCAL_PAD)
            wait_rows(
                flags, flag_ptrs, state, src_offset, src_rows, base, le, row0, epoch, rank, ep, local_experts,
                CHUNK_READY=CHUNK_READY, MAX_CHUNKS=MAX_CHUNKS, EP_PAD=EP_PAD, BLOCK_M=BLOCK_M, TILE_M=TILE_M,
            )

            # The next tile, claimed now: the mainloop hides the atomic's round trip.
            next_tile = tl.atomic_add(state + NEXT_TILE, 1, sem="relaxed").to(tl.int32)
            rows = (row0 + tl.arange(0, TILE_M)).to(tl.int64)
            n0 = n_tile * BLOCK_N
            live = rows < end
            # The expert's rows and its padding: every row the tile stores.
            owned = rows < base + (end - base + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
            if RECOMPUTE:
                g, u = gate_up(recv, recv_scales, w1, w1_scales, w3, w3_scales, le, rows, n0, HIDDEN=HIDDEN,
                               INTER=INTER, BLOCK_M=TILE_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, UPCAST_DOT=UPCAST_DOT,
                               SCALE_K=X_SCALE_K, W_SCALE_N=W_SCALE_N, MX_DOT=MX_DOT, QUANTIZE_A=X_READ_K)
                if ROUND_PREACT:
                    g = g.to(ACT_DTYPE).to(tl.float32)
                    u = u.to(ACT_DTYPE).to(tl.float32)
            elif EPILOGUE_PARTS == 1:
                # Loaded before the K loop, which hides their latency (two halves held
                # through it would take the registers that the parts free).
                g, u = _saved_preact(preact, rows, live, n0, COLS=BLOCK_N, INTER=INTER, BLOCK_N=BLOCK_N)
            # The scores too: one value per row, its latency hidden by the K loop.
            score = None if SCORE_BEFORE_EXPERTS else tl.load(recv_score + rows, mask=live, other=0.0)

            # d = dy W2[le][:, cols] = dy (W2^T)[le][cols, :]^T.
            d = tile_gemm(
                recv_grad, recv_grad_scales, rows, w2_operand, w2_operand_scales, b2=None, b2_scale=None, expert=le,
                n0=n0, k_start=0, k_end=HIDDEN, N=INTER, K=HIDDEN, BLOCK_M=TILE_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                TWO_B=False, SCALE_K=GRAD_SCALE_K, B_SCALE_N=W_SCALE_N, MX_DOT=MX_DOT, QUANTIZE_A=GRAD_READ_K,
                UPCAST_DOT=UPCAST_DOT, B_N_MAJOR=W2_AS_STORED, B_K_SPLIT=0,
            )
            if EPILOGUE_PARTS == 1:
                score_part = _swiglu_backward(
                    d, g, u, n0, rows, live, owned, score, dab, dab_q, dab_scales, h_wgrad, INTER=INTER,
                    BLOCK_N=BLOCK_N, SCORE_BEFORE_EXPERTS=SCORE_BEFORE_EXPERTS, GRAD_SCALE_K=GRAD_SCALE_K,
                    GRAD_ROUND_K=GRAD_ROUND_K, POWER_OF_TWO=POWER_OF_TWO, ACT_DTYPE=ACT_DTYPE,
                )
            else:
                tl.static_assert(EPILOGUE_PARTS == 2, "the epilogue runs in one part or two")
                HALF_N: tl.constexpr = BLOCK_N // 2
                d0, d1 = _halves(d)
                if RECOMPUTE:
                    g0, g1 = _halves(g)
                    u0, u1 = _halves(u)
                else:
                    g0, u0 = _saved_preact(preact, rows, live, n0, COLS=HALF_N, INTER=INTER, BLOCK_N=BLOCK_N)
                score_part = _swiglu_backward(
                    d0, g0, u0, n0, rows, live, owned, score, dab, dab_q, dab_scales, h_wgrad, INTER=INTER,
                    BLOCK_N=BLOCK_N, SCORE_BEFORE_EXPERTS=SCORE_BEFORE_EXPERTS, GRAD_SCALE_K=GRAD_SCALE_K,
                    GRAD_ROUND_K=GRAD_ROUND_K, POWER_OF_TWO=POWER_OF_TWO, ACT_DTYPE=ACT_DTYPE,
                )
                if not RECOMPUTE:
                    g1, u1 = _saved_preact(preact, rows, live, n0 + HALF_N, COLS=HALF_N, INTER=INTER, BLOCK_N=BLOCK_N)
                score_part += _swiglu_backward(
                    d1, g1, u1, n0 + HALF_N, rows, live, owned, score, dab, dab_q, dab_scales, h_wgrad, INTER=INTER,
                    BLOCK_N=BLOCK_N, SCORE_BEFORE_EXPERTS=SCORE_BEFORE_EXPERTS, GRAD_SCALE_K=GRAD_SCALE_K,
                    GRAD_ROUND_K=GRAD_ROUND_K, POWER_OF_TWO=POWER_OF_TWO, ACT_DTYPE=ACT_DTYPE,
                )
            tl.store(score_parts + rows * n_tiles + n_tile, score_part, mask=live)

            if ZERO_PADDING:
                if (n_tile == 0) & (end < row0 + TILE_M):
                    # Zero the received rows past the expert's end: the weight-gradient GEMMs
                    # read whole alignments. Other tiles of this expert may still read them;
                    # their results for those rows are masked to zero above, so either value
                    # is harmless.
                    pad = (rows >= end) & owned
                    ks = tl.arange(0, BLOCK_K)
                    zero = tl.zeros((TILE_M, BLOCK_K), dtype=dab.dtype.element_ty)
                    for c0 in range(0, HIDDEN, BLOCK_K):
                        at_x = rows[:, None] * HIDDEN + c0 + ks[None, :]
                        zmask = pad[:, None] & ((c0 + ks[None, :] < HIDDEN) | (HIDDEN % BLOCK_K == 0))
                        tl.store(recv + at_x, zero, mask=zmask)
                        tl.store(recv_grad + at_x, zero, mask=zmask)
            tile = next_tile


@triton.jit
def _zero_padding(recv, recv_grad, local_base, local_rows, local_experts, HIDDEN: tl.constexpr,
                  ROW_ALIGN: tl.constexpr, BLOCK_K: tl.constexpr):
    """Zero the received rows of ``x`` and ``dy`` past each local expert's end up to its
    alignment (``ZERO_PADDING``), an expert per program: no dispatch writes them."""
    pad = tl.arange(0, ROW_ALIGN)
    ks = tl.arange(0, BLOCK_K)
    zero = tl.zeros((ROW_ALIGN, BLOCK_K), dtype=recv.dtype.element_ty)
    for le in range(tl.program_id(0), local_experts, tl.num_programs(0)):
        count = tl.load(local_rows + le)
        rows = (tl.load(local_base + le) + count + pad).to(tl.int64)
        padding = count + pad < (count + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
        for c0 in range(0, HIDDEN, BLOCK_K):
            at = rows[:, None] * HIDDEN + c0 + ks[None, :]
            mask = padding[:, None] & ((c0 + ks[None, :] < HIDDEN) | (HIDDEN % BLOCK_K == 0))
            tl.store(recv + at, zero, mask=mask)
            tl.store(recv_grad + at, zero, mask=mask)


@triton.jit
def _halves(x):
    """``x [M, N]`` -> its column halves ``[M, N / 2]``. An MMA accumulator holds each row's
    values in the same threads, so the split moves no data."""
    M: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, (M, 2, N // 2)), (0, 2, 1)))


@triton.jit
def _saved_preact(preact, rows, live, c0, COLS: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr):
    """GEMM1's saved results ``g``, ``u`` of ``rows`` over the intermediate columns ``c0 ..
    c0 + COLS`` of a tile ``BLOCK_N`` wide (rows not ``live`` and columns past ``INTER``
    read as 0: the rows past a saved tile's expert may lie past ``preact``), in the saved
    dtype: ``_swiglu_backward`` widens them, so a tile that holds them through its
    mainloop holds half the registers."""
    cols = c0 + tl.arange(0, COLS)
    col_ok = (cols < INTER) | (INTER % BLOCK_N == 0)
    at = preact + rows[:, None] * (2 * INTER) + cols[None, :]
    mask = live[:, None] & col_ok[None, :]
    g = tl.load(at, mask=mask, other=0.0)
    u = tl.load(at + INTER, mask=mask, other=0.0)
    return g, u


@triton.jit
def _swiglu_backward(
    d, g, u, c0, rows, live, owned, score, dab, dab_q, dab_scales, h_wgrad,
    INTER: tl.constexpr, BLOCK_N: tl.constexpr, SCORE_BEFORE_EXPERTS: tl.constexpr,
    GRAD_SCALE_K: tl.constexpr, GRAD_ROUND_K: tl.constexpr, POWER_OF_TWO: tl.constexpr, ACT_DTYPE: tl.constexpr,
):
    """The SwiGLU backward of the tile's ``rows`` over the intermediate columns ``c0 ..
    c0 + d.shape[1]`` (a tile ``BLOCK_N`` wide, or a half of one) from ``d = dy W2`` and
    GEMM1's ``g``, ``u`` and the rows' scores (None where they scaled the expert input):
    stores ``[da | db]`` (and its quantized or MX-rounded copy) and ``h_wgrad`` of the
    ``owned`` rows (zeros past the ``live`` ones); returns each row's ``<h, d>`` over those
    columns."""
    out_dtype = dab.dtype.element_ty
    PART_N: tl.constexpr = d.shape[1]
    cols = c0 + tl.arange(0, PART_N)
    col_ok = (cols < INTER) | (INTER % BLOCK_N == 0)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    h = silu * u
    score_part = tl.sum(h * d, axis=1)
    if SCORE_BEFORE_EXPERTS:
        dh = d
    else:
        dh = d * score[:, None]
        h = h * score[:, None]
    keep = live[:, None] & col_ok[None, :]
    mask = owned[:, None] & col_ok[None, :]
    da = tl.where(keep, dh * u * sig * (1.0 + g * (1.0 - sig)), 0.0)
    db = tl.where(keep, dh * silu, 0.0)
    at = dab + rows[:, None] * (2 * INTER) + cols[None, :]
    tl.store(at, da.to(out_dtype), mask=mask)
    tl.store(at + INTER, db.to(out_dtype), mask=mask)
    if GRAD_SCALE_K > 0:
        tl.static_assert((PART_N % GRAD_SCALE_K == 0) & (INTER % GRAD_SCALE_K == 0),
                         "tiles and the intermediate size must hold whole scale blocks of [da | db]")
        SCALE_COLS: tl.constexpr = 2 * INTER // GRAD_SCALE_K
        kb = c0 // GRAD_SCALE_K + tl.arange(0, PART_N // GRAD_SCALE_K)
        at_q = dab_q + rows[:, None] * (2 * INTER) + cols[None, :]
        at_s = dab_scales + rows[:, None] * SCALE_COLS + kb[None, :]
        s_mask = owned[:, None] & (kb[None, :] < INTER // GRAD_SCALE_K)
        q, scales = quantize_tile(da.to(ACT_DTYPE).to(tl.float32), SCALE_K=GRAD_SCALE_K, POWER_OF_TWO=POWER_OF_TWO)
        tl.store(at_q, q, mask=mask)
        tl.store(at_s, scales, mask=s_mask)
        q, scales = quantize_tile(db.to(ACT_DTYPE).to(tl.float32), SCALE_K=GRAD_SCALE_K, POWER_OF_TWO=POWER_OF_TWO)
        tl.store(at_q + INTER, q, mask=mask)
        tl.store(at_s + INTER // GRAD_SCALE_K, scales, mask=s_mask)
    if GRAD_ROUND_K > 0:
        tl.static_assert((PART_N % GRAD_ROUND_K == 0) & (INTER % GRAD_ROUND_K == 0),
                         "tiles and the intermediate size must hold whole MX blocks of [da | db]")
        at_q = dab_q + rows[:, None] * (2 * INTER) + cols[None, :]
        tl.store(at_q, round_rows(da.to(ACT_DTYPE).to(tl.float32), GRAD_ROUND_K).to(out_dtype), mask=mask)
        tl.store(at_q + INTER, round_rows(db.to(ACT_DTYPE).to(tl.float32), GRAD_ROUND_K).to(out_dtype), mask=mask)
    at = h_wgrad + rows[:, None] * INTER + cols[None, :]
    tl.store(at, tl.where(keep, h, 0.0).to(out_dtype), mask=mask)
    return score_part

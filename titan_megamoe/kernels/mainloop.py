"""The tile-GEMM mainloop every GEMM kernel of the operator runs.

``tile_gemm`` computes one ``BLOCK_M x BLOCK_N`` tile of ``A B^T`` in fp32: ``A [rows, K]``
K-major rows, ``B [experts, N, K]`` one weight per expert, also K-major (Hopper's fp8 MMA
takes K-major operands only), or, unscaled, ``[experts, K, N]`` with ``B_N_MAJOR`` (a
weight read as stored instead of from a transposed copy; as fast in Triton 3.6 on H200
at K = 2,048, 6% slower at 4,096: docs/perf-history.md v21), over the columns ``k_start ..
k_end`` of K (the weight gradients contract one expert's token range of token-major
copies). With ``TWO_B`` a second B of the same shape shares each A tile (GEMM1's W1 and
W3). With ``B_K_SPLIT`` (N-major, unscaled) B is two weights stacked along K, ``b`` its rows
``0 .. B_K_SPLIT`` and ``b2`` the rest, each K step reading the one its rows lie in (the
dgrad GEMM's ``[W1 | W3]`` read as stored, no transposed copy).

Quantized operands (e4m3) bring fp32 scales: A one per row per ``SCALE_K`` elements along
K (``[rows, cdiv(K, SCALE_K)]``), B one per ``B_SCALE_N x SCALE_K`` block
(``[experts, cdiv(N, B_SCALE_N), cdiv(K, SCALE_K)]``): 1x128 and 128x128 for blockwise fp8,
1x32 and 1x32 for mxfp8. Two ways to apply them:

- promotion (blockwise fp8): Hopper's MMA has no block scaling, so each scale block's
  partial product is accumulated on its own and promoted once into the fp32
  accumulator, ``acc += dot(a, b) * sa[:, None] * sb[None, :]`` (DeepSeek-V3's);
- MX (mxfp8, power-of-two scales, ``MX_DOT``): with ``MX_SCALED_DOT`` the scales go into
  the MMA itself, ``acc = dot_scaled(a, sa, b, sb, acc)`` with the scales as UE8M0
  exponents: native MX MMA on Blackwell, Triton's emulation on Hopper. With
  ``MX_UPCAST_DOT`` the mainloop multiplies each e4m3 tile by its scales into bf16 itself
  and runs a bf16 dot (Hopper has no MX MMA). Both are exact from bf16's smallest normal,
  2^-126, up: a power of two times an e4m3 value is a bf16 value there.
  With ``QUANTIZE_A``, A arrives unquantized (rows that crossed the link in the
  activation dtype) and each tile is quantized as it is read, exactly as the reference
  quantizes such a row (``quantize_tile``). With ``B_SCALE_N`` 0, B holds weights
  already dequantized to bf16 (the same values), so only A is scaled.

MX operands held in bf16 (``Format.in_bf16``) are unscaled operands here; only rows that
arrive unrounded are rounded as they are read (``QUANTIZE_A`` with ``SCALE_K`` 0).
"""

import triton
import triton.language as tl

from titan_megamoe.kernels.quantize import quantize_tile, round_rows
from titan_megamoe.precision import Format

MX_SCALED_DOT = tl.constexpr(1)
MX_UPCAST_DOT = tl.constexpr(2)
"""``MX_DOT`` values (0: not an MX format)."""


def mx_dot(fmt: Format, upcast: bool) -> int:
    """``MX_DOT`` for GEMMs over ``fmt`` operands, MX tiles upcast in the mainloop or not
    (the tile field ``mx_upcast``)."""
    if not fmt.scaled_mma:
        return 0
    return (MX_UPCAST_DOT if upcast else MX_SCALED_DOT).value


@triton.jit
def _ue8m0(scale):
    """Power-of-two fp32 scales as UE8M0 exponents (their biased exponent bits: 2^-127,
    stored as the subnormal 2^-127, gives 0), the form ``tl.dot_scaled`` takes."""
    return ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)


@triton.jit
def _dot(x, y, acc, UPCAST_DOT: tl.constexpr):
    """``acc + x y``; with ``UPCAST_DOT`` the operands go in fp32."""
    if UPCAST_DOT:
        x, y = x.to(tl.float32), y.to(tl.float32)
    return tl.dot(x, y, acc)


@triton.jit
def _upcast_rows(x, scale, SCALE_K: tl.constexpr):
    """e4m3 ``x [R, C]`` times its power-of-two ``scale [R, C // SCALE_K]``, in bf16 (the
    product formed in fp32, which the Triton interpreter also computes right)."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    blocks = tl.reshape(x.to(tl.float32), (R, C // SCALE_K, SCALE_K))
    return tl.reshape(blocks * scale[:, :, None], (R, C)).to(tl.bfloat16)


@triton.jit
def _upcast_cols(x, scale, SCALE_K: tl.constexpr):
    """e4m3 ``x [C, N]`` (K along C) times its power-of-two ``scale [N, C // SCALE_K]``, in bf16."""
    C: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    blocks = tl.reshape(x.to(tl.float32), (C // SCALE_K, SCALE_K, N))
    return tl.reshape(blocks * tl.trans(scale)[:, None, :], (C, N)).to(tl.bfloat16)


@triton.jit
def tile_gemm(
    a, a_scale, rows, b, b_scale, b2, b2_scale, expert, n0, k_start, k_end,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TWO_B: tl.constexpr, SCALE_K: tl.constexpr, B_SCALE_N: tl.constexpr, MX_DOT: tl.constexpr,
    QUANTIZE_A: tl.constexpr, UPCAST_DOT: tl.constexpr, B_N_MAJOR: tl.constexpr, B_K_SPLIT: tl.constexpr,
):
    """``A[rows] B[expert][cols]^T`` (fp32, ``[BLOCK_M, BLOCK_N]``); with ``TWO_B`` the pair
    ``(A B^T, A B2^T)``.

    ``rows``: BLOCK_M row indices, every one readable (rows past the caller's end are
    computed, not masked); ``n0``: the tile's first column, a multiple of BLOCK_N (columns
    ``>= N`` are masked).
    ``k_start``, ``k_end``: multiples of the K step (``SCALE_K`` when promoting, else
    ``BLOCK_K``), ``k_end`` at most K; the GEMMs over whole rows pass ``0, K``.
    ``SCALE_K`` 0: unscaled operands, the ``*_scale`` arguments unused (None). Otherwise
    ``BLOCK_K`` must divide ``SCALE_K`` (promotion) or be a multiple of it (``MX_DOT``,
    which takes ``B_SCALE_N`` 1, or 0 for a bf16 B without scales). ``QUANTIZE_A`` > 0:
    ``a`` holds unquantized rows, quantized as they are read in MX blocks of that many
    elements: into e4m3 and scales for an MX dot (``QUANTIZE_A == SCALE_K``, ``a_scale``
    unused), or rounded in their dtype for unscaled operands (``SCALE_K`` 0: MX held in
    bf16, ``BLOCK_K`` a multiple of it).
    ``UPCAST_DOT``: operands go to the dot in fp32 (the Triton interpreter computes bf16
    dots wrongly). ``B_N_MAJOR``: B (and B2) are ``[experts, K, N]``; unscaled only.
    ``B_K_SPLIT`` > 0 (N-major, one B, ``K = 2 B_K_SPLIT``, a multiple of ``BLOCK_K``): ``b``
    and ``b2`` are ``[experts, B_K_SPLIT, N]``, B's rows ``k`` and ``B_K_SPLIT + k``, and
    ``b2`` lies a multiple of 16 bytes from ``b`` (the loads stay 16 bytes wide).
    """
    PROMOTE: tl.constexpr = (SCALE_K > 0) & (not MX_DOT)
    if PROMOTE:
        tl.static_assert(SCALE_K % BLOCK_K == 0, "BLOCK_K must divide SCALE_K")
    tl.static_assert((not B_N_MAJOR) | (SCALE_K == 0), "an N-major B is read unscaled only")
    tl.static_assert((B_K_SPLIT == 0) | (B_N_MAJOR & (not TWO_B) & (QUANTIZE_A == 0) & (K == 2 * B_K_SPLIT)
                                         & (B_K_SPLIT % BLOCK_K == 0)),
                     "a B split along K is two N-major halves of whole K steps, unrounded")
    if MX_DOT:
        tl.static_assert(SCALE_K > 0, "an MX dot needs scales")
        tl.static_assert((BLOCK_K % SCALE_K == 0) & (B_SCALE_N <= 1), "an MX dot takes whole 1 x SCALE_K blocks")
        tl.static_assert((QUANTIZE_A == 0) | (QUANTIZE_A == SCALE_K), "an MX dot quantizes A in its scale blocks")
    elif QUANTIZE_A > 0:
        tl.static_assert((SCALE_K == 0) & (BLOCK_K % QUANTIZE_A == 0),
                         "A is rounded on read only for unscaled operands, in whole blocks of a K step")
    # A tile inside one weight scale block (blockwise fp8's 128 x 128) has one B scale per
    # K block: the promotion is then one FMA per element (the row scales times it), not
    # a multiply by each column's scale and an FMA.
    UNIFORM_B_SCALE: tl.constexpr = PROMOTE & (B_SCALE_N % BLOCK_N == 0)
    # One pass of the K loop covers a scale block when promoting, else one BLOCK_K step.
    STEP: tl.constexpr = SCALE_K if PROMOTE else BLOCK_K
    ks = tl.arange(0, BLOCK_K)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = (cols < N) | (N % BLOCK_N == 0)
    # Pointers are built once, before the K loop, which only adds k: offsets recomputed
    # inside the loop keep the compiler from pipelining its loads.
    a_ptrs = a + rows[:, None].to(tl.int64) * K + ks[None, :]
    expert_offset = tl.cast(expert, tl.int64) * N * (B_K_SPLIT if B_K_SPLIT > 0 else K)
    # Elements between one K row of a B tile and the next.
    B_K_STRIDE: tl.constexpr = N if B_N_MAJOR else 1
    if B_N_MAJOR:
        b_tile = ks[:, None] * N + cols[None, :]
    elif N * K >= 2**31:
        # A token-major operand of the weight gradients: N rows of up to every token a
        # routing can bring (235B-A22B at EP 8: 4,096 x 1.05 M elements) need int64.
        b_tile = cols[None, :].to(tl.int64) * K + ks[:, None]
    else:
        b_tile = cols[None, :] * K + ks[:, None]
    b_ptrs = b + expert_offset + b_tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TWO_B:
        b2_ptrs = b2 + expert_offset + b_tile
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if B_K_SPLIT > 0:
        # From row B_K_SPLIT on, B's rows lie in b2: a scalar added to the same pointers
        # (one dot per K step, so the MMAs stay pipelined).
        ELEM: tl.constexpr = b.dtype.element_ty.primitive_bitwidth // 8
        b2_gap = tl.multiple_of((b2.to(tl.int64) - b.to(tl.int64)) // ELEM, 16 // ELEM) - B_K_SPLIT * N
    if SCALE_K > 0:
        K_BLOCKS: tl.constexpr = tl.cdiv(K, SCALE_K)
        if not QUANTIZE_A:
            sa_ptrs = a_scale + rows.to(tl.int64) * K_BLOCKS
        if B_SCALE_N > 0:
            scale_cols = n0 if UNIFORM_B_SCALE else cols  # the tile's one scale, or each column's
            sb_offsets = (tl.cast(expert, tl.int64) * tl.cdiv(N, B_SCALE_N) + scale_cols // B_SCALE_N) * K_BLOCKS
            sb_ptrs = b_scale + sb_offsets
            if TWO_B:
                sb2_ptrs = b2_scale + sb_offsets
        if MX_DOT:
            # [rows, scale blocks of one K step] and [cols, scale blocks of one K step].
            step_blocks = tl.arange(0, BLOCK_K // SCALE_K)
            if not QUANTIZE_A:
                sa_ptrs = sa_ptrs[:, None] + step_blocks[None, :]
            if B_SCALE_N > 0:
                sb_ptrs = sb_ptrs[:, None] + step_blocks[None, :]
                if TWO_B:
                    sb2_ptrs = sb2_ptrs[:, None] + step_blocks[None, :]

    for k0 in range(k_start, k_end, STEP):
        if MX_DOT:
            k_ok = (k0 + ks < K) | (K % BLOCK_K == 0)
            b_mask = col_ok[None, :] & k_ok[:, None]
            kb = k0 // SCALE_K
            kb_ok = (kb + step_blocks < K_BLOCKS) | (K % BLOCK_K == 0)
            sb_mask = col_ok[:, None] & kb_ok[None, :]
            x = tl.load(a_ptrs + k0, mask=k_ok[None, :], other=0.0)
            if QUANTIZE_A:
                # Columns past K read as 0: a partial last block quantizes as the
                # reference's zero-padded one.
                x, sx = quantize_tile(x.to(tl.float32), SCALE_K=SCALE_K, POWER_OF_TWO=True)
            else:
                sx = tl.load(sa_ptrs + kb, mask=kb_ok[None, :], other=1.0)
            y = tl.load(b_ptrs + k0, mask=b_mask, other=0.0)
            if TWO_B:
                y2 = tl.load(b2_ptrs + k0, mask=b_mask, other=0.0)
            if B_SCALE_N > 0:
                sy = tl.load(sb_ptrs + kb, mask=sb_mask, other=1.0)
                if TWO_B:
                    sy2 = tl.load(sb2_ptrs + kb, mask=sb_mask, other=1.0)
            if MX_DOT == MX_UPCAST_DOT:
                x = _upcast_rows(x, sx, SCALE_K)
                if B_SCALE_N > 0:
                    y = _upcast_cols(y, sy, SCALE_K)
                    if TWO_B:
                        y2 = _upcast_cols(y2, sy2, SCALE_K)
                acc = _dot(x, y, acc, UPCAST_DOT)
                if TWO_B:
                    acc2 = _dot(x, y2, acc2, UPCAST_DOT)
            elif B_SCALE_N > 0:
                acc = tl.dot_scaled(x, _ue8m0(sx), "e4m3", y, _ue8m0(sy), "e4m3", acc=acc)
                if TWO_B:
                    acc2 = tl.dot_scaled(x, _ue8m0(sx), "e4m3", y2, _ue8m0(sy2), "e4m3", acc=acc2)
            else:
                acc = tl.dot_scaled(x, _ue8m0(sx), "e4m3", y, None, "bf16", acc=acc)
                if TWO_B:
                    acc2 = tl.dot_scaled(x, _ue8m0(sx), "e4m3", y2, None, "bf16", acc=acc2)
        else:
            # Promoted: this scale block's partial product, promoted below. Unscaled: the
            # accumulator itself, so the loop is the plain ``acc = dot(a, b, acc)``.
            if SCALE_K > 0:
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if TWO_B:
                    part2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            else:
                part = acc
                if TWO_B:
                    part2 = acc2
            for dk in tl.static_range(0, STEP, BLOCK_K):
                k = k0 + dk
                k_ok = (k + ks < K) | (K % STEP == 0)
                b_mask = col_ok[None, :] & k_ok[:, None]
                x = tl.load(a_ptrs + k, mask=k_ok[None, :], other=0.0)
                if QUANTIZE_A > 0:
                    x = round_rows(x.to(tl.float32), QUANTIZE_A).to(x.dtype)
                b_at = k * B_K_STRIDE
                if B_K_SPLIT > 0:
                    b_at += tl.where(k < B_K_SPLIT, 0, b2_gap)
                y = tl.load(b_ptrs + b_at, mask=b_mask, other=0.0)
                if TWO_B:
                    y2 = tl.load(b2_ptrs + k * B_K_STRIDE, mask=b_mask, other=0.0)
                part = _dot(x, y, part, UPCAST_DOT)
                if TWO_B:
                    part2 = _dot(x, y2, part2, UPCAST_DOT)
            if SCALE_K > 0:
                kb = k0 // SCALE_K
                sa = tl.load(sa_ptrs + kb)
                if UNIFORM_B_SCALE:
                    acc += part * (sa * tl.load(sb_ptrs + kb))[:, None]
                    if TWO_B:
                        acc2 += part2 * (sa * tl.load(sb2_ptrs + kb))[:, None]
                else:
                    acc += part * sa[:, None] * tl.load(sb_ptrs + kb, mask=col_ok, other=0.0)[None, :]
                    if TWO_B:
                        acc2 += part2 * sa[:, None] * tl.load(sb2_ptrs + kb, mask=col_ok, other=0.0)[None, :]
            else:
                acc = part
                if TWO_B:
                    acc2 = part2

    if TWO_B:
        return acc, acc2
    else:
        return acc

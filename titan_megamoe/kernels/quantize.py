"""Rows to e4m3 with one fp32 scale per row per ``SCALE_K`` columns: how kernels produce a
quantized GEMM operand (activation rows, incoming gradients, the SwiGLU output), exactly as
``reference.quantize_blocks(t, (1, SCALE_K), power_of_two)`` specifies it.

``quantize_tile`` is the helper kernels call on a tile of fp32 values they hold;
``quantize_rows`` runs it over a whole tensor. Expert weights are quantized in their
format's weight blocks as the forward reads them (``quantize_weights``; transposed, as the
backward reads them: ``transpose.quantize_transposed``); in 1 x K blocks (MX) they can
also be handed over dequantized, in bf16 (``dequantize``): the same values, for a
mainloop that scales only its A operand or for MX held in bf16.
"""

import torch
import triton
import triton.language as tl

from titan_megamoe.kernels.configs import INTERPRET
from titan_megamoe.kernels.launch import cdiv, launch
from titan_megamoe.precision import AMAX_FLOOR, E4M3_MAX, Format

_E4M3_MAX = tl.constexpr(E4M3_MAX)
_INV_E4M3_MAX = tl.constexpr(1.0 / E4M3_MAX)  # a Python float: an fp64 constant next to fp64 operands
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_INTERPRET = tl.constexpr(INTERPRET)

ROWS_PER_PROGRAM, COLS_PER_PROGRAM = (64 if INTERPRET else 16), 512
"""Tile of one ``quantize_rows_kernel`` program: a multiple of every scale width (32, 128).
Taller under the interpreter, which runs each program's operations once over the tile."""


@triton.jit
def _exponent(v):
    """Unbiased binary exponent of fp32 ``v >= 0`` (-127 for zero and subnormals)."""
    return ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _round_to_e4m3(v):
    """``v`` (``|v| <= 448``, or one rounding above) rounded to the nearest e4m3 value, ties
    to even, still in fp32, so that the conversion to e4m3 after it is exact (the Triton
    interpreter's fp32 -> fp8 conversion drops the carry of its rounding into the exponent;
    GPUs convert right)."""
    # e4m3 spacing in binade 2^e is 2^(e - 3); below 2^-6 (subnormals) it stays 2^-9.
    e = tl.maximum(_exponent(tl.abs(v)), -6)
    # |v| + 1.5 * 2^(e + 20) lies in a binade whose fp32 ulp is that spacing: the addition
    # rounds |v| to a multiple of it (ties to even), the subtraction is exact.
    magic = (((e + 20 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(v) + magic) - magic
    # v's sign bit, -0.0's included (Triton's negation is 0 - x, which loses it).
    sign = v.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(v):
    """fp32 ``v`` (``|v| <= 448``, or one rounding above) to e4m3, rounded to nearest, ties
    to even. On a GPU the conversion instruction rounds so; the interpreter's conversion
    needs the values rounded first (``_round_to_e4m3``), which on a GPU would only add
    instructions to the quantizers (docs/perf-history.md v16)."""
    if _INTERPRET:
        v = _round_to_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _over_e4m3_max(v):
    """``v / 448`` correctly rounded to fp32, for fp32 ``v >= 2^-117``, without a division
    (a correctly rounded one calls a slow path, whose call spills registers): the fp64
    product ``v * (1 / 448)`` is within 2^-52 of the quotient, which (a 24-bit significand
    over 7) never lies within 2^-27 of a point where fp32 rounding changes. Checked for
    every such fp32 ``v``."""
    return (v.to(tl.float64) * _INV_E4M3_MAX).to(tl.float32)


@triton.jit
def _e4m3_max_over(v):
    """``448 / v`` correctly rounded to fp32, for fp32 ``v`` in ``[2^-117, 2^128)``, without
    a division: the reciprocal of ``v``'s significand (an approximate fp32 division,
    within 2^-21) refined twice by Newton's method in fp64 is within 2^-51 of the quotient,
    which (448 over a 24-bit significand) never lies within 2^-49 of a point where fp32
    rounding changes. Checked for every significand, with the seed 2 ulp off."""
    e = _exponent(v)
    significand = ((v.to(tl.int32, bitcast=True) & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    s = significand.to(tl.float64)
    r = (1.0 / significand).to(tl.float64)
    r = r + r * (1.0 - s * r)
    r = r + r * (1.0 - s * r)
    two_to_minus_e = ((1023 - e).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    return (r * (two_to_minus_e * _E4M3_MAX)).to(tl.float32)


@triton.jit
def e4m3_scale(amax, POWER_OF_TWO: tl.constexpr):
    """``(scale, multiplier)`` of a block whose largest magnitude is ``amax`` (fp32, any
    shape): the scale ``amax / 448`` (``amax`` floored at ``AMAX_FLOOR``), or with
    ``POWER_OF_TWO`` the power of two rounded up from it (UE8M0, RCEIL); 1 for an all-zero
    block. The block's values are quantized as ``value * multiplier``: ``448 / amax``, the
    exact reciprocal of a power-of-two scale. Everything here is exact (correctly rounded
    where it rounds), as the reference computes it."""
    if POWER_OF_TWO:
        # ceil(log2(amax / 448)) from amax's bits: amax = m * 2^E with m in [1, 2) and
        # 448 = 1.75 * 2^8, so it is E - 8, plus one when m > 1.75. Subnormal amax (E = -127)
        # and amax / 448 <= 2^-127 get UE8M0's smallest scale, 2^-127; amax < 2^128 keeps
        # e <= 120, so 2^-e is a normal number.
        bits = amax.to(tl.int32, bitcast=True)
        e = tl.maximum(_exponent(amax) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32), -127)
        # 2^e; 2^-127 itself is subnormal: mantissa bit 22 alone.
        scale = tl.where(e > -127, (e + 127) << 23, 0x400000).to(tl.float32, bitcast=True)
        multiplier = ((127 - e) << 23).to(tl.float32, bitcast=True)
    else:
        floored = tl.maximum(amax, _AMAX_FLOOR)
        scale = _over_e4m3_max(floored)
        multiplier = _e4m3_max_over(floored)
    return tl.where(amax > 0, scale, 1.0), tl.where(amax > 0, multiplier, 1.0)


@triton.jit
def quantize_tile(values, SCALE_K: tl.constexpr, POWER_OF_TWO: tl.constexpr):
    """``values [BLOCK_ROWS, BLOCK_COLS]`` (fp32) -> ``(q, scales)``: ``q`` the e4m3 tile,
    ``scales [BLOCK_ROWS, BLOCK_COLS // SCALE_K]`` fp32, ``values ~= q * scale`` per row per
    SCALE_K columns (``e4m3_scale``). Columns past the end of the rows must hold 0 (a
    partial last block then quantizes as the reference's padded one)."""
    BLOCK_ROWS: tl.constexpr = values.shape[0]
    BLOCK_COLS: tl.constexpr = values.shape[1]
    tl.static_assert(BLOCK_COLS % SCALE_K == 0, "SCALE_K must divide the tile's columns")
    blocks = tl.reshape(values, (BLOCK_ROWS, BLOCK_COLS // SCALE_K, SCALE_K))
    scale, multiplier = e4m3_scale(tl.max(tl.abs(blocks), axis=2), POWER_OF_TWO)
    q = _to_e4m3(blocks * multiplier[:, :, None])
    return tl.reshape(q, (BLOCK_ROWS, BLOCK_COLS)), scale


@triton.jit
def round_rows(values, SCALE_K: tl.constexpr):
    """``values [ROWS, COLS]`` (fp32) quantized in power-of-two blocks of ``SCALE_K``
    columns per row (``quantize_tile``) and dequantized again, in fp32: the values of an
    MX operand held in bf16 (``Format.in_bf16``), exact in bf16 from 2^-126 up."""
    ROWS: tl.constexpr = values.shape[0]
    COLS: tl.constexpr = values.shape[1]
    q, scales = quantize_tile(values, SCALE_K=SCALE_K, POWER_OF_TWO=True)
    blocks = tl.reshape(q.to(tl.float32), (ROWS, COLS // SCALE_K, SCALE_K)) * scales[:, :, None]
    return tl.reshape(blocks, (ROWS, COLS))


@triton.jit
def quantize_columns(values, POWER_OF_TWO: tl.constexpr):
    """``values [ROWS, COLS]`` (fp32) -> ``(q, scales)``: ``q`` the e4m3 tile, ``scales
    [COLS]`` fp32, each column quantized as one block (``e4m3_scale``): the operands of a
    GEMM contracting along the rows."""
    scale, multiplier = e4m3_scale(tl.max(tl.abs(values), axis=0), POWER_OF_TWO)
    return _to_e4m3(values * multiplier[None, :]), scale


@triton.jit
def mx_round_columns(values):
    """``values [ROWS, COLS]`` (fp32) with each column quantized as one MX block
    (``quantize_columns``) and dequantized again, in fp32: the values a GEMM contracting
    along the rows reads, exact in bf16 from 2^-126 up."""
    q, scale = quantize_columns(values, True)
    return q.to(tl.float32) * scale[None, :]


@triton.jit
def _gate_open(gate, GATED: tl.constexpr):
    """Whether a gated kernel runs: always, or where its gate word (device memory) is not 0."""
    if GATED:
        return tl.load(gate) != 0
    else:
        return True


@triton.jit
def quantize_rows_kernel(
    x, q, scales, num_rows, gate,
    COLS: tl.constexpr, SCALE_K: tl.constexpr, POWER_OF_TWO: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, DEQUANTIZE: tl.constexpr, GATED: tl.constexpr,
):
    """``x [num_rows, COLS]`` -> ``q`` (e4m3, same shape), ``scales [num_rows, cdiv(COLS, SCALE_K)]``;
    with ``DEQUANTIZE``, ``q`` (bf16) gets ``e4m3 value * scale`` and ``scales`` is unused.
    ``GATED``: nothing is written where the word ``gate`` points to is 0."""
    if _gate_open(gate, GATED):
        _quantize_rows_tile(x, q, scales, num_rows, COLS=COLS, SCALE_K=SCALE_K, POWER_OF_TWO=POWER_OF_TWO,
                            BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, DEQUANTIZE=DEQUANTIZE)


@triton.jit
def _quantize_rows_tile(
    x, q, scales, num_rows,
    COLS: tl.constexpr, SCALE_K: tl.constexpr, POWER_OF_TWO: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, DEQUANTIZE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    live = rows < num_rows
    mask = live[:, None] & (cols[None, :] < COLS)
    at = rows[:, None].to(tl.int64) * COLS + cols[None, :]
    values = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
    if DEQUANTIZE:
        tl.store(q + at, round_rows(values, SCALE_K).to(q.dtype.element_ty), mask=mask)
    else:
        tile_q, tile_scales = quantize_tile(values, SCALE_K=SCALE_K, POWER_OF_TWO=POWER_OF_TWO)
        tl.store(q + at, tile_q, mask=mask)
        K_BLOCKS: tl.constexpr = tl.cdiv(COLS, SCALE_K)
        kb = tl.program_id(1) * (BLOCK_COLS // SCALE_K) + tl.arange(0, BLOCK_COLS // SCALE_K)
        tl.store(
            scales + rows[:, None].to(tl.int64) * K_BLOCKS + kb[None, :],
            tile_scales,
            mask=live[:, None] & (kb[None, :] < K_BLOCKS),
        )


def quantize_rows(t: torch.Tensor, scale_k: int, power_of_two: bool, dequantize: bool = False,
                  gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``t [rows, cols]`` (any float dtype) -> ``(q [rows, cols] float8_e4m3fn,
    scales [rows, cdiv(cols, scale_k)] fp32)``, bit for bit
    ``reference.quantize_blocks(t, (1, scale_k), power_of_two)``. ``dequantize`` (power-of-two
    scales only): ``(q * scales in bf16, None)``, which is exact. ``gate`` (a device word):
    the kernel writes nothing where it holds 0 (the outputs are then undefined)."""
    if dequantize and not power_of_two:
        raise ValueError("dequantize = True keeps values exact only with power-of-two scales")
    if t.dim() != 2:
        raise ValueError(f"quantize_rows takes a 2-D tensor; got shape {tuple(t.shape)}")
    if scale_k <= 0 or COLS_PER_PROGRAM % scale_k:
        raise ValueError(f"scale_k = {scale_k} must be a power of two up to {COLS_PER_PROGRAM}")
    t = t.contiguous()
    rows, cols = t.shape
    q = torch.empty(rows, cols, dtype=torch.bfloat16 if dequantize else torch.float8_e4m3fn, device=t.device)
    scales = None if dequantize else torch.empty(rows, cdiv(cols, scale_k), dtype=torch.float32,
                                                 device=t.device)
    grid = (cdiv(rows, ROWS_PER_PROGRAM), cdiv(cols, COLS_PER_PROGRAM))
    launch(quantize_rows_kernel, grid,
        t, q, scales, rows, gate,
        COLS=cols, SCALE_K=scale_k, POWER_OF_TWO=power_of_two,
        BLOCK_ROWS=ROWS_PER_PROGRAM, BLOCK_COLS=COLS_PER_PROGRAM, DEQUANTIZE=dequantize, GATED=gate is not None,
        num_warps=4,
    )
    return q, scales



@triton.jit
def quantize_weight_blocks_kernel(
    w, q, scales, col0, gate, N: tl.constexpr, K: tl.constexpr, OUT_COLS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, POWER_OF_TWO: tl.constexpr, TRANSPOSE: tl.constexpr,
    GATED: tl.constexpr,
):
    """One ``BLOCK_N x BLOCK_K`` block of expert ``program_id(0)``'s ``w [N, K]`` per
    program, quantized with one scale (``e4m3_scale`` of its largest magnitude). Straight:
    into ``q [E, N, K]`` and ``scales [E, cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)]``. With
    ``TRANSPOSE``: ``q [E, K, OUT_COLS]`` gets ``w[e].T`` at columns ``col0 + n`` and
    ``scales [E, cdiv(K, BLOCK_K), cdiv(OUT_COLS, BLOCK_N)]`` likewise (the block is the
    transposed tensor's ``BLOCK_K x BLOCK_N`` block). ``GATED``: as ``quantize_rows_kernel``."""
    if _gate_open(gate, GATED):
        _quantize_weight_block(w, q, scales, col0, N=N, K=K, OUT_COLS=OUT_COLS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                               POWER_OF_TWO=POWER_OF_TWO, TRANSPOSE=TRANSPOSE)


@triton.jit
def _quantize_weight_block(
    w, q, scales, col0, N: tl.constexpr, K: tl.constexpr, OUT_COLS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, POWER_OF_TWO: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    nb, kb = tl.program_id(1), tl.program_id(2)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    values = tl.load(w + e * N * K + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale, multiplier = e4m3_scale(tl.max(tl.max(tl.abs(values), axis=1), axis=0), POWER_OF_TWO)
    block_q = _to_e4m3(values * multiplier)
    if TRANSPOSE:
        at = e * K * OUT_COLS + cols[:, None] * OUT_COLS + col0 + rows[None, :]
        tl.store(q + at, tl.trans(block_q), mask=tl.trans(mask))
        tl.store(scales + (e * tl.cdiv(K, BLOCK_K) + kb) * tl.cdiv(OUT_COLS, BLOCK_N) + col0 // BLOCK_N + nb, scale)
    else:
        tl.store(q + e * N * K + rows[:, None] * K + cols[None, :], block_q, mask=mask)
        tl.store(scales + (e * tl.cdiv(N, BLOCK_N) + nb) * tl.cdiv(K, BLOCK_K) + kb, scale)


def quantize_weights(weights: list[torch.Tensor], fmt: Format, dequantize: bool = False,
                     gate: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Expert weights ``[E, N, K]`` as ``(e4m3 values, scales [E, cdiv(N, bn), cdiv(K, bk)])``
    with ``(bn, bk)`` the format's weight block, bit for bit
    ``reference.quantize_blocks(w, (bn, bk), power_of_two)``; ``dequantize`` (1 x K
    power-of-two blocks): ``(values in bf16, None)`` (``quantize_rows``). On every call:
    the weights may have changed since the last one. ``gate``: as ``quantize_rows``'s."""
    bn, bk = fmt.weight_block
    if dequantize and bn != 1:
        raise ValueError(f"dequantized weights need 1 x K blocks; {fmt.name} has {bn} x {bk}")
    quantized = []
    for w in weights:
        w = w.contiguous()
        experts, n, k = w.shape
        if bn == 1:  # blocks along K only: rows of the flattened weight
            q, scales = quantize_rows(w.view(experts * n, k), bk, fmt.power_of_two, dequantize, gate)
            quantized.append((q.view(experts, n, k), None if dequantize else scales.view(experts, n, -1)))
            continue
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
        scales = torch.empty(experts, cdiv(n, bn), cdiv(k, bk), dtype=torch.float32, device=w.device)
        launch(quantize_weight_blocks_kernel, scales.shape,
            w, q, scales, 0, gate, N=n, K=k, OUT_COLS=k, BLOCK_N=bn, BLOCK_K=bk, POWER_OF_TWO=fmt.power_of_two,
            TRANSPOSE=False, GATED=gate is not None, num_warps=8,
        )
        quantized.append((q, scales))
    return quantized

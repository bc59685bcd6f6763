"""Quantized weight gradients: ``out[e] = A_e^T B_e`` over each local expert's received
rows, with both operands quantized along the rows (the contraction dimension), as the
reference specifies them (``reference``, numerics).

The rows of expert ``e`` are ``local_base[e] .. local_base[e] + local_rows[e]`` of the
receive-side buffers. Each program owns one ``BLOCK_M x BLOCK_N`` tile of one expert's
gradient and walks that expert's rows in blocks of ``TOKEN_BLOCK`` (counted from the
expert's first row, as the spec counts them): it reads the block of both operands as
fp32 (e4m3 rows times their own scales, or rows of the activation dtype), quantizes
each column of the block with one scale (``quantize_tile`` on the transposed block),
multiplies, and promotes the product with the two scale vectors into the fp32
accumulator.

First build: every program requantizes the blocks it reads (each A block once per N
tile), and the products run in bf16 on the e4m3 values (exact, at bf16 rate): an fp8
MMA needs token-major copies of the operands.
"""

import triton
import triton.language as tl

from titan_megamoe.kernels.quantize import quantize_tile


@triton.jit
def _rows_as_fp32(t, t_scales, rows, col0, live, STRIDE: tl.constexpr, COLS: tl.constexpr,
                  BLOCK: tl.constexpr, SCALE_K: tl.constexpr):
    """Columns ``[col0, col0 + BLOCK)`` of ``t[rows]`` in fp32 (``t`` has rows of ``STRIDE``
    elements, the first ``COLS`` of which are read); e4m3 times its scales (one per
    ``SCALE_K`` columns, rows of ``cdiv(COLS, SCALE_K)``) when ``SCALE_K`` > 0. Rows not
    ``live`` and columns past ``COLS`` read as 0."""
    cols = col0 + tl.arange(0, BLOCK)
    mask = live[:, None] & (cols[None, :] < COLS)
    v = tl.load(t + rows[:, None].to(tl.int64) * STRIDE + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if SCALE_K > 0:
        # One scale per row: loaded as a vector, not gathered per element (a [rows,
        # BLOCK] fp32 gather would take four times the operand's shared memory).
        tl.static_assert(SCALE_K % BLOCK == 0, "a weight-gradient tile must lie in one scale block")
        SCALE_COLS: tl.constexpr = tl.cdiv(COLS, SCALE_K)
        v = v * tl.load(t_scales + rows.to(tl.int64) * SCALE_COLS + col0 // SCALE_K, mask=live, other=0.0)[:, None]
    return v


@triton.jit
def wgrad_kernel(
    a, a_scales, b, b_scales, out, local_base, local_rows,
    M: tl.constexpr, N: tl.constexpr, A_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr,
    A_SCALE_K: tl.constexpr, B_SCALE_K: tl.constexpr, TOKEN_BLOCK: tl.constexpr,
    POWER_OF_TWO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """``out [experts, M, N]`` (its own dtype) ``= A_e^T B_e``, ``A`` the first ``M``
    columns of rows of ``A_STRIDE``, ``B`` the first ``N`` of rows of ``B_STRIDE``."""
    expert = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    n0 = tl.program_id(2) * BLOCK_N
    base = tl.load(local_base + expert)
    count = tl.load(local_rows + expert)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t0 in range(0, count, TOKEN_BLOCK):
        offsets = t0 + tl.arange(0, TOKEN_BLOCK)
        rows = base + offsets
        live = offsets < count
        av = _rows_as_fp32(a, a_scales, rows, m0, live, A_STRIDE, M, BLOCK_M, A_SCALE_K)
        bv = _rows_as_fp32(b, b_scales, rows, n0, live, B_STRIDE, N, BLOCK_N, B_SCALE_K)
        qa, sa = quantize_tile(tl.trans(av), TOKEN_BLOCK, POWER_OF_TWO)  # [BLOCK_M, TOKEN_BLOCK]
        qb, sb = quantize_tile(tl.trans(bv), TOKEN_BLOCK, POWER_OF_TWO)  # [BLOCK_N, TOKEN_BLOCK]
        if UPCAST_DOT:
            part = tl.dot(qa.to(tl.float32), tl.trans(qb.to(tl.float32)))
        else:
            part = tl.dot(qa.to(tl.bfloat16), tl.trans(qb.to(tl.bfloat16)))
        acc += part * sa * tl.trans(sb)
    m_cols = m0 + tl.arange(0, BLOCK_M)
    n_cols = n0 + tl.arange(0, BLOCK_N)
    mask = (m_cols[:, None] < M) & (n_cols[None, :] < N)
    at = out + expert.to(tl.int64) * M * N + m_cols[:, None] * N + n_cols[None, :]
    tl.store(at, acc.to(out.dtype.element_ty), mask=mask)

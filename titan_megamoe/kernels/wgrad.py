"""Quantized weight gradients: ``out[e] = A_e^T B_e`` over each local expert's received
rows, with both operands quantized along the rows (the contraction dimension), as the
reference specifies them (``reference``, numerics): one scale per column per
``TOKEN_BLOCK`` rows, the blocks counted from the expert's first row.

Hopper's fp8 MMA takes K-major operands only, and here K runs along the rows. So each
operand is first copied token-major (``token_major_kernel``): ``[columns, KT]`` e4m3 plus
``[columns, KT / TOKEN_BLOCK]`` fp32 scales, where expert ``e``'s rows occupy the token
blocks ``block_start[e] .. block_start[e + 1]`` (its rows, zero-padded to whole blocks, and
to whole K steps of ``wgrad_kernel`` where a step spans several blocks). ``wgrad_kernel``
then runs the shared mainloop (``tile_gemm``) over that token range, one scale per A row
and per B column per block, applied as the forward applies them (promoted, or in the MMA).

``accumulate_wgrad`` adds a later round's rows (``backward``: a routing that overflows one
receive window) to gradients round 0 computed: ``out[e] += A_e^T B_e`` over the rows of the
round's receive layout, from the values as they crossed (e4m3 times its scales, or as they
are), in fp32; the rows are not quantized along the tokens again. Its programs exit at
once where their expert has no rows in the round.

Native weight gradients that read the rows as they crossed quantized (``fp8_wgrad_bf16``)
take torch's grouped GEMM on copies of them dequantized into the activation dtype
(``dequantized_rows_kernel``). So do MX weight gradients where the tile row says so
(``mx_wgrad_dequantized``: GPUs without an MX MMA): the copies are also quantized along
the tokens and dequantized again, the values the scaled GEMM would multiply, which bf16
holds exactly (power-of-two scales).
"""

import torch
import triton
import triton.language as tl

from titan_megamoe.kernels.configs import INTERPRET
from titan_megamoe.kernels.launch import cdiv, launch
from titan_megamoe.kernels.layout import expert_of_row
from titan_megamoe.kernels.mainloop import tile_gemm
from titan_megamoe.kernels.quantize import mx_round_columns, quantize_columns


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
        SCALE_COLS: tl.constexpr = tl.cdiv(COLS, SCALE_K)
        if SCALE_K % BLOCK == 0:
            # One scale per row: loaded as a vector, not gathered per element.
            v = v * tl.load(t_scales + rows.to(tl.int64) * SCALE_COLS + col0 // SCALE_K, mask=live, other=0.0)[:, None]
        else:
            tl.static_assert(BLOCK % SCALE_K == 0, "a column block must lie in one scale block or hold whole ones")
            BLOCKS: tl.constexpr = BLOCK // SCALE_K
            kb = col0 // SCALE_K + tl.arange(0, BLOCKS)
            s_mask = live[:, None] & (kb[None, :] < SCALE_COLS)
            s = tl.load(t_scales + rows[:, None].to(tl.int64) * SCALE_COLS + kb[None, :], mask=s_mask, other=0.0)
            v = tl.reshape(tl.reshape(v, (v.shape[0], BLOCKS, SCALE_K)) * s[:, :, None], (v.shape[0], BLOCK))
    return v


@triton.jit
def dequantized_rows_kernel(
    t, t_scales, out, num_rows, local_base, local_rows, local_experts,
    COLS: tl.constexpr, SCALE_K: tl.constexpr, LOCAL_PAD: tl.constexpr, ROW_ALIGN: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, MX_TOKEN_BLOCK: tl.constexpr,
):
    """Received rows ``t [num_rows, COLS]`` (e4m3 times their scales, one per ``SCALE_K``
    columns, or as they are with ``SCALE_K`` 0) into ``out`` (same shape, its dtype).
    ``MX_TOKEN_BLOCK`` > 0 (it must equal ``BLOCK_R``): each column of each token block
    (its expert's rows counted from the expert's first) is also quantized along the
    tokens as one MX block and dequantized again, the operands of MX weight gradients in
    values a bf16 grouped GEMM multiplies exactly. An expert's padding rows (up to its
    next multiple of ``ROW_ALIGN``) are written as 0: a grouped GEMM over whole alignments
    then reads zeros there, whatever the buffers held. Rows past the last expert's are
    never read and left as they are (the buffer holds every routing's rows; a call fills
    a fraction). Program ``(r, c)``: ``BLOCK_R`` rows (dividing ``ROW_ALIGN``, so they
    belong to one expert) by ``BLOCK_C`` columns."""
    row0 = tl.program_id(0) * BLOCK_R
    col0 = tl.program_id(1) * BLOCK_C
    expert = expert_of_row(local_base, local_experts, row0, LOCAL_PAD)
    base, count = tl.load(local_base + expert), tl.load(local_rows + expert)
    if row0 < base + tl.cdiv(count, ROW_ALIGN) * ROW_ALIGN:
        rows = row0 + tl.arange(0, BLOCK_R)
        live = rows < tl.minimum(base + count, num_rows)
        v = _rows_as_fp32(t, t_scales, rows, col0, live, STRIDE=COLS, COLS=COLS, BLOCK=BLOCK_C, SCALE_K=SCALE_K)
        if MX_TOKEN_BLOCK > 0:
            tl.static_assert(MX_TOKEN_BLOCK == BLOCK_R, "a program rounds one token block")
            v = mx_round_columns(v)
        cols = col0 + tl.arange(0, BLOCK_C)
        at = out + rows[:, None].to(tl.int64) * COLS + cols[None, :]
        tl.store(at, v.to(out.dtype.element_ty), mask=(rows[:, None] < num_rows) & (cols[None, :] < COLS))


@triton.jit
def token_major_kernel(
    t, t_scales, out, out_scales, local_base, local_rows, block_start, local_experts,
    STRIDE: tl.constexpr, COLS: tl.constexpr, SCALE_K: tl.constexpr, KT: tl.constexpr,
    TOKEN_BLOCK: tl.constexpr, POWER_OF_TWO: tl.constexpr, BLOCK_C: tl.constexpr, LOCAL_PAD: tl.constexpr,
    SCALES_BLOCK_MAJOR: tl.constexpr,
):
    """One token block x ``BLOCK_C`` columns of ``t`` (rows of ``STRIDE``, the first
    ``COLS`` read; e4m3 with scales when ``SCALE_K`` > 0) into ``out [COLS, KT]`` e4m3 and
    ``out_scales [COLS, KT / TOKEN_BLOCK]`` (``SCALES_BLOCK_MAJOR``: ``[KT / TOKEN_BLOCK,
    COLS]``), each column of the block quantized with one scale. Program ``b * cdiv(COLS,
    BLOCK_C) + c``: column block ``c`` of token block ``b`` of the packed layout (programs
    running together read neighbouring columns of the same rows); blocks past the last
    expert's are never read and left as they are."""
    COL_BLOCKS: tl.constexpr = tl.cdiv(COLS, BLOCK_C)
    block = tl.program_id(0) // COL_BLOCKS
    col0 = tl.program_id(0) % COL_BLOCKS * BLOCK_C
    experts = tl.arange(0, LOCAL_PAD)
    ends = tl.load(block_start + 1 + experts, mask=experts < local_experts, other=2**30)
    expert = tl.sum((ends <= block).to(tl.int32))
    if expert < local_experts:
        first = tl.load(block_start + expert)
        offsets = (block - first) * TOKEN_BLOCK + tl.arange(0, TOKEN_BLOCK)
        live = offsets < tl.load(local_rows + expert)
        rows = tl.load(local_base + expert) + offsets
        v = _rows_as_fp32(t, t_scales, rows, col0, live, STRIDE=STRIDE, COLS=COLS, BLOCK=BLOCK_C, SCALE_K=SCALE_K)
        # Quantized as loaded, transposed by the store: one byte per element crosses
        # the threads, not four (docs/perf-history.md v36).
        q, scale = quantize_columns(v, POWER_OF_TWO)  # [TOKEN_BLOCK, BLOCK_C], [BLOCK_C]
        cols = col0 + tl.arange(0, BLOCK_C)
        col_ok = cols < COLS
        tokens = block * TOKEN_BLOCK + tl.arange(0, TOKEN_BLOCK)
        tl.store(out + cols[None, :].to(tl.int64) * KT + tokens[:, None], q, mask=col_ok[None, :])
        if SCALES_BLOCK_MAJOR:
            tl.store(out_scales + block.to(tl.int64) * COLS + cols, scale, mask=col_ok)
        else:
            tl.store(out_scales + cols.to(tl.int64) * (KT // TOKEN_BLOCK) + block, scale, mask=col_ok)


@triton.jit
def _tile_of_output(out, out2, expert, m0, n0, M: tl.constexpr, N: tl.constexpr, SPLIT_M: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(pointers, mask)`` of the ``BLOCK_M x BLOCK_N`` tile ``(m0, n0)`` of expert ``expert``'s
    ``[M, N]`` weight gradient: in ``out``, or, ``SPLIT_M`` > 0, rows below it in ``out
    [experts, SPLIT_M, N]`` and the rest in ``out2 [experts, M - SPLIT_M, N]``."""
    if SPLIT_M > 0:
        tl.static_assert(SPLIT_M % BLOCK_M == 0, "a tile must lie in one output")
        if m0 < SPLIT_M:
            target, rows_out, row0 = out, SPLIT_M, 0
        else:
            target, rows_out, row0 = out2, M - SPLIT_M, SPLIT_M
    else:
        target, rows_out, row0 = out, M, 0
    rows = m0 + tl.arange(0, BLOCK_M) - row0
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < rows_out) & (cols[None, :] < N)
    return target + expert.to(tl.int64) * rows_out * N + rows[:, None] * N + cols[None, :], mask


@triton.jit
def wgrad_kernel(
    a, a_scales, b, b_scales, out, out2, block_start,
    M: tl.constexpr, N: tl.constexpr, SPLIT_M: tl.constexpr, KT: tl.constexpr, TOKEN_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MX_DOT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """``[experts, M, N]`` (the outputs' dtype) ``= A_e^T B_e`` from the token-major copies
    ``a [M, KT]``, ``b [N, KT]`` and their scales. ``SPLIT_M`` 0: all into ``out``;
    otherwise rows below ``SPLIT_M`` into ``out [experts, SPLIT_M, N]`` and the rest into
    ``out2 [experts, M - SPLIT_M, N]`` (``BLOCK_M`` must divide ``SPLIT_M``). Program
    ``(n, m, e)``: the ``BLOCK_M x BLOCK_N`` tile ``(m, n)`` of expert ``e``."""
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    expert = tl.program_id(2)
    k_start = tl.load(block_start + expert) * TOKEN_BLOCK
    k_end = tl.load(block_start + expert + 1) * TOKEN_BLOCK
    m_rows = m0 + tl.arange(0, BLOCK_M)
    acc = tile_gemm(
        a, a_scales, tl.minimum(m_rows, M - 1), b, b_scales, b2=None, b2_scale=None, expert=0, n0=n0, k_start=k_start,
        k_end=k_end, N=N, K=KT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, TWO_B=False, SCALE_K=TOKEN_BLOCK,
        B_SCALE_N=1, MX_DOT=MX_DOT, QUANTIZE_A=0, UPCAST_DOT=UPCAST_DOT, B_N_MAJOR=False, B_K_SPLIT=0,
    )
    at, mask = _tile_of_output(out, out2, expert, m0, n0, M=M, N=N, SPLIT_M=SPLIT_M, BLOCK_M=BLOCK_M,
                               BLOCK_N=BLOCK_N)
    tl.store(at, acc.to(at.dtype.element_ty), mask=mask)


@triton.jit
def accumulate_wgrad_kernel(
    a, a_scales, b, b_scales, out, out2, local_base, local_rows,
    M: tl.constexpr, N: tl.constexpr, SPLIT_M: tl.constexpr, A_SCALE_K: tl.constexpr, B_SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``out[e] += A_e^T B_e`` over local expert ``e``'s rows of the receive layout: ``a [rows,
    M]``, ``b [rows, N]`` (e4m3 with one scale per ``*_SCALE_K`` columns, or as they are),
    fp32 products added to the outputs' values. ``SPLIT_M`` as ``wgrad_kernel``'s. Program
    ``(n, m, e)``: the ``BLOCK_M x BLOCK_N`` tile ``(m, n)`` of expert ``e``; it returns at once
    where the expert has no rows."""
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    expert = tl.program_id(2)
    count = tl.load(local_rows + expert)
    if count > 0:
        base = tl.load(local_base + expert)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, count, BLOCK_K):
            offsets = k0 + tl.arange(0, BLOCK_K)
            live = offsets < count
            rows = base + offsets
            at = _rows_as_fp32(a, a_scales, rows, m0, live, STRIDE=M, COLS=M, BLOCK=BLOCK_M, SCALE_K=A_SCALE_K)
            bt = _rows_as_fp32(b, b_scales, rows, n0, live, STRIDE=N, COLS=N, BLOCK=BLOCK_N, SCALE_K=B_SCALE_K)
            acc += tl.dot(tl.trans(at), bt)
        at, mask = _tile_of_output(out, out2, expert, m0, n0, M=M, N=N, SPLIT_M=SPLIT_M, BLOCK_M=BLOCK_M,
                                   BLOCK_N=BLOCK_N)
        total = tl.load(at, mask=mask, other=0.0).to(tl.float32) + acc
        tl.store(at, total.to(at.dtype.element_ty), mask=mask)


ACCUMULATE_TILE = (16, 16, 16) if INTERPRET else (64, 64, 32)
"""``(BLOCK_M, BLOCK_N, BLOCK_K)`` of ``accumulate_wgrad_kernel``: rows past a first window are
rare, and these tiles keep its fp32 operands in registers."""


def accumulate_wgrad(buffers, a: tuple, b: tuple, outs: tuple[torch.Tensor, ...]) -> None:
    """``out[e] += A_e^T B_e`` over the rows of ``buffers``' current receive layout
    (``accumulate_wgrad_kernel``). ``a``, ``b``: ``(rows, scales or None, columns per
    scale)``; ``outs``: one ``[experts, M, N]``, or two splitting ``M`` in halves."""
    (a_rows, a_scales, a_scale_k), (b_rows, b_scales, b_scale_k) = a, b
    m_dim, n_dim = a_rows.shape[1], b_rows.shape[1]
    block_m, block_n, block_k = ACCUMULATE_TILE
    grid = (cdiv(n_dim, block_n), cdiv(m_dim, block_m), buffers.shape.local_experts)
    launch(accumulate_wgrad_kernel, grid,
        a_rows, a_scales, b_rows, b_scales, outs[0], outs[-1], buffers.local_base, buffers.local_rows,
        M=m_dim, N=n_dim, SPLIT_M=m_dim // 2 if len(outs) == 2 else 0, A_SCALE_K=a_scale_k, B_SCALE_K=b_scale_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )

"""Per-expert weight transposes for the backward's GEMMs, which read every operand
K-major (an N-major operand runs at a fraction of the speed), unquantized or quantized.

``transposed_side_by_side`` writes each ``src [E, R, C]`` as
``dst[e, :, col0 : col0 + R] = src[e].T`` into one ``dst [E, C, D]``: tiles of
``BLOCK_R x BLOCK_C`` are loaded along ``src``'s rows and stored along ``dst``'s, so both
sides move whole cache lines. ``quantize_transposed`` gives the same in a format's weight
blocks.
"""

import torch
import triton
import triton.language as tl

from titan_megamoe.kernels.launch import cdiv, launch
from titan_megamoe.kernels.quantize import quantize_weight_blocks_kernel, quantize_weights, round_rows
from titan_megamoe.precision import Format


@triton.jit
def transpose_experts_kernel(
    src, dst, col0,
    R: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROUND_K: tl.constexpr,
):
    """``ROUND_K`` > 0: each stored row of ``dst`` is quantized in MX blocks of ``ROUND_K``
    columns and dequantized again (``round_rows``), ``col0`` and ``BLOCK_R`` multiples of it."""
    e = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < R) & (c[None, :] < C)
    tile = tl.trans(tl.load(src + e * R * C + r[:, None] * C + c[None, :], mask=mask, other=0.0))
    if ROUND_K > 0:
        tile = round_rows(tile.to(tl.float32), ROUND_K)
    tl.store(dst + e * C * D + c[:, None] * D + col0 + r[None, :], tile.to(dst.dtype.element_ty), mask=tl.trans(mask))


def transposed_side_by_side(weights: list[torch.Tensor], block: int, round_k: int = 0) -> torch.Tensor:
    """``cat([w.transpose(1, 2) for w in weights], dim=2)`` for expert weights
    ``[E, N_i, K]``: ``[E, K, sum N_i]`` in their dtype, in ``block x block`` tiles. With
    ``round_k``: in bf16, each row quantized in MX blocks of ``round_k`` columns and
    dequantized again (``reference.quantize_blocks(t, (1, round_k), True)``'s values), in the
    same pass."""
    experts, _, k = weights[0].shape
    if round_k and (block % round_k or any(w.shape[1] % round_k for w in weights[:-1])):
        raise ValueError(f"MX blocks of {round_k} columns need a tile ({block}) and every weight but the "
                         f"last ({[w.shape[1] for w in weights]} rows) holding whole blocks")
    out = torch.empty(experts, k, sum(w.shape[1] for w in weights),
                      dtype=torch.bfloat16 if round_k else weights[0].dtype, device=weights[0].device)
    col0 = 0
    for w in weights:
        w = w.contiguous()
        rows, cols = w.shape[1:]
        grid = (experts, cdiv(rows, block), cdiv(cols, block))
        launch(transpose_experts_kernel, grid,
            w, out, col0, R=rows, C=cols, D=out.shape[2], BLOCK_R=block, BLOCK_C=block, ROUND_K=round_k,
            num_warps=4,
        )
        col0 += rows
    return out


def quantize_transposed(weights: list[torch.Tensor], fmt: Format, transpose_block: int,
                        dequantize: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The expert weights ``[E, N_i, K]`` transposed and side by side,
    ``t = cat([w.transpose(1, 2) for w in weights], dim=2)`` (``[E, K, sum N_i]``), quantized
    in the format's weight blocks: ``(e4m3 values, scales)``, bit for bit
    ``reference.quantize_blocks(t, fmt.weight_block, fmt.power_of_two)``. The backward's
    GEMMs read the weights K-major this way. Blocks of more than one row are quantized
    straight from ``weights`` (one read, one e4m3 write); rows of blocks (MX's 1 x 32) from
    a transposed copy (``transpose_block``: its tile), or, ``dequantize``d (power-of-two
    scales), rounded as they are transposed: ``(values in bf16, None)``."""
    bn, bk = fmt.weight_block
    weights = [w.contiguous() for w in weights]
    experts, _, k = weights[0].shape
    cols = sum(w.shape[1] for w in weights)
    if bn == 1 and dequantize:
        if not fmt.power_of_two:
            raise ValueError("dequantize = True keeps values exact only with power-of-two scales")
        return transposed_side_by_side(weights, transpose_block, round_k=bk), None
    if bn == 1:
        ((q, scales),) = quantize_weights([transposed_side_by_side(weights, transpose_block)], fmt)
        return q, scales
    if dequantize:
        raise ValueError(f"dequantized weights need 1 x K blocks; {fmt.name} has {bn} x {bk}")
    q = torch.empty(experts, k, cols, dtype=torch.float8_e4m3fn, device=weights[0].device)
    scales = torch.empty(experts, cdiv(k, bn), cdiv(cols, bk), dtype=torch.float32,
                         device=weights[0].device)
    col0 = 0
    for w in weights:
        n = w.shape[1]
        if col0 % bk or (n % bk and w is not weights[-1]):
            raise ValueError(f"weights of {n} rows at column {col0} do not fill whole {bn} x {bk} blocks")
        # The transposed tensor's (bn, bk) block is a (bk, bn) block of the weight.
        launch(quantize_weight_blocks_kernel, (experts, cdiv(n, bk), cdiv(k, bn)),
            w, q, scales, col0, None, N=n, K=k, OUT_COLS=cols, BLOCK_N=bk, BLOCK_K=bn,
            POWER_OF_TWO=fmt.power_of_two, TRANSPOSE=True, GATED=False, num_warps=8,
        )
        col0 += n
    return q, scales

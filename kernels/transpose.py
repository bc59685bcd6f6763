"""Per-expert weight transposes for the backward's GEMMs, which read every operand
K-major (an N-major operand runs at a fraction of the speed).

``transposed_side_by_side`` writes each ``src [E, R, C]`` as
``dst[e, :, col0 : col0 + R] = src[e].T`` into one ``dst [E, C, D]``: tiles of
``BLOCK_R x BLOCK_C`` are loaded along ``src``'s rows and stored along ``dst``'s, so both
sides move whole cache lines.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def transpose_experts_kernel(
    src, dst, col0,
    R: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < R) & (c[None, :] < C)
    tile = tl.load(src + e * R * C + r[:, None] * C + c[None, :], mask=mask)
    tl.store(dst + e * C * D + c[:, None] * D + col0 + r[None, :], tl.trans(tile), mask=tl.trans(mask))


def transposed_side_by_side(weights: list[torch.Tensor], block: int) -> torch.Tensor:
    """``cat([w.transpose(1, 2) for w in weights], dim=2)`` for expert weights
    ``[E, N_i, K]``: ``[E, K, sum N_i]`` in their dtype, in ``block x block`` tiles."""
    experts, _, k = weights[0].shape
    out = torch.empty(experts, k, sum(w.shape[1] for w in weights), dtype=weights[0].dtype,
                      device=weights[0].device)
    col0 = 0
    for w in weights:
        w = w.contiguous()
        rows, cols = w.shape[1:]
        grid = (experts, triton.cdiv(rows, block), triton.cdiv(cols, block))
        transpose_experts_kernel[grid](
            w, out, col0, R=rows, C=cols, D=out.shape[2], BLOCK_R=block, BLOCK_C=block, num_warps=4,
        )
        col0 += rows
    return out

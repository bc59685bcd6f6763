"""Per-expert weight transposes for the backward's GEMMs, which read every operand
K-major (an N-major operand runs at a fraction of the speed).

``src [E, R, C]`` -> ``dst[e, :, col0 : col0 + R] = src[e].T`` with ``dst [E, C, D]``:
tiles of ``BLOCK_R x BLOCK_C`` are loaded along ``src``'s rows and stored along ``dst``'s,
so both sides move whole cache lines.
"""

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


def transpose_into(src, dst, col0: int, block: int) -> None:
    """``dst[:, :, col0 : col0 + R] = src.transpose(1, 2)`` for ``src [E, R, C]``."""
    experts, rows, cols = src.shape
    grid = (experts, triton.cdiv(rows, block), triton.cdiv(cols, block))
    transpose_experts_kernel[grid](
        src, dst, col0, R=rows, C=cols, D=dst.shape[2], BLOCK_R=block, BLOCK_C=block, num_warps=4,
    )

"""The grouped GEMM's resolved decisions, as one constexpr record every partition reads."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate


@aggregate
class GemmSpec:
    """Shapes, tiles and numerics of one grouped GEMM (all compile-time)."""

    epilogue: gl.constexpr
    """What a consumer does with its finished rows (``epilogue.EPILOGUES``)."""
    combine: gl.constexpr
    """Rows go to their origins in the ranks' combine buffers (``epilogue.row_starts``)."""
    n: gl.constexpr
    k: gl.constexpr
    block_m: gl.constexpr
    block_n: gl.constexpr
    block_k: gl.constexpr
    stages: gl.constexpr
    mma_warpgroups: gl.constexpr
    """Consumer warpgroups, 64 rows of a tile each."""
    local_pad: gl.constexpr
    """A power of two >= the local experts (the schedule's search width)."""
    two_b: gl.constexpr
    """A second B shares each A tile (GEMM1's gate and up)."""
    b_k_major: gl.constexpr
    """B is ``[experts, N, K]``; else ``[experts, K, N]`` (bf16 only)."""
    scale_k: gl.constexpr
    """Blockwise fp8: elements of K per scale (128), 0 for bf16."""
    scale_n: gl.constexpr
    """Blockwise fp8: rows of B per scale (128)."""
    promote_chunk: gl.constexpr
    """Blockwise fp8: K blocks per unrolled chunk of the promoting mainloop."""
    split_b: gl.constexpr
    """With two B: each consumer warpgroup multiplies all of the tile's ``block_m`` rows by
    its own B (warpgroup 0 by B, 1 by B2), instead of its 64 rows by both."""
    tiles_per_block: gl.constexpr
    """Tiles of ``block_m`` rows per block of the receive layout (its virtual rows count
    whole blocks of ``block_m * tiles_per_block``)."""

    @gluon.constexpr_function
    def __init__(self, epilogue, combine, n, k, block_m, block_n, block_k, stages, mma_warpgroups, local_pad,
                 two_b, b_k_major, scale_k, scale_n, promote_chunk, split_b=False, tiles_per_block=1):
        self.epilogue = gl.constexpr(epilogue)
        self.combine = gl.constexpr(combine)
        self.n = gl.constexpr(n)
        self.k = gl.constexpr(k)
        self.block_m = gl.constexpr(block_m)
        self.block_n = gl.constexpr(block_n)
        self.block_k = gl.constexpr(block_k)
        self.stages = gl.constexpr(stages)
        self.mma_warpgroups = gl.constexpr(mma_warpgroups)
        self.local_pad = gl.constexpr(local_pad)
        self.two_b = gl.constexpr(two_b)
        self.b_k_major = gl.constexpr(b_k_major)
        self.scale_k = gl.constexpr(scale_k)
        self.scale_n = gl.constexpr(scale_n)
        self.promote_chunk = gl.constexpr(promote_chunk)
        self.split_b = gl.constexpr(split_b)
        self.tiles_per_block = gl.constexpr(tiles_per_block)


@aggregate
class TokenGemmSpec:
    """Shapes and tiles of a GEMM grouped along K (``schedule.TokenBlockTiles``): per expert
    ``out[e] [M, N] = sum over its token blocks of (A_k B_k^T) * a_scale[:, k] b_scale[:, k]``,
    blockwise e4m3, both operands token-major (K-major); rows below ``split_m`` (if > 0)
    into the first output, the others into the second."""

    m: gl.constexpr
    n: gl.constexpr
    split_m: gl.constexpr
    block_m: gl.constexpr
    block_n: gl.constexpr
    block_k: gl.constexpr
    """Tokens per K step: one token block, one scale per operand row."""
    stages: gl.constexpr
    mma_warpgroups: gl.constexpr
    two_b: gl.constexpr
    """False: one B (read by the stage ring, as ``GemmSpec``'s)."""
    b_k_major: gl.constexpr
    """True: B token-major, K-major (read by the stage ring)."""
    split_b: gl.constexpr
    """False (read by the stage ring, as ``GemmSpec``'s)."""

    @gluon.constexpr_function
    def __init__(self, m, n, split_m, block_m, block_n, block_k, stages, mma_warpgroups):
        self.m = gl.constexpr(m)
        self.n = gl.constexpr(n)
        self.split_m = gl.constexpr(split_m)
        self.block_m = gl.constexpr(block_m)
        self.block_n = gl.constexpr(block_n)
        self.block_k = gl.constexpr(block_k)
        self.stages = gl.constexpr(stages)
        self.mma_warpgroups = gl.constexpr(mma_warpgroups)
        self.two_b = gl.constexpr(False)
        self.b_k_major = gl.constexpr(True)
        self.split_b = gl.constexpr(False)

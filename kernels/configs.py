"""Tile sizes of the fused kernels: the one table to tune."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    """Rows per GEMM tile; also the alignment of each expert's rows in the receive
    buffer and the length of a dispatch chunk."""
    gemm1_n: int
    """Intermediate columns per GEMM1 tile (two accumulators: gate and up)."""
    gemm1_k: int
    gemm1_warps: int
    gemm1_stages: int
    gemm2_n: int
    """Hidden columns per GEMM2 tile."""
    gemm2_k: int
    gemm2_warps: int
    gemm2_stages: int
    grad1_n: int
    """Backward, first kernel: intermediate columns per tile (three accumulators: gate, up
    and ``dy W2``)."""
    grad1_saved_n: int
    """The same when GEMM1 was saved (one accumulator: ``dy W2``)."""
    grad1_k: int
    grad1_warps: int
    grad1_stages: int
    dgrad_n: int
    """Backward, second kernel: hidden columns per ``[da | db] [W1 | W3]`` tile."""
    dgrad_k: int
    dgrad_warps: int
    dgrad_stages: int
    copy_rows: int
    """Rows a dispatching program moves per step."""
    copy_cols: int
    reduce_tokens: int
    reduce_cols: int
    transpose_block: int
    """Square tile of the backward's weight transposes."""


TILE_CONFIGS = {
    # H100/H200 (measured on H200, docs/perf.md): GEMM1 128x(2x128)x64 in 4 stages,
    # GEMM2 128x256x64 in 3 stages, 8 warps each; backward 128x(3x64)x64 in 4 stages and
    # 128x256x64 (dgrad, as GEMM2) in 3, 8 warps.
    "sm90": TileConfig(128, 128, 64, 8, 4, 256, 64, 8, 3, 64, 128, 64, 8, 4, 256, 64, 8, 3, 16, 512, 16, 512, 64),
    # Tiny tiles for the Triton interpreter (CPU tests).
    "interpret": TileConfig(16, 16, 16, 4, 1, 16, 16, 4, 1, 16, 32, 16, 4, 1, 16, 16, 4, 1, 4, 16, 4, 16, 16),
}

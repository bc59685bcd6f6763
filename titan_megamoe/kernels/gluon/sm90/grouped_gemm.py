"""The grouped GEMM kernel (load, MMA and epilogue partitions composed) and its launcher.

``out[r] = epilogue(A[r] B[e]^T)`` for every row ``r`` of local expert ``e`` in a receive
layout (``schedule``): bf16 operands, or blockwise fp8 (e4m3 with 1 x 128 A scales and
128 x 128 B scales, ``SCALE_K`` 128). ``TWO_B``: a second B of the same shape shares each
A tile (GEMM1's gate and up projections, ``swiglu`` epilogue).
"""

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


from titan_megamoe.kernels.gluon.sm90.epilogue import EPILOGUES
from titan_megamoe.kernels.launch import launch, next_power_of_2
from titan_megamoe.kernels.gluon.sm90.load import LOAD_REGISTERS, LOAD_WARPS, load_partition
from titan_megamoe.kernels.gluon.sm90.mma import MMA_REGISTERS, MMA_ROWS, MMA_WARPS, mma_partition
from titan_megamoe.kernels.gluon.sm90.ring import StageRing
from titan_megamoe.kernels.gluon.sm90.schedule import ExpertTiles
from titan_megamoe.kernels.gluon.sm90.spec import GemmSpec

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}
"""Operand dtypes the kernel multiplies."""

FP8_BLOCK = 128
"""Blockwise fp8's scale block: 1 x 128 for A, 128 x 128 for B."""


@dataclass(frozen=True)
class GemmTiles:
    """One grouped GEMM's tiles (meta-parameters of ``grouped_gemm_kernel``)."""

    block_n: int
    """Output columns per tile: at most 256 with one B, 128 with two (two accumulators),
    128 blockwise (accumulator and two partial products)."""
    block_k: int
    """K per stage; blockwise fp8 takes 128 (one scale block)."""
    stages: int
    """Depth of the shared-memory ring."""
    mma_warpgroups: int = 2
    """Consumer warpgroups, 64 rows of the tile each (``BLOCK_M`` = 64 x this)."""
    promote_chunk: int = 4
    """Blockwise fp8: K blocks per unrolled chunk, inside which each block's promotion
    overlaps the next block's MMA (``mma``)."""

    @property
    def block_m(self) -> int:
        return int(MMA_ROWS) * self.mma_warpgroups


DEFAULT_TILES = {
    # bf16, one B: 128 x 256 tiles, 64-deep K steps in 4 stages (192 KB of ring).
    ("bf16", False): GemmTiles(block_n=256, block_k=64, stages=4),
    # bf16, two B (gate and up): two 64 x 128 accumulators per consumer warpgroup.
    ("bf16", True): GemmTiles(block_n=128, block_k=64, stages=4),
    # Blockwise fp8: 128 x 128 tiles, one 128-deep scale block per K step, 5 stages (160 KB).
    ("fp8", False): GemmTiles(block_n=128, block_k=128, stages=5),
}
"""Tiles by (operand precision, two B), before measurement on a GPU picks others
(``scripts/gemm_bench.py --sweep`` times the candidates)."""


@gluon.jit(do_not_specialize=["local_experts", "rank", "rows_per_rank"])
def grouped_gemm_kernel(a_desc, b_desc, b2_desc, a_scale, b_scale, out, row_origin, out_ptrs, rank, rows_per_rank,
                        block_base, local_base, local_rows, local_experts, num_blocks,
                        EPILOGUE: gl.constexpr, COMBINE: gl.constexpr, N: gl.constexpr, K: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, MMA_WARPGROUPS: gl.constexpr, LOCAL_PAD: gl.constexpr,
                        TWO_B: gl.constexpr, B_K_MAJOR: gl.constexpr, SCALE_K: gl.constexpr,
                        SCALE_N: gl.constexpr, PROMOTE_CHUNK: gl.constexpr):
    """Persistent: one program per SM, each running the load partition (a worker) and
    ``MMA_WARPGROUPS`` consumer warpgroups (the default partition and a worker) over the
    same tiles (``ring`` writes down their protocol)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    gl.static_assert(BLOCK_M == MMA_WARPGROUPS * MMA_ROWS, "a tile is 64 rows per consumer warpgroup")
    gl.static_assert((N % BLOCK_N == 0) and (K % BLOCK_K == 0), "tiles divide N and K")
    spec = GemmSpec(EPILOGUE, COMBINE, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, MMA_WARPGROUPS, LOCAL_PAD, TWO_B, B_K_MAJOR,
                    SCALE_K, SCALE_N, PROMOTE_CHUNK)
    ring = StageRing.allocate(a_desc, b_desc, b2_desc, spec)
    tiles = ExpertTiles(block_base, local_base, local_rows, local_experts, num_blocks)
    if MMA_WARPGROUPS == 2:
        gl.warp_specialize([
            (mma_partition, (ring, tiles, a_scale, b_scale, out, row_origin, out_ptrs, rank, rows_per_rank,
                             spec, 0)),
            (mma_partition, (ring, tiles, a_scale, b_scale, out, row_origin, out_ptrs, rank, rows_per_rank,
                             spec, 1)),
            (load_partition, (a_desc, b_desc, b2_desc, ring, tiles, spec)),
        ], [MMA_WARPS, LOAD_WARPS], [MMA_REGISTERS, LOAD_REGISTERS])
    else:
        gl.static_assert(MMA_WARPGROUPS == 1, "one or two consumer warpgroups")
        gl.warp_specialize([
            (mma_partition, (ring, tiles, a_scale, b_scale, out, row_origin, out_ptrs, rank, rows_per_rank,
                             spec, 0)),
            (load_partition, (a_desc, b_desc, b2_desc, ring, tiles, spec)),
        ], [LOAD_WARPS], [LOAD_REGISTERS])


DESCRIPTOR_DTYPES = {**GL_DTYPES, torch.float32: gl.float32}
"""What a TMA descriptor may move: the operands, and fp32 outputs."""


@functools.cache
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout the MMAs read ``block`` tiles of ``dtype`` in (made once)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), DESCRIPTOR_DTYPES[dtype])


def tma_descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of ``block`` tiles of the 2-D tensor ``t`` (bf16 or e4m3 operands, or
    an fp32 output), in the shared-memory layout the MMAs read."""
    return TensorDescriptor.from_tensor(t, block, _shared_layout(tuple(block), t.dtype))


@dataclass(frozen=True)
class CombineRows:
    """Where rows go instead of their own rows of ``out``: row ``r`` to row ``origin[r] %
    rows_per_rank`` of rank ``origin[r] // rows_per_rank``'s copy of ``out``, a symmetric
    buffer ``[rows_per_rank, N]`` whose copies lie at ``out_ptrs[rank]`` (int64 addresses)."""

    origin: torch.Tensor
    out_ptrs: torch.Tensor
    rank: int
    rows_per_rank: int


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, layout: "ExpertLayout", tiles: GemmTiles, *,
                 b2: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
                 b_scale: torch.Tensor | None = None, b_k_major: bool = True, epilogue: str = "store",
                 combine: CombineRows | None = None, programs: int | None = None) -> None:
    """``out[rows of e] = epilogue(a[rows] b[e]^T (, a[rows] b2[e]^T))`` for the rows ``layout``
    places, or each row to its origin (``combine``).

    ``a [rows, K]``; ``b`` (and ``b2``) ``[experts, N, K]`` (``b_k_major``) or ``[experts, K,
    N]``; ``out [rows, N]`` (``combine``: ``[rows_per_rank, N]``). bf16, or e4m3 with
    ``a_scale [rows, K / 128]`` and ``b_scale [experts, N / 128, K / 128]`` (fp32,
    blockwise). ``programs``: persistent programs (default: one per SM). Raises naming
    what does not fit the kernel.
    """
    if a.dtype not in GL_DTYPES or b.dtype != a.dtype:
        raise ValueError(f"grouped_gemm multiplies bf16 or e4m3 operands of one dtype; got {a.dtype} and {b.dtype}")
    scaled = a.dtype == torch.float8_e4m3fn
    if scaled != (a_scale is not None and b_scale is not None):
        raise ValueError("e4m3 operands need a_scale and b_scale (blockwise fp8); bf16 operands take none")
    named = {"a": a, "b": b, "out": out, "b2": b2, "a_scale": a_scale, "b_scale": b_scale}
    strided = [name for name, t in named.items() if t is not None and not t.is_contiguous()]
    if strided:  # the TMA descriptors and the stores address rows of the tensors as given
        raise ValueError(f"grouped_gemm takes contiguous tensors; {', '.join(strided)} are not")
    experts = b.shape[0]
    k_dim, n_dim = (b.shape[2], b.shape[1]) if b_k_major else (b.shape[1], b.shape[2])
    out_rows = combine.rows_per_rank if combine is not None else a.shape[0]
    if a.shape[1] != k_dim or out.shape != (out_rows, n_dim):
        raise ValueError(f"shapes: a {tuple(a.shape)}, b {tuple(b.shape)} ({'K' if b_k_major else 'N'}-major), "
                         f"out {tuple(out.shape)}: expected a [rows, {k_dim}] and out [{out_rows}, {n_dim}]")
    if scaled and (tiles.block_n, tiles.block_k) != (FP8_BLOCK, FP8_BLOCK):
        raise ValueError(f"blockwise fp8 takes {FP8_BLOCK} x {FP8_BLOCK} tiles of N x K (one weight scale block, one "
                         f"promotion per K step); got {tiles.block_n} x {tiles.block_k}")
    if tiles.block_n > (128 if b2 is not None else 256):
        raise ValueError(f"block_n = {tiles.block_n}: a consumer warpgroup holds at most 64 x 256 fp32 accumulator "
                         "elements (64 x 128 each with two B)")
    if scaled and not b_k_major:
        raise ValueError("blockwise fp8 takes a K-major B (Hopper's fp8 MMA reads K-major operands only)")
    if n_dim % tiles.block_n or k_dim % tiles.block_k:
        raise ValueError(f"N = {n_dim} and K = {k_dim} must be multiples of the tile's {tiles.block_n} and "
                         f"{tiles.block_k}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r} is unknown; known: {', '.join(EPILOGUES)}")
    if (epilogue == "swiglu") != (b2 is not None):
        raise ValueError("the swiglu epilogue takes two weights (b2) and only it does")
    if layout.local_experts != experts:
        raise ValueError(f"the layout places {layout.local_experts} experts' rows; b holds {experts}")
    if layout.block_m != tiles.block_m:
        raise ValueError(f"the layout's blocks are {layout.block_m} rows and the tiles {tiles.block_m}: a tile is "
                         "one block of the layout")
    a_block = [tiles.block_m, tiles.block_k]
    b_block = [tiles.block_n, tiles.block_k] if b_k_major else [tiles.block_k, tiles.block_n]
    b_rows = experts * (n_dim if b_k_major else k_dim)
    b_desc = tma_descriptor(b.reshape(b_rows, -1), b_block)
    b2_desc = tma_descriptor(b2.reshape(b_rows, -1), b_block) if b2 is not None else None
    if programs is None:
        programs = torch.cuda.get_device_properties(a.device).multi_processor_count
    targets = (combine.origin, combine.out_ptrs, combine.rank, combine.rows_per_rank) if combine else (None,) * 4
    launch(grouped_gemm_kernel, (programs,),
        tma_descriptor(a, a_block), b_desc, b2_desc, a_scale, b_scale, out, *targets,
        layout.block_base, layout.local_base, layout.local_rows, experts, layout.num_blocks,
        EPILOGUE=EPILOGUES[epilogue], COMBINE=combine is not None, N=n_dim, K=k_dim, BLOCK_N=tiles.block_n,
        STAGES=tiles.stages, MMA_WARPGROUPS=tiles.mma_warpgroups, LOCAL_PAD=next_power_of_2(experts),
        TWO_B=b2 is not None, B_K_MAJOR=b_k_major, SCALE_K=FP8_BLOCK if scaled else 0, SCALE_N=FP8_BLOCK,
        PROMOTE_CHUNK=tiles.promote_chunk, num_warps=int(MMA_WARPS),
    )


@dataclass(frozen=True)
class ExpertLayout:
    """Where each local expert's rows lie, as ``kernels.layout`` lays out a receive buffer
    (int32 device tensors; ``num_blocks`` one integer element)."""

    local_base: torch.Tensor
    local_rows: torch.Tensor
    block_base: torch.Tensor
    num_blocks: torch.Tensor
    block_m: int
    """Virtual rows per block (``block_base`` counts them): a tile's rows."""
    rows: int
    """Rows the layout spans (the last expert's end, aligned), or at most spans."""

    @property
    def local_experts(self) -> int:
        return self.local_base.numel()

    @classmethod
    def from_counts(cls, counts: torch.Tensor, block_m: int, row_align: int) -> "ExpertLayout":
        """The layout of ``counts[e]`` rows per expert: each expert's rows start on a
        multiple of ``row_align``, its tiles on a multiple of ``block_m`` virtual rows."""
        counts = counts.to(torch.int64)
        aligned = (counts + row_align - 1) // row_align * row_align
        blocks = (counts + block_m - 1) // block_m
        local_base = torch.cumsum(aligned, 0) - aligned
        block_base = (torch.cumsum(blocks, 0) - blocks) * block_m
        return cls(local_base.to(torch.int32), counts.to(torch.int32), block_base.to(torch.int32),
                   blocks.sum().reshape(1).to(torch.int32), block_m, int(aligned.sum()))

"""GEMM1 on the Gluon core, and its launcher.

``h = silu(x W1[e]^T) * (x W3[e]^T)`` for the received rows of local expert ``e``
(``x [rows, H]``, ``W1``, ``W3 [experts, I, H]``): bf16, or blockwise e4m3 with ``h``
quantized in 1 x 128 blocks for GEMM2, and the pre-activations ``[g | u]`` of the rows
below ``saved_rows`` kept for the backward. It computes the tiles ``dispatch_gemm1_kernel``
computes; that kernel dispatches the rows on the communication programs' SMs while this
one runs on the others, on a stream beside it (``DISPATCH_ONLY``).

A tile is 128 intermediate columns wide; its rows depend on the operands.
- bf16: 128 rows, each consumer warpgroup its own 64 times both weights (two 64 x 128
  accumulators) and its own epilogue from registers (``mma.gate_up_pair_mma_partition``).
- blockwise fp8: 64 rows, which the two consumer warpgroups share (``split_b``): warpgroup
  0 multiplies them by W1, warpgroup 1 by W3, each a 64 x 128 accumulator beside the
  promotion's two partials (two accumulators and their partials would not fit one
  warpgroup). Warpgroup 1 hands its accumulator to warpgroup 0 through shared memory and
  goes on to its next tile's MMAs while warpgroup 0 forms, quantizes and stores ``h``
  (``mma.gate_up_mma_partition``, which writes the hand-over down). The receive layout's
  blocks are 128 rows: two tiles each, and a block's second tile is skipped where its
  expert's rows end in the first.
The load warp copies a tile's rows once they have arrived (``arrivals``), as in
``swiglu_grad_gemm``.
"""

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from titan_megamoe.kernels.gluon.sm90.arrivals import ChunkArrivals, ChunkFlags
from titan_megamoe.kernels.gluon.sm90.epilogue import GateUpOutputs
from titan_megamoe.kernels.gluon.sm90.grouped_gemm import FP8_BLOCK, GL_DTYPES, ExpertLayout, GemmTiles, tma_descriptor
from titan_megamoe.kernels.gluon.sm90.load import ARRIVAL_LOAD_REGISTERS, LOAD_WARPS, load_arrived_rows
from titan_megamoe.kernels.gluon.sm90.mma import (
    ARRIVAL_MMA_REGISTERS,
    MMA_ROWS,
    MMA_WARPS,
    gate_up_mma_partition,
    gate_up_pair_mma_partition,
)
from titan_megamoe.kernels.gluon.sm90.ring import StageRing, allocate_barriers
from titan_megamoe.kernels.gluon.sm90.schedule import ExpertTiles
from titan_megamoe.kernels.gluon.sm90.spec import GemmSpec
from titan_megamoe.kernels.launch import launch, next_power_of_2

GATE_UP_BLOCK_N = 128
"""Intermediate columns per tile: one accumulator of 64 x 128 per warpgroup, and
blockwise fp8's scale block of ``h``."""



@gluon.constexpr_function
def gate_up_tile_rows(split_b):
    """Rows of a GEMM1 tile: 64 where the warpgroups split the weights (blockwise fp8),
    else 128 (64 per warpgroup)."""
    return 64 if split_b else 128


ACT_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}
"""Activation dtypes ``h`` is rounded to before it is quantized (as the reference rounds)."""


@gluon.jit(do_not_specialize=["local_experts", "rank", "ep", "saved_rows"])
def gate_up_gemm_kernel(a_desc, b_desc, b2_desc, a_scale, b_scale, b2_scale, block_base, local_base, local_rows,
                        local_experts, num_blocks, flags, flag_ptrs, state, src_offset, src_rows, rank, ep,
                        h, h_scales, preact, saved_rows,
                        N: gl.constexpr, K: gl.constexpr, STAGES: gl.constexpr, LOCAL_PAD: gl.constexpr,
                        SCALE_K: gl.constexpr, SCALE_N: gl.constexpr, PROMOTE_CHUNK: gl.constexpr,
                        TILES_PER_BLOCK: gl.constexpr, CHUNK_READY: gl.constexpr, MAX_CHUNKS: gl.constexpr,
                        EP_PAD: gl.constexpr, ACT_DTYPE: gl.constexpr, POWER_OF_TWO: gl.constexpr,
                        SAVE: gl.constexpr):
    """Persistent: one program per SM, the load warp and the two consumer warpgroups over
    the same tiles (``SPLIT_B``: 64-row tiles shared by the warpgroups, else 128-row ones)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    SPLIT_B: gl.constexpr = SCALE_K > 0
    gl.static_assert(BLOCK_M == gate_up_tile_rows(SPLIT_B), "64-row tiles split by weight, else 128-row tiles")
    spec = GemmSpec(None, False, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 2, LOCAL_PAD, True, True, SCALE_K,
                    SCALE_N, PROMOTE_CHUNK, split_b=SPLIT_B, tiles_per_block=TILES_PER_BLOCK)
    ring = StageRing.allocate(a_desc, b_desc, b2_desc, spec)
    tiles = ExpertTiles(block_base, local_base, local_rows, local_experts, num_blocks)
    arrivals = ChunkArrivals(flags, flag_ptrs, state, src_offset, src_rows, rank, ep, CHUNK_READY, MAX_CHUNKS, EP_PAD)
    outs = GateUpOutputs(h, saved_rows, N, ACT_DTYPE, SCALE_K, POWER_OF_TWO, SAVE)
    tile_count = tiles.count(spec)
    if SPLIT_B:
        staging = gl.allocate_shared_memory(gl.float32, [2, MMA_ROWS, BLOCK_N],
                                            gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        handoff = allocate_barriers(2)
        gl.warp_specialize([
            (gate_up_mma_partition, (ring, tiles, a_scale, b_scale, staging, handoff, outs, h_scales, preact,
                                     tile_count, spec, 0)),
            (gate_up_mma_partition, (ring, tiles, a_scale, b2_scale, staging, handoff, outs, h_scales, preact,
                                     tile_count, spec, 1)),
            (load_arrived_rows, (a_desc, b_desc, b2_desc, ring, tiles, arrivals, tile_count, spec)),
        ], [MMA_WARPS, LOAD_WARPS], [ARRIVAL_MMA_REGISTERS, ARRIVAL_LOAD_REGISTERS])
    else:
        gl.warp_specialize([
            (gate_up_pair_mma_partition, (ring, tiles, outs, preact, tile_count, spec, 0)),
            (gate_up_pair_mma_partition, (ring, tiles, outs, preact, tile_count, spec, 1)),
            (load_arrived_rows, (a_desc, b_desc, b2_desc, ring, tiles, arrivals, tile_count, spec)),
        ], [MMA_WARPS, LOAD_WARPS], [ARRIVAL_MMA_REGISTERS, ARRIVAL_LOAD_REGISTERS])


@dataclass(frozen=True)
class GateUpTensors:
    """What GEMM1 writes by received row: ``h [rows, I]`` (bf16, or e4m3 with ``h_scales
    [rows, I / 128]``) and, to keep them, ``preact [saved rows, 2I]``."""

    h: torch.Tensor
    h_scales: torch.Tensor | None = None
    preact: torch.Tensor | None = None


def gate_up_gemm(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, layout: ExpertLayout, chunks: ChunkFlags,
                 outs: GateUpTensors, tiles: GemmTiles, *, act_dtype: torch.dtype,
                 x_scale: torch.Tensor | None = None, w1_scale: torch.Tensor | None = None,
                 w3_scale: torch.Tensor | None = None, power_of_two: bool = False,
                 programs: int | None = None) -> None:
    """GEMM1 of every received row (module docstring). ``x [rows, H]``, ``w1``, ``w3
    [experts, I, H]``: bf16, or e4m3 with ``x_scale [rows, H / 128]`` and ``w1_scale``,
    ``w3_scale [experts, I / 128, H / 128]``, where ``h`` is rounded to ``act_dtype`` and
    quantized in 1 x 128 blocks (``power_of_two``: UE8M0 scales). ``tiles``: ``block_n``
    128, ``block_k``, ``stages``; its rows are ``gate_up_tile_rows`` whatever
    ``mma_warpgroups`` says. Raises
    naming what does not fit the kernel."""
    scaled = x.dtype == torch.float8_e4m3fn
    if x.dtype not in GL_DTYPES or w1.dtype != x.dtype or w3.dtype != x.dtype:
        raise ValueError(f"gate_up_gemm multiplies bf16 or e4m3 operands of one dtype; got {x.dtype}, {w1.dtype} "
                         f"and {w3.dtype}")
    if scaled != all(s is not None for s in (x_scale, w1_scale, w3_scale)) or scaled != (outs.h_scales is not None):
        raise ValueError("e4m3 operands need x_scale, w1_scale, w3_scale and h_scales; bf16 operands take none")
    named = {"x": x, "w1": w1, "w3": w3, "x_scale": x_scale, "w1_scale": w1_scale, "w3_scale": w3_scale,
             **vars(outs)}
    strided = [name for name, t in named.items() if t is not None and not t.is_contiguous()]
    if strided:
        raise ValueError(f"gate_up_gemm takes contiguous tensors; {', '.join(strided)} are not")
    experts, inter, hidden = w1.shape
    if w3.shape != w1.shape or x.shape[1] != hidden or outs.h.shape[1] != inter:
        raise ValueError(f"shapes: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, h "
                         f"{tuple(outs.h.shape)}: expected x [rows, {hidden}], w3 as w1 and h [rows, {inter}]")
    if outs.preact is not None and outs.preact.shape[1] != 2 * inter:
        raise ValueError(f"preact {tuple(outs.preact.shape)}: expected [saved rows, {2 * inter}]")
    if act_dtype not in ACT_DTYPES:
        raise ValueError(f"act_dtype {act_dtype}: h is rounded to one of {', '.join(map(str, ACT_DTYPES))}")
    if tiles.block_n != GATE_UP_BLOCK_N or (scaled and tiles.block_k != FP8_BLOCK):
        raise ValueError(f"gate_up_gemm takes tiles {GATE_UP_BLOCK_N} wide (blockwise fp8: {FP8_BLOCK}-deep K "
                         f"steps); got block_n {tiles.block_n}, block_k {tiles.block_k}")
    if inter % tiles.block_n or hidden % tiles.block_k:
        raise ValueError(f"I = {inter} and H = {hidden} must be multiples of the tile's {tiles.block_n} and "
                         f"{tiles.block_k}")
    tile_rows = gate_up_tile_rows(scaled)
    if layout.local_experts != experts or layout.block_m % tile_rows:
        raise ValueError(f"the layout places {layout.local_experts} experts' rows in blocks of {layout.block_m}; "
                         f"w1 holds {experts} experts and a tile is {tile_rows} rows")
    if programs is None:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    b_block = [tiles.block_n, tiles.block_k]
    saved_rows = 0 if outs.preact is None else outs.preact.shape[0]
    launch(gate_up_gemm_kernel, (programs,),
        tma_descriptor(x, [tile_rows, tiles.block_k]), tma_descriptor(w1.reshape(-1, hidden), b_block),
        tma_descriptor(w3.reshape(-1, hidden), b_block), x_scale, w1_scale, w3_scale,
        layout.block_base, layout.local_base, layout.local_rows, experts, layout.num_blocks,
        chunks.flags, chunks.flag_ptrs, chunks.state, chunks.src_offset, chunks.src_rows, chunks.rank, chunks.ep,
        outs.h, outs.h_scales, outs.preact, saved_rows,
        N=inter, K=hidden, STAGES=tiles.stages, LOCAL_PAD=next_power_of_2(experts),
        SCALE_K=FP8_BLOCK if scaled else 0, SCALE_N=FP8_BLOCK, PROMOTE_CHUNK=tiles.promote_chunk,
        TILES_PER_BLOCK=layout.block_m // tile_rows, CHUNK_READY=chunks.chunk_ready,
        MAX_CHUNKS=chunks.max_chunks, EP_PAD=next_power_of_2(chunks.ep), ACT_DTYPE=ACT_DTYPES[act_dtype],
        POWER_OF_TWO=power_of_two, SAVE=outs.preact is not None,
        num_warps=int(MMA_WARPS),
    )

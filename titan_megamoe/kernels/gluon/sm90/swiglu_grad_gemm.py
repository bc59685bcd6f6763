"""The backward's first GEMM on the Gluon core, and its launcher.

``d = dy W2[e]`` for the received rows of local expert ``e`` (``dy [rows, H]``, W2
transposed ``[experts, I, H]``, or bf16 W2 as stored ``[experts, H, I]``), then the SwiGLU
backward as the epilogue (``epilogue.swiglu_backward_rows``): ``[da | db]``, its e4m3
copy, ``h_wgrad`` and the score-gradient parts, from GEMM1's saved pre-activations. It
computes the tiles ``dispatch_grad_gemm1_kernel`` computes for the saved rows
(``SAVED_TILES``); that kernel dispatches the rows on the communication programs'
SMs while this one runs on the others, on a stream beside it (``DISPATCH_ONLY``), and
recomputes the rows past the saved ones after it (``PAST_SAVED_TILES``).

The partitions are ``grouped_gemm``'s (same ring protocol, ``ring``) but for two things:
the load warp copies a tile's rows only once they have arrived from every source
(``arrivals``, the dispatch's CHUNK_READY words), and the tiles stop at the saved rows'
end (``schedule.ExpertTiles.saved_end``, in the ``tl`` kernel's tile height ``SAVED_M``:
where that end splits a block, the second consumer warpgroup leaves its rows to the ``tl``
kernel).
"""

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from titan_megamoe.kernels.gluon.sm90.arrivals import ChunkArrivals, ChunkFlags
from titan_megamoe.kernels.gluon.sm90.epilogue import SwigluGradOutputs
from titan_megamoe.kernels.gluon.sm90.grouped_gemm import FP8_BLOCK, GL_DTYPES, ExpertLayout, GemmTiles, tma_descriptor
from titan_megamoe.kernels.gluon.sm90.load import ARRIVAL_LOAD_REGISTERS, LOAD_WARPS, load_arrived_rows
from titan_megamoe.kernels.gluon.sm90.mma import ARRIVAL_MMA_REGISTERS, MMA_ROWS, MMA_WARPS, swiglu_grad_mma_partition
from titan_megamoe.kernels.gluon.sm90.ring import StageRing
from titan_megamoe.kernels.gluon.sm90.schedule import ExpertTiles
from titan_megamoe.kernels.gluon.sm90.spec import GemmSpec
from titan_megamoe.kernels.launch import launch, next_power_of_2

SWIGLU_GRAD_BLOCK_N = 128
"""Intermediate columns per tile: two 64-column halves in the epilogue, and blockwise
fp8's scale block of ``[da | db]``."""


@gluon.jit(do_not_specialize=["local_experts", "rank", "ep", "saved_rows"])
def swiglu_grad_gemm_kernel(a_desc, b_desc, a_scale, b_scale, block_base, local_base, local_rows, local_experts,
                            num_blocks, flags, flag_ptrs, state, src_offset, src_rows, rank, ep, saved_rows,
                            preact, score, dab, dab_q, dab_scales, h_wgrad, score_parts,
                            N: gl.constexpr, K: gl.constexpr, STAGES: gl.constexpr, LOCAL_PAD: gl.constexpr,
                            B_K_MAJOR: gl.constexpr, SCALE_K: gl.constexpr, SCALE_N: gl.constexpr, PROMOTE_CHUNK: gl.constexpr,
                            SAVED_M: gl.constexpr, CHUNK_READY: gl.constexpr, MAX_CHUNKS: gl.constexpr,
                            EP_PAD: gl.constexpr, SCORE_BEFORE_EXPERTS: gl.constexpr, POWER_OF_TWO: gl.constexpr,
                            ROW_ALIGN: gl.constexpr):
    """Persistent: one program per SM, the load warp and two consumer warpgroups over the
    tiles of the blocks below the saved rows' end."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0] if B_K_MAJOR else b_desc.block_type.shape[1]
    gl.static_assert(BLOCK_M == 2 * MMA_ROWS, "a tile is two consumer warpgroups of 64 rows")
    spec = GemmSpec(None, False, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 2, LOCAL_PAD, False, B_K_MAJOR, SCALE_K,
                    SCALE_N, PROMOTE_CHUNK)
    ring = StageRing.allocate(a_desc, b_desc, b_desc, spec)
    staging = gl.allocate_shared_memory(gl.float32, [2, MMA_ROWS, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    tiles = ExpertTiles(block_base, local_base, local_rows, local_experts, num_blocks)
    arrivals = ChunkArrivals(flags, flag_ptrs, state, src_offset, src_rows, rank, ep, CHUNK_READY, MAX_CHUNKS, EP_PAD)
    outs = SwigluGradOutputs(preact, score, dab, h_wgrad, score_parts, N, SCORE_BEFORE_EXPERTS, SCALE_K, POWER_OF_TWO,
                             ROW_ALIGN)
    virtual_end = tiles.saved_end(saved_rows, spec, SAVED_M=SAVED_M, WARPS=MMA_WARPS)
    gl.warp_specialize([
        (swiglu_grad_mma_partition, (ring, tiles, a_scale, b_scale, staging, outs, dab_q, dab_scales, virtual_end, spec,
                                     0)),
        (swiglu_grad_mma_partition, (ring, tiles, a_scale, b_scale, staging, outs, dab_q, dab_scales, virtual_end, spec,
                                     1)),
        (load_arrived_rows, (a_desc, b_desc, b_desc, ring, tiles, arrivals, tiles.count_below(virtual_end, spec),
                             spec)),
    ], [MMA_WARPS, LOAD_WARPS], [ARRIVAL_MMA_REGISTERS, ARRIVAL_LOAD_REGISTERS])


@dataclass(frozen=True)
class SwigluGradTensors:
    """The epilogue's operands by received row (``epilogue.SwigluGradOutputs``): ``preact
    [saved rows, 2I]`` and ``score [rows]`` read; ``dab [rows, 2I]``, ``h_wgrad [rows, I]``,
    ``score_parts [rows, I / 128]`` written, and with e4m3 operands ``dab_q [rows, 2I]``
    e4m3 and ``dab_scales [rows, 2I / 128]``."""

    preact: torch.Tensor
    score: torch.Tensor
    dab: torch.Tensor
    h_wgrad: torch.Tensor
    score_parts: torch.Tensor
    dab_q: torch.Tensor | None = None
    dab_scales: torch.Tensor | None = None


def swiglu_grad_gemm(dy: torch.Tensor, w2t: torch.Tensor, layout: ExpertLayout, chunks: ChunkFlags,
                     outs: SwigluGradTensors, tiles: GemmTiles, *, saved_m: int, score_before_experts: bool,
                     row_align: int, dy_scale: torch.Tensor | None = None, w2t_scale: torch.Tensor | None = None,
                     b_k_major: bool = True, power_of_two: bool = False, programs: int | None = None) -> None:
    """The saved rows' tiles of the backward's first GEMM (module docstring). ``dy [rows,
    H]`` and ``w2t [experts, I, H]`` (``b_k_major``; bf16 may take W2 as stored, ``[experts,
    H, I]``): bf16, or e4m3 with ``dy_scale [rows, H / 128]`` and ``w2t_scale [experts, I /
    128, H / 128]``, whose ``[da | db]`` copy is quantized in 1 x 128 blocks
    (``power_of_two``: UE8M0 scales). ``saved_m``: the rows of the ``tl`` tiles that take the
    rows past the saved ones. Raises naming what does not fit the kernel."""
    scaled = dy.dtype == torch.float8_e4m3fn
    if dy.dtype not in GL_DTYPES or w2t.dtype != dy.dtype:
        raise ValueError(f"swiglu_grad_gemm multiplies bf16 or e4m3 operands of one dtype; got {dy.dtype} and "
                         f"{w2t.dtype}")
    if scaled != (dy_scale is not None and w2t_scale is not None) or scaled != (outs.dab_q is not None):
        raise ValueError("e4m3 operands need dy_scale, w2t_scale and the e4m3 copy of [da | db] (dab_q, dab_scales); "
                         "bf16 operands take none")
    experts = w2t.shape[0]
    hidden, inter = (w2t.shape[2], w2t.shape[1]) if b_k_major else (w2t.shape[1], w2t.shape[2])
    named = {"dy": dy, "w2t": w2t, "dy_scale": dy_scale, "w2t_scale": w2t_scale, **vars(outs)}
    strided = [name for name, t in named.items() if t is not None and not t.is_contiguous()]
    if strided:
        raise ValueError(f"swiglu_grad_gemm takes contiguous tensors; {', '.join(strided)} are not")
    if dy.shape[1] != hidden or outs.preact.shape[1] != 2 * inter or outs.dab.shape[1] != 2 * inter:
        raise ValueError(f"shapes: dy {tuple(dy.shape)}, w2t {tuple(w2t.shape)} ({'K' if b_k_major else 'N'}-major), "
                         f"preact {tuple(outs.preact.shape)}, dab {tuple(outs.dab.shape)}: expected dy [rows, "
                         f"{hidden}] and preact, dab [rows, {2 * inter}]")
    if tiles.block_n != SWIGLU_GRAD_BLOCK_N or tiles.mma_warpgroups != 2:
        raise ValueError(f"swiglu_grad_gemm takes tiles {SWIGLU_GRAD_BLOCK_N} wide of two consumer warpgroups; got "
                         f"block_n {tiles.block_n}, {tiles.mma_warpgroups} warpgroups")
    if scaled and (tiles.block_k != FP8_BLOCK or not b_k_major):
        raise ValueError(f"blockwise fp8 takes {FP8_BLOCK}-deep K steps and a K-major W2^T; got block_k "
                         f"{tiles.block_k}, b_k_major {b_k_major}")
    if inter % tiles.block_n or hidden % tiles.block_k:
        raise ValueError(f"I = {inter} and H = {hidden} must be multiples of the tile's {tiles.block_n} and "
                         f"{tiles.block_k}")
    if layout.local_experts != experts or layout.block_m != tiles.block_m or layout.block_m % saved_m:
        raise ValueError(f"the layout places {layout.local_experts} experts' rows in blocks of {layout.block_m}; "
                         f"w2t holds {experts} experts, the tiles are {tiles.block_m} rows and the tl tiles "
                         f"{saved_m}")
    if saved_m % int(MMA_ROWS):
        raise ValueError(f"the tl tiles past the saved rows are {saved_m} rows: where they start inside a block, "
                         f"a consumer warpgroup's {int(MMA_ROWS)} rows must be wholly saved or wholly theirs")
    a_block = [tiles.block_m, tiles.block_k]
    b_block = [tiles.block_n, tiles.block_k] if b_k_major else [tiles.block_k, tiles.block_n]
    if programs is None:
        programs = torch.cuda.get_device_properties(dy.device).multi_processor_count
    launch(swiglu_grad_gemm_kernel, (programs,),
        tma_descriptor(dy, a_block), tma_descriptor(w2t.reshape(-1, w2t.shape[2]), b_block), dy_scale, w2t_scale,
        layout.block_base, layout.local_base, layout.local_rows, experts, layout.num_blocks,
        chunks.flags, chunks.flag_ptrs, chunks.state, chunks.src_offset, chunks.src_rows, chunks.rank, chunks.ep,
        outs.preact.shape[0], outs.preact, outs.score, outs.dab, outs.dab_q, outs.dab_scales, outs.h_wgrad,
        outs.score_parts,
        N=inter, K=hidden, STAGES=tiles.stages, LOCAL_PAD=next_power_of_2(experts), B_K_MAJOR=b_k_major,
        SCALE_K=FP8_BLOCK if scaled else 0, SCALE_N=FP8_BLOCK, PROMOTE_CHUNK=tiles.promote_chunk, SAVED_M=saved_m,
        CHUNK_READY=chunks.chunk_ready, MAX_CHUNKS=chunks.max_chunks, EP_PAD=next_power_of_2(chunks.ep),
        SCORE_BEFORE_EXPERTS=score_before_experts, POWER_OF_TWO=power_of_two, ROW_ALIGN=row_align,
        num_warps=int(MMA_WARPS),
    )

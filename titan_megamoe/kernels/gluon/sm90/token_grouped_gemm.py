"""A GEMM grouped along K, for the weight gradients, and its launcher.

``out[e] = A_e B_e^T`` where expert ``e`` contracts its own token blocks
``block_start[e] .. block_start[e + 1]`` of two token-major operands (``kernels.wgrad``'s
copies): ``a [M, tokens]`` and ``b [N, tokens]`` e4m3, each with one fp32 scale per row per
128-token block, block-major (``[tokens / 128, M]``: a tile's scales of one block are
contiguous). The partitions are ``grouped_gemm``'s, on another schedule
(``schedule.TokenBlockTiles``): the load warp fills the stage ring with each tile's token
blocks (``load.load_token_blocks``), two consumer warpgroups of 64 rows multiply them and
promote each block's partial product by the outer product of its row and column scales
and store each tile through shared memory and TMA (``mma.token_block_mma_partition``).
Same ring protocol (``ring``).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from titan_megamoe.kernels.gluon.sm90.grouped_gemm import FP8_BLOCK, GemmTiles, tma_descriptor
from titan_megamoe.kernels.gluon.sm90.load import LOAD_REGISTERS, LOAD_WARPS, load_token_blocks
from titan_megamoe.kernels.gluon.sm90.mma import MMA_REGISTERS, MMA_ROWS, MMA_WARPS, token_block_mma_partition
from titan_megamoe.kernels.gluon.sm90.ring import StageRing
from titan_megamoe.kernels.gluon.sm90.schedule import TokenBlockTiles
from titan_megamoe.kernels.gluon.sm90.spec import TokenGemmSpec
from titan_megamoe.kernels.launch import launch

TOKEN_GEMM_TILES = GemmTiles(block_n=128, block_k=FP8_BLOCK, stages=5)
"""128 x 128 output tiles, one 128-token block per K step, 5 stages (160 KB, and 32 KB of
bf16 output staging, 64 KB of fp32): the column scales of a 128-wide tile take 32
registers a thread beside the accumulator and the partial product."""


@gluon.jit(do_not_specialize=["experts"])
def token_grouped_gemm_kernel(a_desc, b_desc, a_scale, b_scale, out_desc, out2_desc, block_start, experts,
                              M: gl.constexpr, N: gl.constexpr, SPLIT_M: gl.constexpr, STAGES: gl.constexpr,
                              MMA_WARPGROUPS: gl.constexpr):
    """Persistent: one program per SM, the load partition and two consumer warpgroups over
    the same tiles, each consumer with its own output staging buffer."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(BLOCK_M == MMA_WARPGROUPS * MMA_ROWS, "a tile is 64 rows per consumer warpgroup")
    gl.static_assert(MMA_WARPGROUPS == 2, "two consumer warpgroups")
    spec = TokenGemmSpec(M, N, SPLIT_M, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, MMA_WARPGROUPS)
    ring = StageRing.allocate(a_desc, b_desc, b_desc, spec)
    tiles = TokenBlockTiles(block_start, experts)
    staging = gl.allocate_shared_memory(out_desc.dtype, [MMA_WARPGROUPS] + out_desc.block_type.shape, out_desc.layout)
    gl.warp_specialize([
        (token_block_mma_partition, (ring, tiles, a_scale, b_scale, out_desc, out2_desc, staging.index(0), spec, 0)),
        (token_block_mma_partition, (ring, tiles, a_scale, b_scale, out_desc, out2_desc, staging.index(1), spec, 1)),
        (load_token_blocks, (a_desc, b_desc, ring, tiles, spec)),
    ], [MMA_WARPS, LOAD_WARPS], [MMA_REGISTERS, LOAD_REGISTERS])


def token_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                       block_start: torch.Tensor, outs: tuple[torch.Tensor, ...],
                       tiles: GemmTiles = TOKEN_GEMM_TILES, programs: int | None = None) -> None:
    """``out[e] = sum over e's token blocks of A_k B_k^T`` scaled per row and block.

    ``a [M, tokens]``, ``b [N, tokens]`` e4m3 and their scales ``[tokens / 128, M | N]``
    fp32 (block-major); ``block_start [experts + 1]`` int32, each expert's first 128-token block (tokens
    past an expert's rows must hold zeros); ``outs`` (bf16 or fp32): one ``[experts, M, N]``,
    or two ``[experts, M / 2, N]`` that take the first and second half of the rows. Raises naming
    what does not fit the kernel."""
    fp8 = torch.float8_e4m3fn
    if a.dtype != fp8 or b.dtype != fp8 or a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise ValueError(f"token_grouped_gemm multiplies e4m3 operands with fp32 scales; got a {a.dtype}, b {b.dtype}, "
                         f"scales {a_scale.dtype} and {b_scale.dtype}")
    named = {"a": a, "a_scale": a_scale, "b": b, "b_scale": b_scale, "block_start": block_start,
             **{f"outs[{i}]": o for i, o in enumerate(outs)}}
    strided = [name for name, t in named.items() if not t.is_contiguous()]
    if strided:
        raise ValueError(f"token_grouped_gemm takes contiguous tensors; {', '.join(strided)} are not")
    (m, tokens), n = a.shape, b.shape[0]
    blocks = tokens // FP8_BLOCK
    if b.shape[1] != tokens or tokens % FP8_BLOCK or a_scale.shape != (blocks, m) or b_scale.shape != (blocks, n):
        raise ValueError(f"shapes: a {tuple(a.shape)}, b {tuple(b.shape)}, a_scale {tuple(a_scale.shape)}, b_scale "
                         f"{tuple(b_scale.shape)}: expected a [M, T] and b [N, T] with T a multiple of {FP8_BLOCK}, "
                         f"scales [T / {FP8_BLOCK}, M] and [T / {FP8_BLOCK}, N]")
    if block_start.dtype != torch.int32 or block_start.dim() != 1:
        raise ValueError(f"block_start must be a 1-D int32 tensor; got {block_start.dtype} of {block_start.dim()} dims")
    experts = block_start.numel() - 1
    if any(o.dtype not in (torch.bfloat16, torch.float32) for o in outs):
        raise ValueError(f"token_grouped_gemm stores bf16 or fp32; got outs of {[o.dtype for o in outs]}")
    if (tiles.block_n, tiles.block_k, tiles.mma_warpgroups) != (128, FP8_BLOCK, 2):
        raise ValueError(f"token_grouped_gemm takes 128 x 128 tiles of two consumer warpgroups, one {FP8_BLOCK}-token "
                         f"block per K step; got block_n {tiles.block_n}, block_k {tiles.block_k}, "
                         f"{tiles.mma_warpgroups} warpgroups")
    rows = m // len(outs)
    if len(outs) not in (1, 2) or any(o.shape != (experts, rows, n) for o in outs):
        raise ValueError(f"outs: {[tuple(o.shape) for o in outs]}; expected one [{experts}, {m}, {n}] or two "
                         f"[{experts}, {m // 2}, {n}]")
    if rows % tiles.block_m or n % tiles.block_n:
        raise ValueError(f"M = {m} (per output {rows}) and N = {n} must be multiples of the tile's {tiles.block_m} and "
                         f"{tiles.block_n}")
    if programs is None:
        programs = torch.cuda.get_device_properties(a.device).multi_processor_count
    out_descs = [tma_descriptor(o.view(-1, n), [int(MMA_ROWS), tiles.block_n]) for o in outs]
    launch(token_grouped_gemm_kernel, (programs,),
        tma_descriptor(a, [tiles.block_m, tiles.block_k]), tma_descriptor(b, [tiles.block_n, tiles.block_k]),
        a_scale, b_scale, out_descs[0], out_descs[-1], block_start, experts,
        M=m, N=n, SPLIT_M=rows if len(outs) == 2 else 0, STAGES=tiles.stages, MMA_WARPGROUPS=tiles.mma_warpgroups,
        num_warps=int(MMA_WARPS),
    )

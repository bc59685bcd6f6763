"""The load partition: TMA copies of each K step's operand tiles into the stage ring."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from titan_megamoe.kernels.sync import EPOCH

# Triton 3.6 (what torch 2.11 pins) names the TMA load async_copy_global_to_shared; later
# releases name it async_load and make the old name raise.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

LOAD_WARPS = gl.constexpr(1)
"""Warps of the load partition: it only issues copies (scalar work)."""
LOAD_REGISTERS = gl.constexpr(40)
"""Its register budget: what is left goes to the consumer warpgroups."""
ARRIVAL_LOAD_REGISTERS = gl.constexpr(56)
"""Its budget where it waits for arrivals (``load_arrived_rows``): the waits spill in 40."""


@gluon.jit
def _load_tile(a_desc, b_desc, b2_desc, ring, step, expert, row0, n0, spec):
    """The K steps of one tile into the stages from ``step`` on: the A tile ``[BLOCK_M,
    BLOCK_K]`` at the tile's first row (rows past the tensor read as zeros), the B tile of
    the tile's expert, K-major ``[BLOCK_N, BLOCK_K]`` out of ``[experts * N, K]`` or N-major
    ``[BLOCK_K, BLOCK_N]`` out of ``[experts * K, N]``, and with a second B the same tile of
    B2. Returns the next step."""
    b_copies: gl.constexpr = 2 if spec.two_b else 1
    stage_bytes: gl.constexpr = a_desc.block_type.nbytes + b_copies * b_desc.block_type.nbytes
    for k in range(0, spec.k, spec.block_k):
        s, ready = ring.fill(step, spec)
        mbarrier.expect(ready, stage_bytes)
        tma_load(a_desc, [row0, k], ready, ring.a.index(s))
        if spec.b_k_major:
            b_row = expert * spec.n + n0
            b_col = k
        else:
            b_row = expert * spec.k + k
            b_col = n0
        tma_load(b_desc, [b_row, b_col], ready, ring.b.index(s))
        if spec.two_b:
            tma_load(b2_desc, [b_row, b_col], ready, ring.b2.index(s))
        step += 1
    return step


@gluon.jit
def load_partition(a_desc, b_desc, b2_desc, ring, tiles, spec):
    """Fill stage after stage with the program's tiles (``_load_tile``)."""
    step = 0
    for t in range(gl.program_id(0), tiles.count(spec), gl.num_programs(0)):
        expert, row0, _, n0 = tiles.tile(t, spec, WARPS=LOAD_WARPS)
        step = _load_tile(a_desc, b_desc, b2_desc, ring, step, expert, row0, n0, spec)


@gluon.jit
def load_arrived_rows(a_desc, b_desc, b2_desc, ring, tiles, arrivals, tile_count, spec):
    """``load_partition`` over the program's tiles below ``tile_count``, each tile's A rows
    copied only once they have arrived (``arrivals.wait_rows``: the rows another kernel,
    or other ranks, are still dispatching); tiles whose rows all lie past their expert's
    (the second half of a block, where ``tiles_per_block`` is 2) are skipped, as the
    consumers skip them."""
    epoch = gl.load(arrivals.state + EPOCH)
    step = 0
    for t in range(gl.program_id(0), tile_count, gl.num_programs(0)):
        expert, row0, row_end, n0 = tiles.tile(t, spec, WARPS=LOAD_WARPS)
        if row0 < row_end:
            arrivals.wait_rows(expert, gl.load(tiles.local_base + expert), row0, tiles.local_experts, epoch,
                               TILE_M=spec.block_m, CHUNK_M=spec.block_m * spec.tiles_per_block, WARPS=LOAD_WARPS)
            step = _load_tile(a_desc, b_desc, b2_desc, ring, step, expert, row0, n0, spec)


@gluon.jit
def load_token_blocks(a_desc, b_desc, ring, tiles, spec):
    """For a GEMM grouped along K (``schedule.TokenBlockTiles``): per tile, each of its
    expert's token blocks, the A tile ``[BLOCK_M, BLOCK_K]`` at the tile's rows and the B
    tile ``[BLOCK_N, BLOCK_K]`` at its columns, out of token-major ``[M, tokens]`` and
    ``[N, tokens]``."""
    stage_bytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    step = 0
    for t in range(gl.program_id(0), tiles.count(spec), gl.num_programs(0)):
        _, m0, n0, first, blocks = tiles.tile(t, spec)
        for j in range(blocks):
            s, ready = ring.fill(step, spec)
            mbarrier.expect(ready, stage_bytes)
            k = (first + j) * spec.block_k
            tma_load(a_desc, [m0, k], ready, ring.a.index(s))
            tma_load(b_desc, [n0, k], ready, ring.b.index(s))
            step += 1

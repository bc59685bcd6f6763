"""The MMA partitions: consumer warpgroups that multiply what the load partition stages.

Each consumer warpgroup owns ``MMA_ROWS`` (64) rows of every tile: warpgroup ``w`` rows
``64 w ..`` of the stage's A tile, all of its B tile. Its MMAs are asynchronous
(``warpgroup_mma``) and it waits with one K step left in flight, so the tensor cores
always hold the next step's work while the warpgroup releases a stage, promotes a
partial product or runs an epilogue; the other warpgroup's MMAs fill its epilogue.

Blockwise fp8 (``scale_k`` 128): one wgmma per 128-deep K block into a fresh partial
product; while block ``k``'s MMA runs, block ``k - 1``'s partial is promoted,
``acc += part * a_scale[row] * b_scale``, in registers (Hopper's MMA has no block
scaling). A 64 x 128 tile then holds three fp32 fragments per thread (64 registers
each: accumulator, partial being promoted, partial in flight), which is why blockwise
tiles are 128 columns wide and take one B.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from titan_megamoe.kernels.gluon.sm90.epilogue import (
    gate_up_pair_rows,
    gate_up_rows,
    row_origins,
    row_starts,
    store_layout,
    swiglu_backward_rows,
    thread_barrier,
)

tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

MMA_ROWS = gl.constexpr(64)
"""Rows of a tile per consumer warpgroup (one m64 wgmma)."""
MMA_WARPS = gl.constexpr(4)
"""Warps of a consumer warpgroup."""
UP_READY = gl.constexpr(0)
"""GEMM1's hand-over barriers: warpgroup 1's accumulator is in the staging buffer ..."""
STAGING_FREE = gl.constexpr(1)
"""... and warpgroup 0 has read both staging buffers."""
MMA_REGISTERS = gl.constexpr(232)
"""Register budget of a consumer warpgroup (two of them and the load warp's group fill
an SM's 64 K registers: 128 x (232 + 232 + 40))."""
ARRIVAL_MMA_REGISTERS = gl.constexpr(224)
"""The same beside a load warp that waits for arrivals: 128 x (224 + 224 + 56)."""


@gluon.constexpr_function
def mma_layout(block_n, element_bits):
    """The accumulator layout of one warpgroup's ``[64, block_n]`` wgmma."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, block_n, 256 // element_bits])


@gluon.jit
def mainloop(ring, step, acc, acc2, spec, WARPGROUP: gl.constexpr):
    """Unscaled operands: ``acc = A B^T`` (and ``acc2 = A B2^T``) over the tile's K steps,
    one step's MMAs in flight while the previous step's stage is released."""
    both_b: gl.constexpr = spec.two_b and not spec.split_b
    for k in range(spec.k // spec.block_k):
        a, b, b2 = ring.acquire(step, spec, WARPGROUP=WARPGROUP)
        acc = warpgroup_mma(a, b, acc, use_acc=k > 0, is_async=True)
        if both_b:
            acc2 = warpgroup_mma(a, b2, acc2, use_acc=k > 0, is_async=True)
            acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        ring.release_previous(step, spec, pred=k > 0)
        step += 1
    if both_b:
        acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    ring.release(step - 1, spec)
    return acc, acc2, step


@gluon.jit
def _issue_block(ring, step, into, spec, WARPGROUP: gl.constexpr):
    """Blockwise fp8: the MMAs of K block ``step`` (asynchronous), overwriting ``into``, a
    fragment already promoted: the partial product takes its registers."""
    a, b, _ = ring.acquire(step, spec, WARPGROUP=WARPGROUP)
    return warpgroup_mma(a, b, into, use_acc=False, is_async=True)


@gluon.jit
def _promote(acc, part, scale, in_flight, ring, step, spec):
    """Wait for K block ``step``'s partial product while ``in_flight``, the next block's,
    may still run; release the block's stage and add the partial into ``acc`` scaled.
    Returns the partial (its registers take a later block's MMA) and ``in_flight`` as the
    wait hands it on, which keeps it in its registers across the loop."""
    done, in_flight = warpgroup_mma_wait(num_outstanding=1, deps=(part, in_flight))
    ring.release(step, spec)
    acc = acc + done * scale[:, None]
    # A second wait (nothing left to wait for) takes the promoted accumulator: the
    # compiler may not sink the promotion past the next MMA's issue, which would keep
    # the partial alive under it and make it copy the partial's registers first.
    acc, in_flight = warpgroup_mma_wait(num_outstanding=1, deps=(acc, in_flight))
    return acc, done, in_flight


@gluon.jit
def _promoted_chunk(acc, spare, first_spare, ring, step, a_scales, b_scales, live, k0, spec,
                    BLOCKS: gl.constexpr, WARPGROUP: gl.constexpr):
    """K blocks ``k0 .. k0 + BLOCKS`` of blockwise fp8, unrolled: block ``j + 1``'s MMA is
    issued before block ``j`` is promoted, and the last one waited for. ``spare`` and
    ``first_spare``: promoted fragments whose registers the partials take (returned again,
    promoted, for the next chunk)."""
    part = _issue_block(ring, step + k0, first_spare, spec, WARPGROUP=WARPGROUP)
    scale = gl.load(a_scales + k0, mask=live, other=0.0) * gl.load(b_scales + k0)
    for j in gl.static_range(1, BLOCKS):
        following = _issue_block(ring, step + k0 + j, spare, spec, WARPGROUP=WARPGROUP)
        # Block k0 + j's scales load while its MMA runs.
        following_scale = gl.load(a_scales + k0 + j, mask=live, other=0.0) * gl.load(b_scales + k0 + j)
        acc, spare, following = _promote(acc, part, scale, following, ring, step + k0 + j - 1, spec)
        part = following
        scale = following_scale
    done = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
    ring.release(step + k0 + BLOCKS - 1, spec)
    return acc + done * scale[:, None], spare, done


@gluon.jit
def promoted_mainloop(ring, step, acc, a_scale, b_scale, expert, row0, row_end, n0, spec,
                       WARPGROUP: gl.constexpr):
    """Blockwise fp8: ``acc = sum_k (A_k B_k^T) * a_scale[:, k] * b_scale[k]`` over the
    tile's 128-deep K blocks. ``a_scale [rows, K / 128]``, ``b_scale [experts, N / 128,
    K / 128]`` fp32 (the warpgroup's own B's with ``split_b``); the tile lies inside one
    128-row block of B, so its B scale is one number per K block.

    The blocks go in unrolled chunks of ``promote_chunk``: inside one, each block's
    partial is promoted while the next block's MMA runs (two partials alternate, each MMA
    writing over the registers of one already promoted); a chunk's last block is waited
    for. No MMA is in flight across the loop over chunks: ptxas serializes every wgmma of
    a kernel where a partial in flight crosses a loop's back edge, or where another
    instruction touches an accumulator in flight (a copy of one, the zeroing of one)."""
    k_blocks: gl.constexpr = spec.k // spec.block_k
    chunk: gl.constexpr = spec.promote_chunk
    first: gl.constexpr = 0 if spec.split_b else WARPGROUP * MMA_ROWS  # the warpgroup's first row of the tile
    rows = row0 + first + gl.arange(0, MMA_ROWS, layout=gl.SliceLayout(1, acc.type.layout))
    live = rows < row_end  # rows past the expert's: scale 0 (never stored)
    a_scales = a_scale + rows.to(gl.int64) * k_blocks
    b_scales = b_scale + (expert * (spec.n // spec.scale_n) + n0 // spec.scale_n).to(gl.int64) * k_blocks
    spare = gl.zeros_like(acc)
    first_spare = gl.zeros_like(acc)
    for k0 in range(0, k_blocks - k_blocks % chunk, chunk):
        acc, spare, first_spare = _promoted_chunk(acc, spare, first_spare, ring, step, a_scales, b_scales, live, k0,
                                                  spec, BLOCKS=chunk, WARPGROUP=WARPGROUP)
    if k_blocks % chunk > 0:
        acc, _, _ = _promoted_chunk(acc, spare, first_spare, ring, step, a_scales, b_scales, live,
                                    k_blocks - k_blocks % chunk, spec, BLOCKS=k_blocks % chunk,
                                    WARPGROUP=WARPGROUP)
    return acc, step + k_blocks


@gluon.jit
def one_b_mainloop(ring, step, a_scale, b_scale, expert, row0, row_end, n0, spec, WARPGROUP: gl.constexpr):
    """``acc = A B^T`` of one warpgroup over a tile with one B (or its own, ``split_b``):
    ``promoted_mainloop`` for blockwise fp8, ``mainloop`` else. Returns it and the next
    step."""
    layout: gl.constexpr = mma_layout(spec.block_n, ring.a.dtype.primitive_bitwidth)
    acc = gl.zeros((MMA_ROWS, spec.block_n), gl.float32, layout)
    if spec.scale_k > 0:
        acc, step = promoted_mainloop(ring, step, acc, a_scale, b_scale, expert, row0, row_end, n0, spec,
                                      WARPGROUP=WARPGROUP)
    else:
        acc, _, step = mainloop(ring, step, acc, acc, spec, WARPGROUP=WARPGROUP)
    return acc, step


@gluon.jit
def mma_partition(ring, tiles, a_scale, b_scale, out, row_origin, out_ptrs, rank, rows_per_rank, spec,
                  WARPGROUP: gl.constexpr):
    """Consumer warpgroup ``WARPGROUP``: for each of the program's tiles, the mainloop over
    its 64 rows, then the spec's epilogue on them (stored where ``row_starts`` says)."""
    layout: gl.constexpr = mma_layout(spec.block_n, ring.a.dtype.primitive_bitwidth)
    out_layout: gl.constexpr = store_layout(spec.block_n, MMA_WARPS)
    if spec.scale_k > 0:
        gl.static_assert(spec.scale_k == spec.block_k, "blockwise fp8 takes one 128-deep scale block per K step")
        gl.static_assert(spec.scale_n % spec.block_n == 0, "a blockwise tile lies inside one weight scale block")
        gl.static_assert(spec.b_k_major and not spec.two_b, "blockwise fp8 takes one K-major B")
    step = 0
    for t in range(gl.program_id(0), tiles.count(spec), gl.num_programs(0)):
        expert, row0, row_end, n0 = tiles.tile(t, spec, WARPS=MMA_WARPS)
        rows = row0 + WARPGROUP * MMA_ROWS + gl.arange(0, MMA_ROWS, layout=gl.SliceLayout(1, out_layout))
        live = rows < row_end
        # The rows' origins load under the mainloop's MMAs; their 64-bit destinations,
        # formed after it (from a few cached words), would hold registers across it.
        origin = row_origins(rows, live, row_origin, spec.combine)
        acc = gl.zeros((MMA_ROWS, spec.block_n), gl.float32, layout)
        if spec.scale_k > 0:
            acc, step = promoted_mainloop(ring, step, acc, a_scale, b_scale, expert, row0, row_end, n0, spec,
                                           WARPGROUP=WARPGROUP)
            acc2 = acc
        else:
            acc, acc2, step = mainloop(ring, step, acc, acc, spec, WARPGROUP=WARPGROUP)
        dest = row_starts(origin, live, out, out_ptrs, rank, rows_per_rank, N=spec.n, COMBINE=spec.combine)
        spec.epilogue(acc, acc2, out, dest, live, n0)


@gluon.jit
def swiglu_grad_mma_partition(ring, tiles, a_scale, b_scale, staging, outs, dab_q, dab_scales, virtual_end, spec,
                              WARPGROUP: gl.constexpr):
    """Consumer warpgroup ``WARPGROUP`` of the backward's first GEMM: for each tile of the
    blocks below virtual row ``virtual_end``, ``d = dy W2`` over its 64 rows (one B,
    ``mainloop`` or ``promoted_mainloop``), then the SwiGLU backward on them
    (``epilogue.swiglu_backward_rows``, through the warpgroup's ``staging``) where they lie
    below ``virtual_end`` (past it, where a block straddles it, another kernel owns them)."""
    n_tiles: gl.constexpr = spec.n // spec.block_n
    gl.static_assert(not spec.two_b, "one B: W2 per expert")
    step = 0
    for t in range(gl.program_id(0), tiles.count_below(virtual_end, spec), gl.num_programs(0)):
        expert, row0, row_end, n0 = tiles.tile(t, spec, WARPS=MMA_WARPS)
        acc, step = one_b_mainloop(ring, step, a_scale, b_scale, expert, row0, row_end, n0, spec, WARPGROUP=WARPGROUP)
        if (t // n_tiles) * spec.block_m + WARPGROUP * MMA_ROWS < virtual_end:
            swiglu_backward_rows(acc, staging.index(WARPGROUP), outs, dab_q, dab_scales, row0 + WARPGROUP * MMA_ROWS,
                                 row_end, n0)


@gluon.jit
def gate_up_mma_partition(ring, tiles, a_scale, b_scale, staging, handoff, outs, h_scales, preact, tile_count, spec,
                          WARPGROUP: gl.constexpr):
    """Consumer warpgroup ``WARPGROUP`` of GEMM1 (``split_b``): per tile, its 64 rows times
    its own weight (warpgroup 0 the gate's W1, 1 the up projection's W3; ``b_scale`` that
    weight's), then the hand-over through ``staging [2, 64, BLOCK_N]`` fp32 and the two
    ``handoff`` mbarriers (``UP_READY``, ``STAGING_FREE``): warpgroup 1 waits until the
    staging buffers are free, stores its accumulator and arrives on UP_READY, then goes on
    to its next tile's MMAs; warpgroup 0 stores its own, waits on UP_READY, runs the
    epilogue (``epilogue.gate_up_rows``) and arrives on STAGING_FREE. Tiles whose rows all
    lie past their expert's are skipped, as the load warp skips them."""
    gl.static_assert(spec.two_b and spec.split_b, "each warpgroup multiplies by its own weight")
    step = 0
    handed = 0  # tiles handed over so far: the handoff barriers' phase
    for t in range(gl.program_id(0), tile_count, gl.num_programs(0)):
        expert, row0, row_end, n0 = tiles.tile(t, spec, WARPS=MMA_WARPS)
        if row0 < row_end:
            acc, step = one_b_mainloop(ring, step, a_scale, b_scale, expert, row0, row_end, n0, spec,
                                       WARPGROUP=WARPGROUP)
            phase = handed & 1
            if WARPGROUP == 1:
                mbarrier.wait(handoff.index(STAGING_FREE), phase ^ 1)  # a fresh barrier counts as released
                staging.index(1).store(acc)
                thread_barrier()
                mbarrier.arrive(handoff.index(UP_READY))
            else:
                staging.index(0).store(acc)
                thread_barrier()
                mbarrier.wait(handoff.index(UP_READY), phase)
                gate_up_rows(staging, outs, h_scales, preact, row0, row_end, n0)
                thread_barrier()
                mbarrier.arrive(handoff.index(STAGING_FREE))
            handed += 1


@gluon.jit
def gate_up_pair_mma_partition(ring, tiles, outs, preact, tile_count, spec, WARPGROUP: gl.constexpr):
    """Consumer warpgroup ``WARPGROUP`` of GEMM1 in bf16: per 128-row tile, its own 64 rows
    times both weights (``mainloop`` with two B's: two 64 x 128 accumulators, which bf16's
    unscaled MMAs leave room for), then ``epilogue.gate_up_pair_rows`` from its registers.
    Each warpgroup forms its own rows, so neither waits for the other's epilogue."""
    gl.static_assert(spec.two_b and not spec.split_b and spec.scale_k == 0,
                     "unscaled operands, both weights per warpgroup")
    layout: gl.constexpr = mma_layout(spec.block_n, ring.a.dtype.primitive_bitwidth)
    step = 0
    for t in range(gl.program_id(0), tile_count, gl.num_programs(0)):
        expert, row0, row_end, n0 = tiles.tile(t, spec, WARPS=MMA_WARPS)
        if row0 < row_end:
            acc = gl.zeros((MMA_ROWS, spec.block_n), gl.float32, layout)
            g, u, step = mainloop(ring, step, acc, acc, spec, WARPGROUP=WARPGROUP)
            gate_up_pair_rows(g, u, outs, preact, row0 + WARPGROUP * MMA_ROWS, row_end, n0)


@gluon.jit
def _token_block_mainloop(ring, step, acc, a_scales, b_scales, rows, cols, blocks, spec, WARPGROUP: gl.constexpr):
    """A GEMM grouped along K: ``acc = sum_j (A_j B_j^T) * a_scales[j, rows][:, None] *
    b_scales[j, cols][None, :]`` over ``blocks`` token blocks (``a_scales``, ``b_scales``:
    the block-major scales from the expert's first block; ``rows`` and ``cols`` offsets
    into a block's row of them). Each block's MMA is waited for before its promotion: the
    column scales (``BLOCK_N / 4`` per thread) beside the accumulator and the partial leave
    no registers for a second partial in flight, so the other warpgroup's MMAs are what
    runs under a promotion. A block's scales load one block ahead: one MMA is shorter than
    a load's latency."""
    part = gl.zeros_like(acc)
    a_next = gl.load(a_scales + rows)
    b_next = gl.load(b_scales + cols)
    for j in range(blocks):
        a, b, _ = ring.acquire(step, spec, WARPGROUP=WARPGROUP)
        part = warpgroup_mma(a, b, part, use_acc=False, is_async=True)
        a_block = a_next
        b_block = b_next
        ahead = gl.minimum(j + 1, blocks - 1)  # the last block loads its own again: in bounds
        a_next = gl.load(a_scales + ahead * spec.m + rows)
        b_next = gl.load(b_scales + ahead * spec.n + cols)
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        ring.release(step, spec)
        acc = acc + part * a_block[:, None] * b_block[None, :]
        step += 1
    return acc, step


@gluon.jit
def token_block_mma_partition(ring, tiles, a_scale, b_scale, out_desc, out2_desc, staging, spec,
                              WARPGROUP: gl.constexpr):
    """Consumer warpgroup ``WARPGROUP`` of a GEMM grouped along K (``TokenBlockTiles``): per
    tile, its 64 rows over the expert's token blocks, stored into the expert's output
    (``out [experts * M, N]``, or split at ``spec.split_m`` into ``out`` and ``out2``, each
    through its TMA descriptor) from ``staging`` (the warpgroup's ``[64, BLOCK_N]`` shared
    memory in the output's dtype): the store runs while the next tile's MMAs do, and is
    waited for only before the buffer is written again. The scales are block-major,
    ``[token blocks, M]`` and ``[token blocks, N]`` fp32, so a block's scales of a tile are
    one contiguous run; a tile of an expert without token blocks stores zeros. A tile's
    expert and token range load under the previous tile's MMAs: with a few token blocks per
    tile their latency would otherwise stall every tile."""
    layout: gl.constexpr = mma_layout(spec.block_n, ring.a.dtype.primitive_bitwidth)
    rows = WARPGROUP * MMA_ROWS + gl.arange(0, MMA_ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, spec.block_n, layout=gl.SliceLayout(0, layout))
    count = tiles.count(spec)
    last = gl.maximum(count - 1, 0)
    expert, m0, n0, first, blocks = tiles.tile(gl.minimum(gl.program_id(0), last), spec)
    step = 0
    for t in range(gl.program_id(0), count, gl.num_programs(0)):
        following = tiles.tile(gl.minimum(t + gl.num_programs(0), last), spec)
        acc = gl.zeros((MMA_ROWS, spec.block_n), gl.float32, layout)
        if blocks > 0:
            acc, step = _token_block_mainloop(ring, step, acc, a_scale + (first.to(gl.int64) * spec.m + m0),
                                              b_scale + (first.to(gl.int64) * spec.n + n0), rows, cols, blocks,
                                              spec, WARPGROUP=WARPGROUP)
        tma.store_wait(0)  # the previous tile's store has read the buffer (a no-op in other threads) ...
        thread_barrier()  # ... before any thread writes it
        staging.store(acc.to(staging.dtype))
        fence_async_shared()
        thread_barrier()
        row = m0 + WARPGROUP * MMA_ROWS
        if spec.split_m > 0:
            if m0 >= spec.split_m:
                tma_store(out2_desc, [expert * (spec.m - spec.split_m) + row - spec.split_m, n0], staging)
            else:
                tma_store(out_desc, [expert * spec.split_m + row, n0], staging)
        else:
            tma_store(out_desc, [expert * spec.m + row, n0], staging)
        expert, m0, n0, first, blocks = following
    tma.store_wait(0)

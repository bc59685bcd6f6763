"""Routing layout: where every routed row goes, computed on the device, no host sync.

Input: this rank's expert ids (``ids``, ``num_rows`` of them), the order that sorts them
with ids outside ``[0, E)`` clamped to -1 or E (``order``), ``send_start[e]`` ..
``send_start[e+1]``, its rows for expert ``e`` in that order, and whether this rank needs
its expert inputs sent (``forward.sort_rows`` computes the first two once per forward). An id outside
``[0, E)`` leaves rows outside ``send_start[0] .. send_start[E]``: the kernel then fails
the call on every rank (``sync``), naming the id, before publishing anything. Otherwise it exchanges the
counts with every peer (see ``sync``), so each rank holds the full matrix
``COUNTS[source, expert]`` and derives the same receive layout for every owner:

- the owner's receive buffer is expert-major; each local expert's rows start on a
  ``BLOCK_M`` boundary (``local_base``) so a GEMM tile never spans two experts;
- inside one expert, rows are ordered by source rank, and inside one source in the
  source's sorted order (token, then slot).

Outputs (int32 unless noted):
    dest_start[e]     first row of my rows for expert e in its owner's receive buffer
    item_start[o]     first dispatch item of expert e in dispatch order o = le * ep + r
                      (e = r * E_local + le): every owner gets its expert 0 first
    local_base[le]    first row of my local expert le in my receive buffer
    local_rows[le]    rows I receive for le; also written as int64 to tokens_per_expert
    src_offset[s, le] first row from source s inside expert le's rows
    src_rows[s, le]   rows source s sends me for le
    state[NUM_BLOCKS], state[NUM_ITEMS], state[TIMEOUT_NS]; resets the tile counters of
    this call
"""

import triton
import triton.language as tl

from titan_megamoe.kernels.sync import (
    BAD_EXPERT_ID,
    COUNT_READY_TIMEOUT,
    EPOCH,
    GEMM1_NEXT_TILE,
    GEMM2_FINISHED,
    NUM_BLOCKS,
    NUM_ITEMS,
    RECOMPUTE_NEXT_TILE,
    TIMEOUT_NS,
    fail,
    peer_pointer,
    wait_all,
)


@triton.jit
def layout_kernel(
    order,
    ids,
    num_rows,
    send_start,
    flags,
    flag_ptrs,
    state,
    dest_start,
    item_start,
    local_base,
    local_rows,
    src_offset,
    src_rows,
    tokens_per_expert,
    rank,
    ep,
    local_experts,
    needs_input,
    timeout_ns,
    COUNTS: tl.constexpr,
    COUNT_READY: tl.constexpr,
    NEEDS_INPUT: tl.constexpr,
    EP_PAD: tl.constexpr,
    LOCAL_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    epoch = tl.load(state + EPOCH) + 1
    tl.store(state + EPOCH, epoch)
    tl.store(state + TIMEOUT_NS, timeout_ns)
    tl.store(state + GEMM1_NEXT_TILE, 0)
    tl.store(state + RECOMPUTE_NEXT_TILE, 0)
    tl.store(state + GEMM2_FINISHED, 0)
    num_experts = ep * local_experts

    below = tl.load(send_start)  # ids < 0
    in_range = tl.load(send_start + num_experts)  # ids < E
    if (below != 0) | (in_range != num_rows):
        # Report the first bad row in sorted order: a negative id, else the largest id.
        at = tl.where(below != 0, 0, num_rows - 1)
        fail(BAD_EXPERT_ID, at, tl.load(ids + tl.load(order + at)).to(tl.int64), num_experts,
             flags, flag_ptrs, state, rank, ep)

    # My counts, [owner r, local expert le] with global expert e = r * E_local + le.
    r = tl.arange(0, EP_PAD)[:, None]
    le = tl.arange(0, LOCAL_PAD)[None, :]
    valid = (r < ep) & (le < local_experts)
    e = r * local_experts + le
    sent = tl.load(send_start + e + 1, mask=valid, other=0) - tl.load(send_start + e, mask=valid, other=0)

    for peer in range(ep):
        peer_flags = peer_pointer(flags, flag_ptrs, peer, rank)
        tl.store(peer_flags + COUNTS + rank * num_experts + e, sent, mask=valid)
        tl.store(peer_flags + NEEDS_INPUT + rank, needs_input)
    tl.debug_barrier()
    for peer in range(ep):
        peer_flags = peer_pointer(flags, flag_ptrs, peer, rank)
        tl.atomic_xchg(peer_flags + COUNT_READY + rank, epoch, sem="release", scope="sys")
    sources = tl.arange(0, EP_PAD)
    wait_all(flags + COUNT_READY + sources, sources, sources < ep, epoch, COUNT_READY_TIMEOUT,
             flags, flag_ptrs, state, rank, ep, EP_PAD)
    tl.debug_barrier()

    # counts[s, r, le]: rows source s routes to owner r's local expert le.
    s3 = tl.arange(0, EP_PAD)[:, None, None]
    r3 = tl.arange(0, EP_PAD)[None, :, None]
    le3 = tl.arange(0, LOCAL_PAD)[None, None, :]
    valid3 = (s3 < ep) & (r3 < ep) & (le3 < local_experts)
    counts = tl.load(
        flags + COUNTS + s3 * num_experts + r3 * local_experts + le3, mask=valid3, other=0, volatile=True
    )
    rows = tl.sum(counts, axis=0)  # [r, le]
    padded = (rows + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    base = tl.cumsum(padded, axis=1) - padded
    offset = tl.cumsum(counts, axis=0) - counts  # [s, r, le]
    my_offset = tl.sum(tl.where(s3 == rank, offset, 0), axis=0)
    tl.store(dest_start + e, base + my_offset, mask=valid)

    # Dispatch items: chunks of <= BLOCK_M of my rows for one expert, in order le-major.
    chunks = (sent + BLOCK_M - 1) // BLOCK_M
    per_expert = tl.sum(chunks, axis=0)
    before = (tl.cumsum(per_expert, axis=0) - per_expert)[None, :] + tl.cumsum(chunks, axis=0) - chunks
    tl.store(item_start + le * ep + r, before, mask=valid)
    tl.store(state + NUM_ITEMS, tl.sum(tl.sum(chunks, axis=1), axis=0))

    # What I receive, as the owner.
    lane = tl.arange(0, LOCAL_PAD)
    mine = lane < local_experts
    owner = r == rank
    my_rows = tl.sum(tl.where(owner, rows, 0), axis=0)
    tl.store(local_base + lane, tl.sum(tl.where(owner, base, 0), axis=0), mask=mine)
    tl.store(local_rows + lane, my_rows, mask=mine)
    tl.store(tokens_per_expert + lane, my_rows.to(tl.int64), mask=mine)
    tl.store(state + NUM_BLOCKS, tl.sum(tl.sum(tl.where(owner, padded, 0), axis=1), axis=0) // BLOCK_M)
    s2 = tl.arange(0, EP_PAD)[:, None]
    from_s = (s2 < ep) & (le < local_experts)
    owner3 = r3 == rank
    tl.store(src_offset + s2 * local_experts + le, tl.sum(tl.where(owner3, offset, 0), axis=1), mask=from_s)
    tl.store(src_rows + s2 * local_experts + le, tl.sum(tl.where(owner3, counts, 0), axis=1), mask=from_s)


@triton.jit
def expert_of_row(local_base, local_experts, row, LOCAL_PAD: tl.constexpr):
    """The local expert whose (block-aligned) rows contain ``row``."""
    lane = tl.arange(0, LOCAL_PAD)
    base = tl.load(local_base + lane, mask=lane < local_experts, other=2147483647)
    return tl.sum((base <= row).to(tl.int32)) - 1

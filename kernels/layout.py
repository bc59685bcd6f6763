"""Routing layout: where every routed row goes, computed on the device, no host sync.

Input: this rank's expert ids (``ids``, ``num_rows`` of them), the order that sorts them
with ids outside ``[0, E)`` clamped to -1 or E (``order``), ``send_start[e]`` ..
``send_start[e+1]``, its rows for expert ``e`` in that order, and whether this rank needs
its expert inputs sent (``forward.sort_rows`` computes the first two once per forward). An id outside
``[0, E)`` leaves rows outside ``send_start[0] .. send_start[E]``, which no item sends.
The kernel exchanges the counts, and this rank's first bad id if any, with every peer
(see ``sync``), so each rank holds the full matrix ``COUNTS[source, expert]`` and derives
the same receive layout for every owner:

- the owner's receive buffer is expert-major; each local expert's rows start on a
  multiple of ``ROW_ALIGN`` rows (``local_base``), padded to it, not to a whole tile;
- inside one expert, rows are ordered by source rank, and inside one source in the
  source's sorted order (token, then slot).

Where the most rows any rank receives (each local expert's aligned) exceed
``capacity_rows``, what the receive buffers hold, the call cannot run as laid out; every
rank finds so from the same counts. ``skip_overflow`` (a forward's first run): the layout
publishes no work (no dispatch items, no tiles), so the call's kernels pass through their
barriers without touching a receive buffer, and the host grows the buffers and runs the
call again (``ForwardBuffers.grow_to_fit``). Otherwise the call fails on every rank
(``RECEIVE_OVERFLOW``). Where any rank has a bad id, every rank publishes no work either,
and records the id (``BAD_EXPERT_ID``) for the host to raise.

Tiles are scheduled in a second, virtual row space (``block_base``) where each local
expert's rows are padded to whole ``BLOCK_M`` blocks, so that a tile index names one
expert and a tile never spans two: ``tile_rows`` maps a virtual tile to its expert and to
its first row in the receive buffer. A tile that ends past its expert's last row reads the
next expert's rows (or the buffer's slack past the last expert) and masks them out of
every store; only the padding up to ``ROW_ALIGN`` belongs to the expert.

Outputs (int32 unless noted):
    dest_start[e]     first row of my rows for expert e in its owner's receive buffer
    item_start[o]     first dispatch item of expert e in dispatch order o = le * ep + r
                      (e = r * E_local + le): every owner gets its expert 0 first
    local_base[le]    first row of my local expert le in my receive buffer
    block_base[le]    first virtual row of le's tiles (a multiple of BLOCK_M)
    local_rows[le]    rows I receive for le; also written as int64 to tokens_per_expert
    src_offset[s, le] first row from source s inside expert le's rows
    src_rows[s, le]   rows source s sends me for le
    the received-rows record's slot of ``call`` (``sync``): the rows I receive, each
    local expert's padded to ROW_ALIGN, the most any rank receives so, the call's status
    (a bad id), and local_rows
    state[NUM_BLOCKS] (virtual blocks), state[NUM_ITEMS] (both 0 when the rows overflow
    or an id is bad),
    state[TIMEOUT_NS]; resets the tile counters of this call
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
    RECEIVE_OVERFLOW,
    RECEIVED_ADDR,
    RECEIVED_BAD_ID,
    RECEIVED_BAD_RANK,
    RECEIVED_BAD_SLOT,
    RECEIVED_CALL,
    RECEIVED_COUNTS,
    RECEIVED_MOST,
    RECEIVED_ROWS,
    RECEIVED_SLOTS,
    RECEIVED_STATUS,
    RECOMPUTE_NEXT_TILE,
    TIMEOUT_NS,
    fail,
    peer_pointer,
    wait_all,
)


# One binary for every call: a kernel first loaded mid-run can wait for the GPU to go idle
# (CUDA's lazy loading), which peers' spinning kernels may never let happen.
@triton.jit(do_not_specialize=["needs_input", "call", "capacity_rows", "skip_overflow"])
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
    block_base,
    local_rows,
    src_offset,
    src_rows,
    tokens_per_expert,
    rank,
    ep,
    local_experts,
    needs_input,
    timeout_ns,
    call,
    capacity_rows,
    skip_overflow,
    COUNTS: tl.constexpr,
    COUNT_READY: tl.constexpr,
    NEEDS_INPUT: tl.constexpr,
    BAD_IDS: tl.constexpr,
    EP_PAD: tl.constexpr,
    LOCAL_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):
    epoch = tl.load(state + EPOCH) + 1
    tl.store(state + EPOCH, epoch)
    tl.store(state + TIMEOUT_NS, timeout_ns)
    tl.store(state + GEMM1_NEXT_TILE, 0)
    tl.store(state + RECOMPUTE_NEXT_TILE, 0)
    tl.store(state + GEMM2_FINISHED, 0)
    num_experts = ep * local_experts

    # Ids below 0 sort first, ids from E on last (stably: in token order among themselves).
    # This rank's first bad id: its first negative one, else its first one too large.
    below = tl.load(send_start)
    valid_end = tl.load(send_start + num_experts)
    has_bad = (below != 0) | (valid_end != num_rows)
    bad_slot = tl.load(order + tl.where(below != 0, 0, valid_end), mask=has_bad, other=-1)
    bad_id = tl.load(ids + bad_slot, mask=has_bad, other=0).to(tl.int64)

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
        tl.store(peer_flags + BAD_IDS + 2 * rank, (bad_slot + 1).to(tl.int64))
        tl.store(peer_flags + BAD_IDS + 2 * rank + 1, bad_id)
    tl.debug_barrier()
    for peer in range(ep):
        peer_flags = peer_pointer(flags, flag_ptrs, peer, rank)
        tl.atomic_xchg(peer_flags + COUNT_READY + rank, epoch, sem="release", scope="sys")
    sources = tl.arange(0, EP_PAD)
    wait_all(flags + COUNT_READY + sources, sources, sources < ep, epoch, COUNT_READY_TIMEOUT,
             flags, flag_ptrs, state, rank, ep, EP_PAD)
    tl.debug_barrier()

    # Every rank reads the same bad ids: the first source's first one is the call's.
    bad_slots = tl.load(flags + BAD_IDS + 2 * sources, mask=sources < ep, other=0, volatile=True)
    bad = tl.max(bad_slots, axis=0) > 0
    culprit = tl.min(tl.where(bad_slots > 0, sources, EP_PAD), axis=0)
    culprit_slot = tl.max(tl.where(sources == culprit, bad_slots, 0), axis=0) - 1
    culprit_id = tl.load(flags + BAD_IDS + 2 * culprit + 1, mask=bad, other=0, volatile=True)
    received = tl.load(state + RECEIVED_ADDR).to(tl.pointer_type(tl.int64)) + (
        call % RECEIVED_SLOTS) * (RECEIVED_COUNTS + local_experts)
    tl.store(received + RECEIVED_STATUS, tl.where(bad, BAD_EXPERT_ID, 0).to(tl.int64))
    tl.store(received + RECEIVED_BAD_RANK, culprit.to(tl.int64), mask=bad)
    tl.store(received + RECEIVED_BAD_SLOT, culprit_slot.to(tl.int64), mask=bad)
    tl.store(received + RECEIVED_BAD_ID, culprit_id, mask=bad)

    # counts[s, r, le]: rows source s routes to owner r's local expert le.
    s3 = tl.arange(0, EP_PAD)[:, None, None]
    r3 = tl.arange(0, EP_PAD)[None, :, None]
    le3 = tl.arange(0, LOCAL_PAD)[None, None, :]
    valid3 = (s3 < ep) & (r3 < ep) & (le3 < local_experts)
    counts = tl.load(
        flags + COUNTS + s3 * num_experts + r3 * local_experts + le3, mask=valid3, other=0, volatile=True
    )
    rows = tl.sum(counts, axis=0)  # [r, le]
    aligned = (rows + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    per_owner = tl.sum(aligned, axis=1)  # [r]
    most = tl.max(per_owner, axis=0)
    # Every rank derives the same verdicts from the same counts and ids.
    overflow = most > capacity_rows
    if overflow & (skip_overflow == 0) & (bad == 0):
        fail(RECEIVE_OVERFLOW, tl.argmax(per_owner, axis=0), most.to(tl.int64), capacity_rows,
             flags, flag_ptrs, state, rank, ep)
    no_work = overflow | bad
    base = tl.cumsum(aligned, axis=1) - aligned
    padded = (rows + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    virtual_base = tl.cumsum(padded, axis=1) - padded
    offset = tl.cumsum(counts, axis=0) - counts  # [s, r, le]
    my_offset = tl.sum(tl.where(s3 == rank, offset, 0), axis=0)
    tl.store(dest_start + e, base + my_offset, mask=valid)

    # Dispatch items: chunks of <= BLOCK_M of my rows for one expert, in order le-major.
    chunks = (sent + BLOCK_M - 1) // BLOCK_M
    per_expert = tl.sum(chunks, axis=0)
    before = (tl.cumsum(per_expert, axis=0) - per_expert)[None, :] + tl.cumsum(chunks, axis=0) - chunks
    tl.store(item_start + le * ep + r, before, mask=valid)
    tl.store(state + NUM_ITEMS, tl.where(no_work, 0, tl.sum(tl.sum(chunks, axis=1), axis=0)))

    # What I receive, as the owner.
    lane = tl.arange(0, LOCAL_PAD)
    mine = lane < local_experts
    owner = r == rank
    my_rows = tl.sum(tl.where(owner, rows, 0), axis=0)
    tl.store(local_base + lane, tl.sum(tl.where(owner, base, 0), axis=0), mask=mine)
    tl.store(block_base + lane, tl.sum(tl.where(owner, virtual_base, 0), axis=0), mask=mine)
    tl.store(local_rows + lane, my_rows, mask=mine)
    tl.store(tokens_per_expert + lane, my_rows.to(tl.int64), mask=mine)
    tl.store(state + NUM_BLOCKS,
             tl.where(no_work, 0, tl.sum(tl.sum(tl.where(owner, padded, 0), axis=1), axis=0) // BLOCK_M))
    owners = tl.arange(0, EP_PAD)
    tl.store(received + RECEIVED_ROWS, tl.sum(tl.where(owners == rank, per_owner, 0), axis=0).to(tl.int64))
    tl.store(received + RECEIVED_MOST, most.to(tl.int64))
    tl.store(received + RECEIVED_COUNTS + lane, my_rows.to(tl.int64), mask=mine)
    tl.atomic_xchg(received + RECEIVED_CALL, call, sem="release", scope="sys")
    s2 = tl.arange(0, EP_PAD)[:, None]
    from_s = (s2 < ep) & (le < local_experts)
    owner3 = r3 == rank
    tl.store(src_offset + s2 * local_experts + le, tl.sum(tl.where(owner3, offset, 0), axis=1), mask=from_s)
    tl.store(src_rows + s2 * local_experts + le, tl.sum(tl.where(owner3, counts, 0), axis=1), mask=from_s)


@triton.jit
def expert_of_row(base, local_experts, row, LOCAL_PAD: tl.constexpr):
    """The local expert whose rows, in the space ``base`` (the receive buffer's
    ``local_base`` or the tiles' ``block_base``), contain ``row``: the last one starting at
    or before it (an expert without rows starts where the next one does)."""
    lane = tl.arange(0, LOCAL_PAD)
    starts = tl.load(base + lane, mask=lane < local_experts, other=2147483647)
    return tl.sum((starts <= row).to(tl.int32)) - 1


@triton.jit
def tile_rows(block_base, local_base, local_rows, local_experts, virtual_row, LOCAL_PAD: tl.constexpr):
    """``(le, base, end, row0)`` of the tile that starts at ``virtual_row`` (in its
    expert's ``BLOCK_M`` blocks): its local expert, the expert's first row and the end of
    its rows in the receive buffer, and the tile's first row there."""
    le = expert_of_row(block_base, local_experts, virtual_row, LOCAL_PAD)
    base = tl.load(local_base + le)
    return le, base, base + tl.load(local_rows + le), base + virtual_row - tl.load(block_base + le)


@triton.jit
def saved_tile_rows(block_base, local_base, local_rows, local_experts, saved_rows,
                    TILE_M: tl.constexpr, BLOCK_M: tl.constexpr, LOCAL_PAD: tl.constexpr):
    """The virtual rows (``tile_rows``) of the ``TILE_M``-row tiles whose rows all lie
    below row ``saved_rows`` of the receive buffer: every tile of the experts that end by
    then, the tiles of the next expert wholly below it, and none after (a prefix of the
    virtual rows, since experts follow one another in both spaces)."""
    lane = tl.arange(0, LOCAL_PAD)
    mine = lane < local_experts
    base = tl.load(local_base + lane, mask=mine, other=0)
    count = tl.load(local_rows + lane, mask=mine, other=0)
    whole = base + count <= saved_rows
    span = tl.where(whole, (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M,
                    tl.maximum(saved_rows - base, 0) // TILE_M * TILE_M)
    ends = tl.load(block_base + lane, mask=mine, other=0) + span
    return tl.max(tl.where(mine & (span > 0), ends, 0))

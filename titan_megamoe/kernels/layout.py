"""Routing layout: where every routed row goes, computed on the device, no host sync.

Input: this rank's expert ids (``ids``, ``num_rows`` of them), the order that sorts them
with ids outside ``[0, E)`` clamped to -1 or E (``order``), ``send_start[e]`` ..
``send_start[e+1]``, its rows for expert ``e`` in that order, and whether this rank needs
its expert inputs sent (``forward.sort_rows`` computes the first two once per forward). An id outside
``[0, E)`` leaves rows outside ``send_start[0] .. send_start[E]``, which no item sends.
Round 0 of a call exchanges the counts, and this rank's first bad id if any, with every
peer (see ``sync``), so each rank holds the full matrix ``COUNTS[source, expert]`` and
derives the same receive layout for every owner:

- the owner's *full* receive layout is expert-major; each local expert's rows start on a
  multiple of ``ROW_ALIGN`` rows, padded to it, not to a whole tile;
- inside one expert, rows are ordered by source rank, and inside one source in the
  source's sorted order (token, then slot).

The receive buffers hold a *window* of ``window`` rows (a multiple of ``ROW_ALIGN``) of
that layout: round ``r`` of the call lays out and moves its rows ``[r window, (r + 1)
window)``, each expert's share of them (a *piece*, which starts on an alignment: the
window's start or its expert's) at its place in the window, and each source's rows of
a piece as the contiguous range of its sorted rows that falls there (``send_first`` ..
``send_end``). Every rank derives the same ``rounds`` a call needs (the most rows an
owner receives over the window); rounds from there on publish no work and pass no
barrier, and a call whose rows need more rounds than the host launched (``rounds``) fails
(``RECEIVE_OVERFLOW``: the host launches enough for any routing). Where any rank has a
bad id, every rank poisons its buffers (``sync``) and publishes no work; a poisoned
round lays out no rows and exchanges nothing.

Tiles are scheduled in a second, virtual row space (``block_base``) where each local
expert's piece is padded to whole ``BLOCK_M`` blocks, so that a tile index names one
expert and a tile never spans two: ``tile_rows`` maps a virtual tile to its expert and to
its first row in the receive buffer. A tile that ends past its expert's last row reads the
next expert's rows (or the buffer's slack past the window) and masks them out of every
store; only the padding up to ``ROW_ALIGN`` belongs to the expert.

Outputs of a round (int32 unless noted):
    send_first[e], send_end[e]  the range of my sorted rows for expert e this round sends
    dest_start[e]     where the first of them lands in its owner's receive buffer
    item_start[o]     first dispatch item of expert e in dispatch order o = le * ep + r
                      (e = r * E_local + le): every owner gets its expert 0 first
    local_base[le]    first row of my local expert le's piece in my receive buffer
    block_base[le]    first virtual row of le's tiles (a multiple of BLOCK_M)
    local_rows[le]    rows of le's piece
    src_offset[s, le] first row from source s inside expert le's piece
    src_rows[s, le]   rows source s sends me for le this round
    tokens_per_expert (int64) the rows I receive for each local expert over the call
    round 0: the received-rows record's slot of ``call`` (``sync``): the rows I receive,
    each local expert's padded to ROW_ALIGN, the most any rank receives so, the call's
    status (a bad id), and each local expert's rows
    state[NUM_BLOCKS] (virtual blocks), state[NUM_ITEMS] (both 0 in an empty or poisoned
    round), state[LAST_ROWS_ROUND], state[PAST_SAVED] (round 0), state[TIMEOUT_NS];
    resets the tile counters of this round
"""

import triton
import triton.language as tl

from titan_megamoe.kernels.sync import (
    BAD_EXPERT_ID,
    COUNT_READY_TIMEOUT,
    EPOCH,
    GEMM1_NEXT_TILE,
    GEMM2_FINISHED,
    LAST_ROWS_ROUND,
    NUM_BLOCKS,
    NUM_ITEMS,
    PAST_SAVED,
    POISON_CALL,
    POISON_EPOCH,
    POISONED,
    RECEIVE_OVERFLOW,
    RECEIVED_ADDR,
    RECEIVED_BAD_ID,
    RECEIVED_BAD_RANK,
    RECEIVED_BAD_SLOT,
    RECEIVED_CALL,
    RECEIVED_COUNTS,
    RECEIVED_MOST,
    RECEIVED_ROWS,
    RECEIVED_STATUS,
    RECOMPUTE_NEXT_TILE,
    STATUS_ADDR,
    TIMEOUT_NS,
    fail,
    peer_pointer,
    ring_slot,
    wait_all,
)


@triton.jit
def _barrier(flags, flag_ptrs, state, rank, ep, epoch, COUNT_READY: tl.constexpr, EP_PAD: tl.constexpr):
    """Release my COUNT_READY on every peer (after the stores before it), then wait for
    every source's."""
    tl.debug_barrier()
    for peer in range(ep):
        tl.atomic_xchg(peer_pointer(flags, flag_ptrs, peer, rank) + COUNT_READY + rank, epoch,
                       sem="release", scope="sys")
    sources = tl.arange(0, EP_PAD)
    wait_all(flags + COUNT_READY + sources, sources, sources < ep, epoch, COUNT_READY_TIMEOUT,
             flags, flag_ptrs, state, rank, ep, EP_PAD)
    tl.debug_barrier()


@triton.jit
def _clamp(v, lo, hi):
    return tl.minimum(tl.maximum(v, lo), hi)


# One binary for every call: a kernel first loaded mid-run can wait for the GPU to go idle
# (CUDA's lazy loading), which peers' spinning kernels may never let happen.
@triton.jit(do_not_specialize=["num_rows", "needs_input", "call", "window", "round_index", "rounds", "saved_rows"])
def layout_kernel(
    order,
    ids,
    num_rows,
    send_start,
    flags,
    flag_ptrs,
    state,
    send_first,
    send_end,
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
    window,
    round_index,
    rounds,
    saved_rows,
    COUNTS: tl.constexpr,
    COUNT_READY: tl.constexpr,
    NEEDS_INPUT: tl.constexpr,
    BAD_IDS: tl.constexpr,
    EP_PAD: tl.constexpr,
    LOCAL_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):
    """Round ``round_index`` of ``rounds`` of host call ``call``. ``needs_input`` 0: the
    host found this rank's receive buffer holding the expert inputs of the forward being
    differentiated, which then are not sent again in round 0 if all of this rank's rows of
    that forward came in its round 0 (``LAST_ROWS_ROUND``). ``saved_rows``: rows of the
    forward's saved pre-activations (``PAST_SAVED``)."""
    epoch = tl.load(state + EPOCH) + 1
    poisoned = tl.load(state + POISONED)
    tl.store(state + EPOCH, epoch)
    tl.store(state + TIMEOUT_NS, timeout_ns)
    tl.store(state + GEMM1_NEXT_TILE, 0)
    tl.store(state + RECOMPUTE_NEXT_TILE, 0)
    tl.store(state + GEMM2_FINISHED, 0)
    live = poisoned == 0
    first_round = round_index == 0
    num_experts = ep * local_experts
    sources = tl.arange(0, EP_PAD)
    resident_round = tl.load(state + LAST_ROWS_ROUND)
    needs = ((needs_input != 0) | (resident_round != 0) | (round_index != 0)).to(tl.int64)

    # My counts, [owner o, local expert le] with global expert e = o * E_local + le.
    o = tl.arange(0, EP_PAD)[:, None]
    le = tl.arange(0, LOCAL_PAD)[None, :]
    valid = (o < ep) & (le < local_experts)
    e = o * local_experts + le
    first_sent = tl.load(send_start + e, mask=valid, other=0)
    sent = tl.load(send_start + e + 1, mask=valid, other=0) - first_sent

    bad = live & (live == 0)
    if live & first_round:
        # Ids below 0 sort first, ids from E on last (stably: in token order among themselves).
        # This rank's first bad id: its first negative one, else its first one too large.
        below = tl.load(send_start)
        valid_end = tl.load(send_start + num_experts)
        has_bad = (below != 0) | (valid_end != num_rows)
        bad_slot = tl.load(order + tl.where(below != 0, 0, valid_end), mask=has_bad, other=-1)
        bad_id = tl.load(ids + bad_slot, mask=has_bad, other=0).to(tl.int64)
        for peer in range(ep):
            peer_flags = peer_pointer(flags, flag_ptrs, peer, rank)
            tl.store(peer_flags + COUNTS + rank * num_experts + e, sent, mask=valid)
            tl.store(peer_flags + NEEDS_INPUT + rank, needs)
            tl.store(peer_flags + BAD_IDS + 2 * rank, (bad_slot + 1).to(tl.int64))
            tl.store(peer_flags + BAD_IDS + 2 * rank + 1, bad_id)
        _barrier(flags, flag_ptrs, state, rank, ep, epoch, COUNT_READY=COUNT_READY, EP_PAD=EP_PAD)
        # Every rank reads the same bad ids: the first source's first one is the call's.
        bad_slots = tl.load(flags + BAD_IDS + 2 * sources, mask=sources < ep, other=0, volatile=True)
        bad = tl.max(bad_slots, axis=0) > 0
        if bad:
            culprit = tl.min(tl.where(bad_slots > 0, sources, EP_PAD), axis=0)
            culprit_slot = tl.max(tl.where(sources == culprit, bad_slots, 0), axis=0) - 1
            culprit_id = tl.load(flags + BAD_IDS + 2 * culprit + 1, volatile=True)
            record = tl.load(state + RECEIVED_ADDR).to(tl.pointer_type(tl.int64)) + ring_slot(call) * (
                RECEIVED_COUNTS + local_experts)
            tl.store(record + RECEIVED_STATUS, tl.full((), BAD_EXPERT_ID, tl.int64))
            tl.store(record + RECEIVED_BAD_RANK, culprit.to(tl.int64))
            tl.store(record + RECEIVED_BAD_SLOT, culprit_slot.to(tl.int64))
            tl.store(record + RECEIVED_BAD_ID, culprit_id)
            tl.atomic_xchg(record + RECEIVED_CALL, call.to(tl.int64), sem="release", scope="sys")
            status = tl.load(state + STATUS_ADDR).to(tl.pointer_type(tl.int64))
            tl.store(status + POISON_CALL, call.to(tl.int64))
            tl.atomic_xchg(status + POISON_EPOCH, epoch, sem="release", scope="sys")
            tl.store(state + POISONED, epoch)
            live = live & (live == 0)

    # counts[s, o, le]: rows source s routes to owner o's local expert le (none if poisoned).
    s3 = tl.arange(0, EP_PAD)[:, None, None]
    o3 = tl.arange(0, EP_PAD)[None, :, None]
    le3 = tl.arange(0, LOCAL_PAD)[None, None, :]
    valid3 = (s3 < ep) & (o3 < ep) & (le3 < local_experts)
    counts = tl.load(flags + COUNTS + s3 * num_experts + o3 * local_experts + le3, mask=valid3, other=0,
                     volatile=True)
    counts = tl.where(live, counts, 0)
    rows = tl.sum(counts, axis=0)  # [o, le], over the call
    aligned = (rows + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    base = tl.cumsum(aligned, axis=1) - aligned  # in the owner's full layout
    per_owner = tl.sum(aligned, axis=1)  # [o]
    most = tl.max(per_owner, axis=0)
    # Every rank derives the same verdicts from the same counts.
    # In 32 bits: a 64-bit division calls a subroutine (rows per rank fit).
    needed = tl.maximum((most.to(tl.int32) + window - 1) // window, 1)
    if live & (needed > rounds):
        fail(RECEIVE_OVERFLOW, tl.argmax(per_owner, axis=0), most.to(tl.int64), rounds.to(tl.int64) * window,
             flags, flag_ptrs, state, rank, ep)
    in_use = live & (round_index < needed)
    if in_use & (round_index != 0):
        for peer in range(ep):
            tl.store(peer_pointer(flags, flag_ptrs, peer, rank) + NEEDS_INPUT + rank, needs)
        _barrier(flags, flag_ptrs, state, rank, ep, epoch, COUNT_READY=COUNT_READY, EP_PAD=EP_PAD)

    # The round's window of every owner's full layout.
    w_lo = round_index.to(tl.int64) * window
    w_hi = w_lo + window
    piece_lo = _clamp(base, w_lo, w_hi)
    piece_rows = _clamp(base + rows, w_lo, w_hi) - piece_lo
    padded = (piece_rows + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    virtual_base = tl.cumsum(padded, axis=1) - padded
    start3 = tl.expand_dims(base, 0) + tl.cumsum(counts, axis=0) - counts  # [s, o, le]: each source's first row
    lo3 = _clamp(start3, w_lo, w_hi)
    n3 = _clamp(start3 + counts, w_lo, w_hi) - lo3

    # What I send this round, per global expert: a contiguous range of my sorted rows.
    me3 = s3 == rank
    my_n = tl.sum(tl.where(me3, n3, 0), axis=0)  # [o, le]
    my_lo = tl.sum(tl.where(me3, lo3, 0), axis=0)
    skip = tl.where(my_n > 0, my_lo - tl.sum(tl.where(me3, start3, 0), axis=0), 0)
    tl.store(send_first + e, first_sent + skip, mask=valid)
    tl.store(send_end + e, first_sent + skip + my_n, mask=valid)
    tl.store(dest_start + e, my_lo - w_lo, mask=valid)

    # Dispatch items: chunks of <= BLOCK_M of my rows for one expert, in order le-major.
    chunks = (my_n + BLOCK_M - 1) // BLOCK_M
    per_expert = tl.sum(chunks, axis=0)
    before = (tl.cumsum(per_expert, axis=0) - per_expert)[None, :] + tl.cumsum(chunks, axis=0) - chunks
    tl.store(item_start + le * ep + o, before, mask=valid)
    tl.store(state + NUM_ITEMS, tl.sum(tl.sum(chunks, axis=1), axis=0))

    # What I receive, as the owner.
    lane = tl.arange(0, LOCAL_PAD)
    mine = lane < local_experts
    owner = o == rank
    my_pieces = tl.sum(tl.where(owner, piece_rows, 0), axis=0)
    tl.store(local_base + lane, tl.sum(tl.where(owner, piece_lo - w_lo, 0), axis=0), mask=mine)
    tl.store(block_base + lane, tl.sum(tl.where(owner, virtual_base, 0), axis=0), mask=mine)
    tl.store(local_rows + lane, my_pieces, mask=mine)
    tl.store(tokens_per_expert + lane, tl.sum(tl.where(owner, rows, 0), axis=0).to(tl.int64), mask=mine)
    tl.store(state + NUM_BLOCKS, tl.sum(tl.sum(tl.where(owner, padded, 0), axis=1), axis=0) // BLOCK_M)
    s2 = tl.arange(0, EP_PAD)[:, None]
    from_s = (s2 < ep) & (le < local_experts)
    owner3 = o3 == rank
    tl.store(src_offset + s2 * local_experts + le,
             tl.sum(tl.where(owner3, lo3 - tl.expand_dims(piece_lo, 0), 0), axis=1), mask=from_s)
    tl.store(src_rows + s2 * local_experts + le, tl.sum(tl.where(owner3, n3, 0), axis=1), mask=from_s)
    owners = tl.arange(0, EP_PAD)
    my_total = tl.sum(tl.where(owners == rank, per_owner, 0), axis=0)
    if first_round:
        tl.store(state + LAST_ROWS_ROUND, 0)
        tl.store(state + PAST_SAVED, (my_total > tl.minimum(saved_rows.to(tl.int64), window)).to(tl.int64))
    if tl.sum(my_pieces, axis=0) > 0:
        tl.store(state + LAST_ROWS_ROUND, round_index.to(tl.int64))
    if live & first_round:
        record = tl.load(state + RECEIVED_ADDR).to(tl.pointer_type(tl.int64)) + ring_slot(call) * (
            RECEIVED_COUNTS + local_experts)
        tl.store(record + RECEIVED_STATUS, 0)
        tl.store(record + RECEIVED_ROWS, my_total.to(tl.int64))
        tl.store(record + RECEIVED_MOST, most.to(tl.int64))
        tl.store(record + RECEIVED_COUNTS + lane, tl.sum(tl.where(owner, rows, 0), axis=0).to(tl.int64), mask=mine)
        tl.atomic_xchg(record + RECEIVED_CALL, call.to(tl.int64), sem="release", scope="sys")


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

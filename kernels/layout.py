"""Routing layout: where every routed row goes, computed on the device, no host sync.

Input: this rank's rows sorted by global expert (``send_start[e]`` .. ``send_start[e+1]``
are its rows for expert ``e``), and whether this rank needs its expert inputs sent. The
kernel exchanges both with every peer (see ``sync``), so each rank holds the full matrix
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
    state[NUM_BLOCKS], state[NUM_ITEMS]; resets the tile counters of this call
"""

import triton
import triton.language as tl

from titan_megamoe.kernels.sync import peer_pointer, wait_all

# Words of the per-rank ``state`` array (int32, local memory).
EPOCH = tl.constexpr(0)
NUM_BLOCKS = tl.constexpr(1)
NUM_ITEMS = tl.constexpr(2)
GEMM1_NEXT_TILE = tl.constexpr(3)
GEMM2_FINISHED = tl.constexpr(4)
STATE_WORDS = 8


@triton.jit
def layout_kernel(
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
    status_addr,
    rank,
    ep,
    local_experts,
    needs_input,
    max_spins,
    COUNTS: tl.constexpr,
    COUNT_READY: tl.constexpr,
    NEEDS_INPUT: tl.constexpr,
    EP_PAD: tl.constexpr,
    LOCAL_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    epoch = tl.load(state + EPOCH) + 1
    tl.store(state + EPOCH, epoch)
    tl.store(state + GEMM1_NEXT_TILE, 0)
    tl.store(state + GEMM2_FINISHED, 0)
    num_experts = ep * local_experts

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
    wait_all(flags + COUNT_READY + sources, sources, sources < ep, epoch, status_addr, rank, 1, max_spins)
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

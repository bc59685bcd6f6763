"""Cross-GPU synchronisation of the fused kernels: the protocol, the flag buffer, waits.

Every rank owns one int32 *flag buffer* in symmetric memory (peers write into it over
NVLink). All flags hold *epochs*: a rank's epoch counts the operator calls it has made,
lives on the device (``state[EPOCH]``) and is bumped by the layout kernel at the start of
each call. A flag equal to the current epoch means "done in this call"; stale values from
earlier calls never match, so flags are never reset.

A *call* is one forward or one backward of the operator; both start with the layout
kernel. One call, on every rank (all launches on one stream, in this order)::

    layout     write my per-expert counts into every peer's COUNTS[me], and
               whether I need the expert inputs sent again: NEEDS_INPUT[me]   (plain stores)
               set every peer's COUNT_READY[me] = epoch                       (release, sys)
               wait COUNT_READY[s] == epoch for every source s               (acquire, sys)
               -> every rank derives the same receive layout from COUNTS
    dispatch   per chunk of <= BLOCK_M rows for one expert: store the rows and their
               origin into the owner's receive buffer (the backward: also the rows of
               dy and the scores; the expert inputs only if the owner's NEEDS_INPUT),
               then set the owner's CHUNK_READY[me, expert, chunk] = epoch    (release, sys)
    gemm1      a tile of rows waits for CHUNK_READY of every chunk its rows come from
    gemm2      stores each output row into its source rank's combine buffer (the
               backward: also each row's score gradient into the source's buffer); the
               last program to finish sets every peer's COMBINE_READY[me] = epoch
                                                                              (release, sys)
    reduce     waits COMBINE_READY[s] == epoch for every s, then sums the k rows of
               each token in slot order

NEEDS_INPUT is each owner's own decision, published before anyone dispatches, so senders
never disagree with it: an owner whose receive buffer still holds the rows of the forward
being differentiated (no call in between) asks for the gradient rows alone.

Why buffers can be reused without a barrier at the end of a call: a rank passes the
layout's wait in call n+1 only after every peer has started call n+1, i.e. after each
peer's stream has finished call n (including its reads of the buffers I am about to
write). Writers of call n+1 are therefore always behind the readers of call n.

Every wait spins a bounded number of times. On timeout it records (code, rank, counter
index, value seen, value expected) in a small *status* word array in host memory and
gives up; every later wait sees the record and returns at once, so a dead peer or a bug
costs one timeout, never a hang. The host raises from the record on its next call
(``TIMEOUT_COUNTERS`` names the codes).
"""

from dataclasses import dataclass

import triton
import triton.language as tl

TIMEOUT_COUNTERS = {1: "COUNT_READY", 2: "CHUNK_READY", 3: "COMBINE_READY"}
"""Status codes written on timeout, by the flag array that was waited on."""

STATUS_WORDS = 8
"""Status record: [code, rank, counter index, value seen, value expected, claim, -, -]."""


@dataclass(frozen=True)
class FlagLayout:
    """Offsets (in int32 words) of the arrays inside one rank's flag buffer."""

    ep: int
    local_experts: int
    max_chunks: int
    """Chunks one source can send one expert: ceil(max rows per expert per source / BLOCK_M)."""

    @property
    def counts(self) -> int:
        """COUNTS[source, global expert]: rows that source routes to each expert."""
        return 0

    @property
    def count_ready(self) -> int:
        """COUNT_READY[source]."""
        return self.ep * self.ep * self.local_experts

    @property
    def combine_ready(self) -> int:
        """COMBINE_READY[owner]: the owner has stored all of its rows for me."""
        return self.count_ready + self.ep

    @property
    def needs_input(self) -> int:
        """NEEDS_INPUT[owner]: this call must send the owner its expert-input rows."""
        return self.combine_ready + self.ep

    @property
    def chunk_ready(self) -> int:
        """CHUNK_READY[source, local expert, chunk]."""
        return self.needs_input + self.ep

    @property
    def words(self) -> int:
        return self.chunk_ready + self.ep * self.local_experts * self.max_chunks


@triton.jit
def wait_all(flags, ids, mask, target, status_addr, rank, code, max_spins):
    """Spin until ``flags[i] == target`` wherever ``mask`` (a vector of flag pointers),
    then acquire them at system scope. Polling uses plain volatile loads: read-modify-write
    polling from every program would contend with the writers' releases on those lines.
    ``ids`` name the flags in a timeout record."""
    status = status_addr.to(tl.pointer_type(tl.int32))
    seen = tl.load(flags, mask=mask, other=0, volatile=True)
    pending = tl.sum((mask & (seen != target)).to(tl.int32))
    # The status lives in host memory: read it only while actually waiting.
    aborted = 0
    spins = 0
    while (pending > 0) & (aborted == 0) & (spins < max_spins):
        seen = tl.load(flags, mask=mask, other=0, volatile=True)
        pending = tl.sum((mask & (seen != target)).to(tl.int32))
        spins += 1
        if spins % 1024 == 0:
            aborted = tl.load(status + 5, volatile=True)
    if pending == 0:
        tl.atomic_add(flags, 0, mask=mask, sem="acquire", scope="sys")
    elif aborted == 0:
        late = mask & (seen != target)
        first = tl.min(tl.where(late, ids, 2147483647))
        value = tl.max(tl.where(late & (ids == first), seen, -2147483647))
        if tl.atomic_cas(status + 5, 0, 1, sem="relaxed", scope="sys") == 0:
            tl.store(status + 1, rank)
            tl.store(status + 2, first)
            tl.store(status + 3, value)
            tl.store(status + 4, target)
            tl.atomic_xchg(status, code, sem="release", scope="sys")


@triton.jit
def signal(flag, value):
    """Publish every store this program made before the call, then set ``flag``."""
    tl.debug_barrier()
    tl.atomic_xchg(flag, value, sem="release", scope="sys")


@triton.jit
def peer_pointer(local, ptrs, peer, rank):
    """``peer``'s copy of the symmetric buffer whose copy here is ``local``.

    Built as ``local`` plus an offset (not by casting the peer's address) so the compiler
    keeps knowing the buffer is 16-byte aligned and copies rows 16 bytes at a time.
    """
    elem: tl.constexpr = local.dtype.element_ty.primitive_bitwidth // 8
    offset = (tl.load(ptrs + peer) - tl.load(ptrs + rank)) // elem
    return local + tl.multiple_of(offset, 16 // elem)

"""Cross-GPU synchronisation of the fused kernels: the protocol, the flag buffer, waits,
rounds, and how a bad input or a failure is made loud on every rank.

Every rank owns one int64 *flag buffer* in symmetric memory (peers write into it over
NVLink). All flags hold *epochs*: a rank's epoch counts the rounds it has run, lives on
the device (``state[EPOCH]``, int64) and is bumped by the layout kernel at the start of
each round. A flag equal to the current epoch means "done in this round"; stale values
from earlier rounds never match, so flags are never reset.

A *call* is one forward or one backward of the operator. It runs in ``R`` *rounds*, each
starting with the layout kernel; ``R`` is fixed by the host from the buffers' size alone
(``ForwardShape.rounds``: the receive buffers hold a *window* of ``C`` rows, and ``R``
windows hold the most rows any routing can bring), so a call's launches never depend on
the routing. Round ``r`` moves the rows that land in rows ``[r C, (r + 1) C)`` of each
owner's full receive layout; a routing that fits one window leaves rounds 1.. empty, and
their kernels exit at once. One round, on every rank (all launches on one stream, in
this order)::

    layout     round 0: write my per-expert counts into every peer's COUNTS[me], and my
               first expert id outside [0, E), if any: BAD_IDS[me]            (plain stores)
               every round with rows (all ranks agree which, from the same counts):
               whether I need the expert inputs sent again: NEEDS_INPUT[me],
               set every peer's COUNT_READY[me] = epoch                       (release, sys)
               wait COUNT_READY[s] == epoch for every source s               (acquire, sys)
               -> every rank derives the same receive layout of the round's window from
                  COUNTS. Rounds past the last with rows pass no barrier: no row moves.
                  Where some rank's BAD_IDS holds an id, every rank *poisons* its
                  buffers (below) and publishes no work
    dispatch   per chunk of <= BLOCK_M rows for one expert: store the rows and their
               origin into the owner's receive buffer (the backward: also the rows of
               dy and the scores; the expert inputs only if the owner's NEEDS_INPUT),
               then set the owner's CHUNK_READY[me, expert, chunk] = epoch    (release, sys)
    gemm1      a tile of rows waits for CHUNK_READY of every chunk its rows come from
    gemm2      stores each output row into its source rank's combine buffer (the
               backward: also each row's score gradient into the source's buffer); the
               last program to finish sets every peer's COMBINE_READY[me] = epoch
                                                                              (release, sys)

and once per call, after the last round::

    reduce     waits COMBINE_READY[s] == epoch (the last round's) for every s, then sums
               the k rows of each token in slot order (each row crossed in one round)

NEEDS_INPUT is each owner's own decision, published before anyone dispatches, so senders
never disagree with it: an owner whose receive buffer still holds the rows of the forward
being differentiated (no call in between, and that forward's rows of this owner all in
round 0: ``LAST_ROWS_ROUND``) asks for the gradient rows alone in round 0.

Why buffers can be reused without a barrier at the end of a round: a rank passes the
layout's wait in round n+1 only after every peer has started round n+1, i.e. after each
peer's stream has finished round n (including its reads of the buffers I am about to
write). Writers of round n+1 are therefore always behind the readers of round n. COUNTS
are written in round 0 only and read by every round of the call: no peer writes them again
before its next call, which starts after its reduce has waited for my last round.

**No host wait.** Nothing the host launches depends on what the device computes: grids
are sized by capacity, counts and offsets stay on the device, and rows past a window go
through the later rounds of the same call. The host reads host-memory records the device
wrote (``records``) only without waiting: the status record and the poison words are
sticky, and a call's received-rows record is read for growth only ``GROWTH_LAG`` calls
later.

**Bad expert ids** are not a failure of the protocol: the rows of an id outside
``[0, E)`` sort outside every expert's range (``forward.sort_rows``), so no row of
theirs is ever sent. Each rank publishes its first bad id (BAD_IDS) with its counts in
round 0; every rank then reads the same BAD_IDS and *poisons* its buffers
(``state[POISONED]`` = that round's epoch, the same on every rank): it records the first
bad rank's id and its (token, slot) in the call's received-rows record and the poison
words of the status record, publishes no work, and from then on every round of every
call on these buffers passes no barrier, writes nothing to a peer and publishes no work,
and every reduction writes NaN: no result computed after the bad id is a number. The host
raises ``ValueError`` naming the id at the first call that finds the poison words written
(``records``), before it launches anything, on every rank (ranks may find it at different
calls: poisoned calls wait for no peer, so none hangs). Raising, the host launches
``acknowledge_kernel`` on its stream: it clears the poison and moves the epoch to
``POISONED + RESYNC_GAP``, where every rank's next call meets again whatever number of
poisoned calls each made (stale flags of those calls stay below it). A CUDA graph's
replays run no host code: ``fused.raise_pending()`` raises and acknowledges there.

**Failure.** Every wait has a wall-clock deadline (``state[TIMEOUT_NS]``, the settings'
``timeout_s``; read from the GPU's global timer). A rank *fails* when a wait passes its
deadline or when a peer has failed. Failing:

1. records ``(code, rank, index, value seen, value expected, epoch)`` once in its *status*
   record (host memory, so the host reads it without synchronising);
2. sets ``ABORT[me] = code`` in every rank's flag buffer (its own too);
3. stops: on GPUs the kernel executes ``trap``, which ends every later kernel of the
   process (the CUDA context is lost), so no result of this call or any later one is ever
   produced; under the Triton interpreter (launches are synchronous) the kernels return
   and the host raises right after the launch.

Every wait also reads the ABORT words, on its fast path too: a rank that starts a call
after a peer failed fails at its first wait, and a rank waiting on a failed peer fails
as soon as the peer's ABORT lands instead of at its own deadline. Every rank therefore
stops before it returns a result of the failed call, except in the window where a late
signal and a deadline cross (a peer's last signal landing microseconds after the waiter
gave up): the waiter fails, and the late rank fails at its next call. The host raises
from the status record at the start of every later call (the process must restart).
"""

from dataclasses import dataclass

import triton
import triton.language as tl

from titan_megamoe.kernels.configs import INTERPRET

# Words of the per-rank ``state`` array (int64, local memory).
EPOCH = tl.constexpr(0)
NUM_BLOCKS = tl.constexpr(1)
NUM_ITEMS = tl.constexpr(2)
GEMM1_NEXT_TILE = tl.constexpr(3)
GEMM2_FINISHED = tl.constexpr(4)
TIMEOUT_NS = tl.constexpr(5)
STATUS_ADDR = tl.constexpr(6)
RECOMPUTE_NEXT_TILE = tl.constexpr(7)
"""The backward's tile counter for the rows whose pre-activations were not saved."""
RECEIVED_ADDR = tl.constexpr(8)
"""Address of the received-rows record (host memory, below)."""
POISONED = tl.constexpr(9)
"""The epoch of the round that found a bad expert id, until the host acknowledges it; 0
while nothing is poisoned."""
LAST_ROWS_ROUND = tl.constexpr(10)
"""The last round of the last call in which this rank's window held rows (0 where none):
the receive buffer holds that round's rows."""
PAST_SAVED = tl.constexpr(11)
"""1 where this call brings this rank rows past the forward's saved pre-activations (the
backward then recomputes GEMM1 for them), else 0: gates the quantization of GEMM1's
weights in the backward."""
STATE_WORDS = 12

RESYNC_GAP = tl.constexpr(1 << 32)
"""Epochs an acknowledged poison skips (``acknowledge_kernel``: ``POISONED`` + this): more
than any number of rounds a rank runs poisoned."""

# The received-rows record (int64, host memory): RECEIVED_SLOTS slots of [call, rows, most,
# status, bad rank, bad slot, bad id, rows of local expert 0, 1, ...] (RECEIVED_COUNTS +
# local experts words). Round 0 of call n (as the host counts calls:
# ``ForwardBuffers.calls``, passed to it; 0 for a call captured in a CUDA graph, whose
# replays all write slot 0) writes, into slot ``ring_slot(n)``, the rows this rank
# receives in that call (each local expert's padded to its alignment, every round's), the
# most rows any rank of the group receives (so counted; every rank derives the same figure
# from the same counts), the call's status (0, or BAD_EXPERT_ID with the first rank whose
# ``topk_idx`` holds an id outside [0, E), that id's flat index ``token * top_k + slot``
# there and the id; the three words are written only then) and each local expert's rows:
# first those, then n (release, sys). The host reads a slot without waiting only: the
# call that poisoned the buffers (``POISON_CALL`` below names it), and a call
# ``GROWTH_LAG`` calls back, whose ``most`` decides, alike on every rank, whether the
# receive buffers grow (``records``).
RECEIVED_SLOTS = tl.constexpr(1024)
RECEIVED_CALL = tl.constexpr(0)
RECEIVED_ROWS = tl.constexpr(1)
RECEIVED_MOST = tl.constexpr(2)
RECEIVED_STATUS = tl.constexpr(3)
RECEIVED_BAD_RANK = tl.constexpr(4)
RECEIVED_BAD_SLOT = tl.constexpr(5)
RECEIVED_BAD_ID = tl.constexpr(6)
RECEIVED_COUNTS = tl.constexpr(7)


@triton.jit
def ring_slot(call):
    """The received-rows slot of host call ``call``: slot 0 for a captured call (0), the
    others in turn for eager ones (``records.ring_slot`` on the host)."""
    return tl.where(call == 0, 0, 1 + (call - 1) % (RECEIVED_SLOTS - 1))

ABORT = tl.constexpr(0)
"""ABORT[rank] sits at the start of every flag buffer, so every kernel finds it without
an offset argument."""

# Status codes: of a failure (status record word CODE), by what failed; or of a call that
# ran but computed nothing (received-rows record word RECEIVED_STATUS).
COUNT_READY_TIMEOUT = tl.constexpr(1)
CHUNK_READY_TIMEOUT = tl.constexpr(2)
COMBINE_READY_TIMEOUT = tl.constexpr(3)
PEER_FAILED = tl.constexpr(4)
BAD_EXPERT_ID = tl.constexpr(5)
"""A rank's ``topk_idx`` holds an id outside [0, E): the call poisoned the buffers
(received-rows record; not a failure, see the module docstring)."""
RECEIVE_OVERFLOW = tl.constexpr(6)
"""A call's rows need more rounds than the host launched (the host sizes the rounds for
any routing: a defect, not an input)."""
FAILURES = {
    COUNT_READY_TIMEOUT.value: "COUNT_READY",
    CHUNK_READY_TIMEOUT.value: "CHUNK_READY",
    COMBINE_READY_TIMEOUT.value: "COMBINE_READY",
    PEER_FAILED.value: "a peer's failure",
    RECEIVE_OVERFLOW.value: "more rounds than the call launched",
}
"""Status code -> what failed (a waited flag array, a peer, or the input)."""

# Status record words (int64, host memory): [code, rank, index, seen, expected, claim,
# epoch, poison call, poison epoch, -]. The first seven record a failure, once; the poison
# words the call that poisoned the buffers (its host number: its received-rows slot holds
# the bad id) and that round's epoch (written last, release, sys), each time the buffers
# are poisoned anew.
CODE = tl.constexpr(0)
RANK = tl.constexpr(1)
INDEX = tl.constexpr(2)
SEEN = tl.constexpr(3)
EXPECTED = tl.constexpr(4)
CLAIM = tl.constexpr(5)
CALL = tl.constexpr(6)
POISON_CALL = tl.constexpr(7)
POISON_EPOCH = tl.constexpr(8)
STATUS_WORDS = 10

_USE_CLOCK = tl.constexpr(not INTERPRET)
_TRAP = tl.constexpr(not INTERPRET)
POLL_NS_INTERPRETED = 1_000_000
"""The interpreter has no clock: each poll there counts as this many nanoseconds."""
_POLL_NS = tl.constexpr(POLL_NS_INTERPRETED)
POLLS_PER_CHECK = tl.constexpr(64)
"""Flag polls between reads of the clock and the ABORT words while waiting."""


@dataclass(frozen=True)
class FlagLayout:
    """Offsets (in int64 words) of the arrays inside one rank's flag buffer."""

    ep: int
    local_experts: int
    max_chunks: int
    """Chunks one source can send one expert: ceil(max rows per expert per source / BLOCK_M)."""

    @property
    def abort(self) -> int:
        """ABORT[rank]: that rank failed (its status code); 0 while it has not."""
        return ABORT.value

    @property
    def counts(self) -> int:
        """COUNTS[source, global expert]: rows that source routes to each expert."""
        return self.ep

    @property
    def count_ready(self) -> int:
        """COUNT_READY[source]."""
        return self.counts + self.ep * self.ep * self.local_experts

    @property
    def combine_ready(self) -> int:
        """COMBINE_READY[owner]: the owner has stored all of its rows for me."""
        return self.count_ready + self.ep

    @property
    def needs_input(self) -> int:
        """NEEDS_INPUT[owner]: this call must send the owner its expert-input rows."""
        return self.combine_ready + self.ep

    @property
    def bad_ids(self) -> int:
        """BAD_IDS[source] = [flat index + 1 of the source's first expert id outside
        [0, E), or 0 where it has none; that id], rewritten by every call's layout."""
        return self.needs_input + self.ep

    @property
    def chunk_ready(self) -> int:
        """CHUNK_READY[source, local expert, chunk]."""
        return self.bad_ids + 2 * self.ep

    @property
    def words(self) -> int:
        return self.chunk_ready + self.ep * self.local_experts * self.max_chunks


@triton.jit
def now_ns(polls):
    """Nanoseconds on the GPU's global timer (the interpreter: polls so far, scaled)."""
    if _USE_CLOCK:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        return polls.to(tl.int64) * _POLL_NS


@triton.jit
def peer_pointer(local, ptrs, peer, rank):
    """``peer``'s copy of the symmetric buffer whose copy here is ``local``.

    Built as ``local`` plus an offset (not by casting the peer's address) so the compiler
    keeps knowing the buffer is 16-byte aligned and copies rows 16 bytes at a time.
    """
    elem: tl.constexpr = local.dtype.element_ty.primitive_bitwidth // 8
    offset = tl.load(ptrs + peer) - tl.load(ptrs + rank)
    # The hint marks the op that makes its value: a division by 1 (byte elements) would be
    # folded away with it, and the e4m3 copies would store a byte at a time.
    if elem > 1:
        offset = offset // elem
    return local + tl.multiple_of(offset, 16 // elem)


@triton.jit
def fail(code, index, seen, expected, flags, flag_ptrs, state, rank, ep):
    """Record why this rank fails (first failure only), tell every rank through its
    ABORT word, and stop (see the module docstring)."""
    status = tl.load(state + STATUS_ADDR).to(tl.pointer_type(tl.int64))
    zero = tl.cast(0, tl.int64)  # compare-and-swap wants the words' own type (both dialects: a scalar)
    word = zero + code
    if tl.atomic_cas(status + CLAIM, zero, zero + 1, sem="relaxed", scope="sys") == 0:
        tl.store(status + RANK, rank)
        tl.store(status + INDEX, index)
        tl.store(status + SEEN, seen)
        tl.store(status + EXPECTED, expected)
        tl.store(status + CALL, tl.load(state + EPOCH))
        tl.atomic_xchg(status + CODE, word, sem="release", scope="sys")
    landed = zero
    for peer in range(ep):
        # The first failure's code stays: later ones only follow from it.
        landed += tl.atomic_cas(peer_pointer(flags, flag_ptrs, peer, rank) + ABORT + rank, zero, word,
                                sem="release", scope="sys")
    if _TRAP:
        # Everything written above must land before the kernel dies: a trap drops writes
        # still in flight. The fence drains the stores (seen: an empty status record
        # without it); the trap is predicated on the CASes' returned values, so it waits
        # for their round trips (seen: peers' ABORT words never set without it).
        tl.inline_asm_elementwise(
            "{ .reg .pred p; mov.u32 $0, 0; setp.ne.s64 p, $1, 0x7fffffffffffffff; fence.sc.sys; @p trap; }",
            "=r,l", [landed], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_all(waited, ids, mask, target, code, flags, flag_ptrs, state, rank, ep, EP_PAD: tl.constexpr):
    """Spin until ``waited[i] == target`` wherever ``mask`` (a vector of flag pointers),
    then acquire them at system scope; ``ids`` name the flags in a failure record.
    Fails with ``code`` past the deadline, or as soon as a peer's ABORT word is set.

    Polling uses plain volatile loads: read-modify-write polling from every program would
    contend with the writers' releases on those lines."""
    peers = tl.arange(0, EP_PAD)
    seen = tl.load(waited, mask=mask, other=0, volatile=True)
    pending = tl.sum((mask & (seen != target)).to(tl.int32))
    aborts = tl.load(flags + ABORT + peers, mask=peers < ep, other=0, volatile=True)
    if (pending > 0) & (tl.max(aborts) == 0):
        timeout = tl.load(state + TIMEOUT_NS)
        polls = 0
        start = now_ns(polls)
        elapsed = start - start
        while (pending > 0) & (tl.max(aborts) == 0) & (elapsed < timeout):
            seen = tl.load(waited, mask=mask, other=0, volatile=True)
            pending = tl.sum((mask & (seen != target)).to(tl.int32))
            polls += 1
            if polls % POLLS_PER_CHECK == 0:
                aborts = tl.load(flags + ABORT + peers, mask=peers < ep, other=0, volatile=True)
                elapsed = now_ns(polls) - start
    if tl.max(aborts) != 0:
        culprit = tl.min(tl.where(aborts != 0, peers, EP_PAD))
        culprit_code = tl.max(tl.where(peers == culprit, aborts, 0))
        fail(PEER_FAILED, culprit, culprit_code, 0, flags, flag_ptrs, state, rank, ep)
    elif pending > 0:
        late = mask & (seen != target)
        first = tl.min(tl.where(late, ids, 2147483647))
        value = tl.max(tl.where(late & (ids == first), seen, -(2**62)))
        fail(code, first, value, target, flags, flag_ptrs, state, rank, ep)
    else:
        tl.atomic_add(waited, 0, mask=mask, sem="acquire", scope="sys")


@triton.jit(do_not_specialize=["poisoned_epoch"])
def acknowledge_kernel(state, poisoned_epoch):
    """The host has raised for the poisoning of ``poisoned_epoch``: clear it, and move the
    epoch to where every rank's next call meets (``RESYNC_GAP``). A later poisoning is left
    for its own acknowledgement."""
    if tl.load(state + POISONED) == poisoned_epoch:
        tl.store(state + EPOCH, poisoned_epoch.to(tl.int64) + RESYNC_GAP)
        tl.store(state + POISONED, 0)


@triton.jit
def signal(flag, value):
    """Publish every store this program made before the call, then set ``flag``."""
    tl.debug_barrier()
    tl.atomic_xchg(flag, value, sem="release", scope="sys")

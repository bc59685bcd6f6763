"""What the host reads of the device: the records the kernels write into host memory
(``sync``), read without waiting for the device, and the messages they raise.

Three records, all in pinned host memory, each read through a NumPy view (a read is a
memory load, not a tensor operation):

- the *status record*: a failure (sticky: written once, the process must restart), and the
  poison words: the host call and epoch of the call that found a bad expert id;
- the *received-rows ring*: one slot per call (``ring_slot``), the rows each call brings;
- nothing else: counts, offsets and tile counts stay on the device.

The host reads the status record at every call, before it launches anything: a failure
raises ``RuntimeError``, a bad id ``ValueError`` (once per poisoning; the next call
acknowledges it, ``sync``). Those words are written by the device before their last word
is released, so a read sees a whole record or none. A ring slot is read only where the
host knows the device wrote it: the poisoning call's (its poison words are released after
it), and, for growth, the slot of the call ``GROWTH_LAG`` calls back (``grow_lag_record``),
which a host that runs that far ahead of its GPU waits for; ``waits`` counts those waits
and ``wait_s`` their time.
"""

import time
from typing import NamedTuple

import torch

from titan_megamoe.kernels import sync

GROWTH_LAG = 16
"""The receive buffers grow at call ``n`` for the rows call ``n - GROWTH_LAG`` brought: every
rank reads the same record at the same call, so all grow alike, and a host waits for it
only where it runs that many calls ahead of its GPU."""

RECORD_POLL_S = 20e-6
"""How long a wait for a ring slot sleeps between reads."""


def ring_slot(call: int) -> int:
    """The received-rows slot of host call ``call`` (``sync.ring_slot``)."""
    return 0 if call == 0 else 1 + (call - 1) % (sync.RECEIVED_SLOTS.value - 1)


class BadExpertId(NamedTuple):
    """An expert id outside [0, E) that a call's layout found (``sync.BAD_EXPERT_ID``)."""

    rank: int
    """The first rank of the group whose ``topk_idx`` holds one."""
    slot: int
    """Its flat index there, ``token * top_k + j``: the rank's first negative id, else
    its first one from E on."""
    value: int


class ReceivedRows(NamedTuple):
    """A call's received-rows record (``sync``)."""

    total: int
    """The rows this rank receives over the call, each local expert's padded to ``row_align``."""
    most: int
    """The most any rank of the group receives, counted as ``total``."""
    per_expert: tuple[int, ...]
    """Each local expert's."""


class HostRecords:
    """The status record and the received-rows ring of one buffer set, and the host's
    reads of them (``pinned``: page-locked, as the device writes them)."""

    def __init__(self, local_experts: int, pinned: bool):
        self.status = torch.zeros(sync.STATUS_WORDS, dtype=torch.int64, pin_memory=pinned)
        self.ring = torch.zeros(sync.RECEIVED_SLOTS.value, sync.RECEIVED_COUNTS.value + local_experts,
                                dtype=torch.int64, pin_memory=pinned)
        self._status = self.status.numpy()
        self._ring = self.ring.numpy()
        self.waits = 0
        """Reads of a ring slot that had to wait for the device (``read_ring``)."""
        self.wait_s = 0.0
        """Host seconds those waits took."""

    def failure(self, timeout_s: float) -> str | None:
        """The message of a recorded failure, or None."""
        return describe_failure(self._status[:7].tolist(), timeout_s)

    def poisoned(self) -> tuple[int, int]:
        """``(epoch, call)`` of the last poisoning the device recorded, ``(0, 0)`` if none."""
        epoch = int(self._status[sync.POISON_EPOCH.value])
        return epoch, int(self._status[sync.POISON_CALL.value]) if epoch else 0

    def bad_id(self, call: int) -> BadExpertId | None:
        """The bad id the ring slot of ``call`` records (None if it records none, or another call)."""
        slot = self._ring[ring_slot(call)]
        if slot[sync.RECEIVED_CALL.value] != call or slot[sync.RECEIVED_STATUS.value] != sync.BAD_EXPERT_ID.value:
            return None
        return BadExpertId(int(slot[sync.RECEIVED_BAD_RANK.value]), int(slot[sync.RECEIVED_BAD_SLOT.value]),
                           int(slot[sync.RECEIVED_BAD_ID.value]))

    def written(self, call: int) -> bool:
        """Whether the device has written ``call``'s ring slot (or a later call's there)."""
        return int(self._ring[ring_slot(call), sync.RECEIVED_CALL.value]) >= call

    def read_ring(self, call: int, timeout_s: float, stop) -> ReceivedRows | None:
        """``call``'s received-rows record, waiting for the device to write it where it has
        not yet (counted in ``waits``); ``stop()``, called while waiting, raises (a
        recorded failure) or returns True to give up (the buffers were poisoned since: a
        poisoned call writes no record); past ``timeout_s`` this raises. None where the
        slot holds another call's, or a bad id, or the wait gave up."""
        if not self.written(call):
            start = time.monotonic()
            self.waits += 1
            while not self.written(call):
                if stop():
                    return None
                if time.monotonic() - start > timeout_s:
                    raise RuntimeError(f"mega_moe fused: call {call}'s received-rows record was not written after "
                                       f"{timeout_s:.1f} s")
                time.sleep(RECORD_POLL_S)
            self.wait_s += time.monotonic() - start
        words = self._ring[ring_slot(call)].tolist()
        if words[sync.RECEIVED_CALL.value] != call or words[sync.RECEIVED_STATUS.value]:
            return None
        return ReceivedRows(words[sync.RECEIVED_ROWS.value], words[sync.RECEIVED_MOST.value],
                            tuple(words[sync.RECEIVED_COUNTS.value:]))


def describe_failure(status: list[int], timeout_s: float) -> str | None:
    """The message of a status record's failure words (``sync``), or None when they record none."""
    code, rank, index, seen, expected, _claim, epoch = status[:7]
    if not code:
        return None
    if code == sync.RECEIVE_OVERFLOW.value:
        what = (f"rank {rank}: a call brings rank {index} {seen} rows, more than the {expected} the rounds it "
                f"launched hold (epoch {epoch})")
    elif code == sync.PEER_FAILED.value:
        what = (f"rank {rank} stopped at epoch {epoch} because rank {index} failed "
                f"({sync.FAILURES.get(seen, seen)})")
    else:
        what = (f"rank {rank} timed out after {timeout_s:g} s waiting for "
                f"{sync.FAILURES.get(code, code)}[{index}] (value {seen}, expected {expected}) "
                f"at epoch {epoch}: a peer stopped or fell that far behind")
    return (f"mega_moe fused kernels: {what}. Every rank of the EP group stopped in that call "
            "and no result of it was returned; the process must restart (on GPUs the kernels "
            "ended its CUDA context)")


def describe_bad_id(bad: BadExpertId, ep: int, local_experts: int, top_k: int, rank: int, call: int,
                    raised_at: int) -> str:
    """The message of call ``call``, whose layout found an expert id out of range, as rank
    ``rank`` raises it at its call ``raised_at``."""
    token, slot = divmod(bad.slot, top_k)
    owner = "" if bad.rank == rank else f"rank {bad.rank}'s "
    if call == 0:
        when = "a call replayed from a CUDA graph"
    elif raised_at == call + 1:
        when = "the call before this one"
    else:
        when = f"call {call} ({raised_at - call} calls back)"
    return (f"mega_moe fused: {owner}topk_idx holds expert id {bad.value}, outside "
            f"[0, {ep * local_experts}) ({ep} EP ranks x {local_experts} local experts), at token {token}, "
            f"slot {slot}, in {when} on these buffers: the router's top-k indices must name experts of the EP "
            f"group. Every rank of the group raises this; no row of that call was sent, its outputs and those "
            f"of every call made on these buffers since are NaN (weight gradients 0), and the next call runs "
            f"normally")

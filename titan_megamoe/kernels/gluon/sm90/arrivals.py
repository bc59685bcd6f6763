"""Arrival waits of the Gluon core: a tile's rows may be read once every chunk they come
from has arrived (``kernels.sync``'s CHUNK_READY protocol, deadline and ABORT words
included; a failure goes through ``sync.fail``, the one failure path of every dialect).

The load partition waits before its first TMA copy of a tile's rows; the consumers read
those rows only through the stages it fills, and the per-row words they read in their
epilogue (the scores) after the tile's last stage.
"""

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate

from titan_megamoe.kernels.sync import ABORT, CHUNK_READY_TIMEOUT, PEER_FAILED, POLLS_PER_CHECK, TIMEOUT_NS, fail, now_ns


@gluon.jit
def _fence_proxy_async():
    """Order the generic-proxy acquire above before the TMA (async-proxy) reads of the
    same rows that follow it."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@aggregate
class ChunkArrivals:
    """Where this rank's received chunks are announced: its flag buffer (``flags``, every
    rank's copy at ``flag_ptrs``), its ``state`` words, and each source's rows per local
    expert (``src_offset``, ``src_rows``: ``[ep, local experts]``, from the layout)."""

    flags: gl.tensor
    flag_ptrs: gl.tensor
    state: gl.tensor
    src_offset: gl.tensor
    src_rows: gl.tensor
    rank: gl.tensor
    ep: gl.tensor
    chunk_ready: gl.constexpr
    """Offset of CHUNK_READY[source, local expert, chunk] in the flag buffer."""
    max_chunks: gl.constexpr
    ep_pad: gl.constexpr
    """A power of two >= ep."""

    @gluon.constexpr_function
    def __init__(self, flags, flag_ptrs, state, src_offset, src_rows, rank, ep, chunk_ready, max_chunks, ep_pad):
        self.flags = flags
        self.flag_ptrs = flag_ptrs
        self.state = state
        self.src_offset = src_offset
        self.src_rows = src_rows
        self.rank = rank
        self.ep = ep
        self.chunk_ready = gl.constexpr(chunk_ready)
        self.max_chunks = gl.constexpr(max_chunks)
        self.ep_pad = gl.constexpr(ep_pad)

    @gluon.jit
    def wait_rows(self, expert, base, row0, local_experts, epoch, TILE_M: gl.constexpr, CHUNK_M: gl.constexpr,
                  WARPS: gl.constexpr):
        """Wait until every source's chunks (``CHUNK_M`` rows each: the layout's blocks) that
        overlap rows ``[row0, row0 + TILE_M)`` of local expert ``expert`` (its rows from
        ``base``) hold ``epoch``, then acquire them at system scope (``sync.wait_all``'s
        rules: volatile polls, the clock and the ABORT words every ``POLLS_PER_CHECK``
        polls, ``sync.fail`` past the deadline or on a peer's failure). A tile of at most
        ``CHUNK_M`` rows meets at most two chunks of each source."""
        gl.static_assert(TILE_M <= CHUNK_M, "a tile meets at most two chunks of a source")
        grid: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [WARPS, 1], [1, 0])
        peers_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        s = gl.arange(0, self.ep_pad, layout=gl.SliceLayout(1, grid))[:, None]
        second = gl.arange(0, 2, layout=gl.SliceLayout(0, grid))[None, :]
        source = s < self.ep
        seg = base + gl.load(self.src_offset + s * local_experts + expert, mask=source, other=0)
        n = gl.load(self.src_rows + s * local_experts + expert, mask=source, other=0)
        lo = gl.maximum(row0, seg)
        hi = gl.minimum(row0 + TILE_M, seg + n)
        chunk = (lo - seg) // CHUNK_M + second
        need = source & (lo < hi) & (chunk <= (hi - 1 - seg) // CHUNK_M)
        ids = (s * local_experts + expert) * self.max_chunks + chunk
        waited = self.flags + self.chunk_ready + ids
        peers = gl.arange(0, self.ep_pad, layout=peers_layout)
        seen = gl.load(waited, mask=need, other=0, volatile=True)
        pending = gl.sum(gl.sum((need & (seen != epoch)).to(gl.int32), axis=1), axis=0)
        aborted = gl.max(gl.load(self.flags + ABORT + peers, mask=peers < self.ep, other=0, volatile=True), axis=0)
        if (pending > 0) & (aborted == 0):
            timeout = gl.load(self.state + TIMEOUT_NS)
            polls = 0
            start = now_ns(polls)
            elapsed = start - start
            while (pending > 0) & (aborted == 0) & (elapsed < timeout):
                seen = gl.load(waited, mask=need, other=0, volatile=True)
                pending = gl.sum(gl.sum((need & (seen != epoch)).to(gl.int32), axis=1), axis=0)
                polls += 1
                if polls % POLLS_PER_CHECK == 0:
                    aborted = gl.max(gl.load(self.flags + ABORT + peers, mask=peers < self.ep, other=0,
                                             volatile=True), axis=0)
                    elapsed = now_ns(polls) - start
        if aborted != 0:
            aborts = gl.load(self.flags + ABORT + peers, mask=peers < self.ep, other=0, volatile=True)
            culprit = gl.min(gl.where(aborts != 0, peers, self.ep_pad), axis=0)
            code = gl.max(gl.where(peers == culprit, aborts, 0), axis=0)
            fail(PEER_FAILED, culprit, code, 0, self.flags, self.flag_ptrs, self.state, self.rank, self.ep)
        elif pending > 0:
            late = need & (seen != epoch)
            first = gl.min(gl.min(gl.where(late, ids, 2147483647), axis=1), axis=0)
            value = gl.max(gl.max(gl.where(late & (ids == first), seen, -(2**62)), axis=1), axis=0)
            fail(CHUNK_READY_TIMEOUT, first, value, epoch, self.flags, self.flag_ptrs, self.state, self.rank,
                 self.ep)
        else:
            gl.atomic_add(waited, gl.zeros_like(seen), mask=need, sem="acquire", scope="sys")
            _fence_proxy_async()


@dataclass(frozen=True)
class ChunkFlags:
    """Where this rank's received chunks are announced (``kernels.sync``): its flag buffer
    and every rank's address of it, its state words, each source's rows per local expert
    (``[ep, local experts]`` int32), and the flag buffer's CHUNK_READY offset and chunks
    per source and expert (``sync.FlagLayout``)."""

    flags: torch.Tensor
    flag_ptrs: torch.Tensor
    state: torch.Tensor
    src_offset: torch.Tensor
    src_rows: torch.Tensor
    rank: int
    ep: int
    chunk_ready: int
    max_chunks: int

"""Where the fused kernels' data lives: the buffers of one (group, shape, tiles), allocated
once and reused by every layer and call, the receive window and the rounds a call runs in,
and how the receive buffers grow.

Symmetric (peers write into them): the receive buffer and the origin of each of its rows,
the combine buffer, the flag buffer. Local: GEMM1's output ``h``, the layout arrays, the
per-round state (``sync``), and the host records (``records``: in host memory on GPUs, so
the host reads them without synchronising).

**Windows and rounds.** The receive buffers hold a window of ``window`` rows of a call's
full receive layout (``ForwardShape.receive_rows``, sized by ``receive_load``); a call runs
``rounds`` rounds, enough windows for every row any routing can bring, so every routing is
computed exactly without the host knowing it (``sync``, ``layout``). Buffers that hold every
routing's rows run one round.

**Growth.** Where a routing needed more than one window, later calls run faster on larger
buffers: at the start of forward call ``n`` every rank reads the received-rows record of
call ``n - GROWTH_LAG`` (``records``) and, where its most rows exceed the window, grows
every buffer with a row per received row to ``RECEIVE_GROWTH`` times them (collectively:
every rank reads the same record at the same call). The old buffers are kept until the
device has passed the calls that use them (``_retired``).
"""

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from titan_megamoe.kernels import sync
from titan_megamoe.kernels.configs import TileConfig
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels.records import GROWTH_LAG, HostRecords, describe_bad_id
from titan_megamoe.kernels.sync import FlagLayout, acknowledge_kernel
from titan_megamoe.precision import NATIVE, Format

logger = logging.getLogger(__name__)

RECEIVE_GROWTH = 1.25
"""Receive buffers that grow take this multiple of the rows that did not fit, at most what
any routing can bring: a load that creeps up makes the group allocate (collectively) seldom."""

CALL_RESYNC_GAP = 1 << 20
"""Host call numbers skipped after a bad id is raised (``ForwardBuffers.raise_pending``):
every rank numbers its next call alike, however many poisoned calls it made."""

def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


SymmetricAllocator = Callable[[tuple[int, ...], torch.dtype], tuple[torch.Tensor, torch.Tensor]]
"""``(shape, dtype) -> (this rank's zeroed buffer, int64 tensor of every rank's address)``."""


@dataclass(frozen=True)
class ForwardShape:
    """What the buffers are sized for. Every rank of the group must use the same one."""

    ep: int
    rank: int
    capacity_tokens_per_rank: int
    """Most tokens any rank passes in one call."""
    top_k: int
    local_experts: int
    hidden: int
    inter: int
    dtype: torch.dtype
    """The activations' dtype (the combine buffer's and, unquantized, the receive buffer's)."""
    row_format: Format = NATIVE
    """Format of the forward's GEMM operands, as the precision names it (the tile row
    decides how the kernels hold it: ``ForwardBuffers.row_format``)."""
    native_resend: bool = False
    """Quantized rows only: the backward sends the expert inputs again in ``dtype``
    (``Precision.backward_link``) into the same receive buffer, which is sized for either
    (``ForwardBuffers.recv_native`` views it so)."""
    receive_load: float = 0.0
    """Rows the receive buffers hold at first, as a multiple of the mean a rank receives
    (``rows_per_rank``, each local expert's padding added); 0: every row any routing can
    bring (``OperatorSettings.receive_load``)."""

    @property
    def rows_per_rank(self) -> int:
        return self.capacity_tokens_per_rank * self.top_k

    def _buffer_rows(self, received: int, tiles: TileConfig) -> int:
        """Rows of a receive buffer whose window holds ``received`` rows (each local
        expert's aligned), and a tile's rows of slack that the last expert's last tile
        reads past its rows (``layout``)."""
        align = tiles.row_align
        return math.ceil(received / align) * align + tiles.block_m

    def most_receive_rows(self, tiles: TileConfig) -> int:
        """Rows of a receive buffer whose window holds any routing's rows: every source's
        every row, each expert's alignment padding (``TileConfig.row_align``)."""
        return self._buffer_rows(self.ep * self.rows_per_rank + self.local_experts * (tiles.row_align - 1), tiles)

    def receive_rows(self, tiles: TileConfig) -> int:
        """Rows of the receive buffers as first allocated: ``receive_load`` times the mean,
        or ``most_receive_rows`` where that is fewer or the load is 0."""
        most = self.most_receive_rows(tiles)
        if not self.receive_load:
            return most
        mean = self.rows_per_rank + self.local_experts * (tiles.row_align - 1)
        return min(most, self._buffer_rows(math.ceil(self.receive_load * mean), tiles))

    def grown_receive_rows(self, received: int, tiles: TileConfig) -> int:
        """Rows of receive buffers grown for a call in which a rank receives ``received``
        rows: ``RECEIVE_GROWTH`` times them, at most ``most_receive_rows``."""
        return min(self.most_receive_rows(tiles), self._buffer_rows(math.ceil(RECEIVE_GROWTH * received), tiles))

    def rounds(self, window: int, tiles: TileConfig) -> int:
        """Rounds a call runs through a window of ``window`` rows: enough for any routing."""
        return math.ceil((self.most_receive_rows(tiles) - tiles.block_m) / window)


def row_buffer(symmetric: SymmetricAllocator, rows: int, cols: int, dtype: torch.dtype, scale_k: int,
               native_too: bool = False):
    """``(rows [rows, cols], scales [rows, cols / scale_k] or None, peer addresses, native
    view or None)``: rows of ``dtype`` (``scale_k`` 0), or e4m3 rows with one fp32 scale
    per ``scale_k`` columns, held in one symmetric allocation, the scales behind the rows,
    so that a row and its scales travel to the same peer buffer. ``native_too``: the
    allocation can also hold the rows in ``dtype``, and the fourth element views it so
    (either form at a time)."""
    if not scale_k:
        data, ptrs = symmetric((rows, cols), dtype)
        return data, None, ptrs, data if native_too else None
    scale_cols = math.ceil(cols / scale_k)
    data_bytes = math.ceil(rows * cols / 16) * 16  # the scales start 16-byte aligned
    scale_bytes = rows * scale_cols * 4
    native_bytes = rows * cols * dtype.itemsize if native_too else 0
    raw, ptrs = symmetric((max(data_bytes + scale_bytes, native_bytes),), torch.uint8)
    data = raw[: rows * cols].view(torch.float8_e4m3fn).view(rows, cols)
    scales = raw[data_bytes : data_bytes + scale_bytes].view(torch.float32).view(rows, scale_cols)
    native = raw[:native_bytes].view(dtype).view(rows, cols) if native_too else None
    return data, scales, ptrs, native


class ForwardBuffers:
    """Everything one (group, shape, tiles) needs, allocated once and reused by every call
    (module docstring)."""

    def __init__(self, shape: ForwardShape, tiles: TileConfig, device: torch.device,
                 symmetric: SymmetricAllocator):
        self.shape = shape
        self.tiles = tiles
        self.row_format = tiles.operand_format(shape.row_format)
        """How the kernels hold the forward's GEMM operands: native or MX held in bf16, the
        rows cross the link (and ``h`` is stored) in ``dtype``; e4m3, they cross it as e4m3
        with one scale per ``row_scale_k`` elements, and the receive buffer carries the
        scales."""
        self.flag_layout = FlagLayout(
            ep=shape.ep,
            local_experts=shape.local_experts,
            max_chunks=math.ceil(shape.rows_per_rank / self.tiles.block_m),
        )
        self._symmetric, self._device = symmetric, device
        self._grow_hooks: list[Callable[[int], tuple]] = []
        self._retired: list[tuple[torch.cuda.Event | None, tuple]] = []
        """Buffers replaced by growth, with an event the device passes once no call uses them."""
        self._allocate_rows(shape.receive_rows(tiles))
        self.combine, self.combine_ptrs = symmetric((shape.rows_per_rank, shape.hidden), shape.dtype)
        self.flags, self.flag_ptrs = symmetric((self.flag_layout.words,), torch.int64)

        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        num_experts = shape.ep * shape.local_experts
        self.records = HostRecords(shape.local_experts, pinned=device.type == "cuda")
        self.state = torch.zeros(sync.STATE_WORDS, dtype=torch.int64, device=device)
        self.state[sync.STATUS_ADDR.value] = self.records.status.data_ptr()
        self.state[sync.RECEIVED_ADDR.value] = self.records.ring.data_ptr()
        self.send_first = ints(num_experts)
        self.send_end = ints(num_experts)
        self.dest_start = ints(num_experts)
        self.item_start = ints(num_experts)
        self.local_base = ints(shape.local_experts)
        self.block_base = ints(shape.local_experts)
        self.local_rows = ints(shape.local_experts)
        self.src_offset = ints(shape.ep * shape.local_experts)
        self.src_rows = ints(shape.ep * shape.local_experts)
        # Sort keys in the narrowest type that holds -1 .. E (``forward.sort_rows``).
        key_dtype = torch.int16 if num_experts < 2**15 else torch.int32
        self.expert_edges = torch.arange(num_experts + 1, dtype=key_dtype, device=device)
        self.timeout_s = 0.0
        """The deadline of the last call (for the failure message)."""
        self.calls = 0
        """Calls (forward or backward) made on these buffers, counted on the host."""
        self.resync_call = 0
        """The host call number from which received-rows records are read for growth: no
        call before it (a poisoned one writes none) is read (``raise_pending``)."""
        self.acknowledged = 0
        """The poisoned epoch the host has raised for (``sync``)."""
        self.resident = None
        """``(call, inputs_key)`` of the forward whose expert inputs the receive buffer holds."""
        self.said_frozen = False
        self.frozen = False
        """A CUDA graph captured a call on these buffers: its replays use them as they are, so
        they never grow or change (calls run past the window in rounds)."""
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        """The stream every eager call runs on: the protocol orders the calls of one stream
        (a CUDA graph captured on another replays on the stream that replays it)."""

    def _allocate_rows(self, rows: int) -> None:
        """(Re)allocate the buffers with a row per received row, ``rows`` each (symmetric
        ones collectively)."""
        shape, scale_k = self.shape, self.row_format.row_scale_k
        self.recv, self.recv_scales, self.recv_ptrs, self.recv_native = row_buffer(
            self._symmetric, rows, shape.hidden, shape.dtype, scale_k, shape.native_resend)
        self.recv_meta, self.recv_meta_ptrs = self._symmetric((rows,), torch.int32)
        if scale_k:
            self.h = torch.empty(rows, shape.inter, dtype=torch.float8_e4m3fn, device=self._device)
            self.h_scales = torch.empty(rows, math.ceil(shape.inter / scale_k), dtype=torch.float32,
                                        device=self._device)
        else:
            self.h = torch.empty(rows, shape.inter, dtype=shape.dtype, device=self._device)
            self.h_scales = None

    def on_grow(self, allocate_rows: Callable[[int], tuple]) -> None:
        """Have ``grow_for_later_calls`` also call ``allocate_rows(rows)`` when the buffers
        grow (the backward's buffers per received row); it returns the buffers it replaced,
        which are kept until no call in flight reads them."""
        self._grow_hooks.append(allocate_rows)

    @property
    def window(self) -> int:
        """Rows of a call's full receive layout one round moves: the receive buffers' rows
        less the tile of slack (``layout``)."""
        return self.recv.shape[0] - self.tiles.block_m

    @property
    def rounds(self) -> int:
        """Rounds every call on these buffers runs (``ForwardShape.rounds``)."""
        return self.shape.rounds(self.window, self.tiles)

    def holds_every_routing(self) -> bool:
        """Whether one window holds any routing's rows (then buffers never grow)."""
        return self.recv.shape[0] >= self.shape.most_receive_rows(self.tiles)

    def grow_for_later_calls(self, call: int, timeout_s: float) -> None:
        """At the start of forward ``call`` (before its launches, outside a CUDA graph
        capture): read the record of call ``call - GROWTH_LAG`` (``records``) and, where
        its most rows exceed the window, grow every buffer with a row per received row
        (module docstring)."""
        self._release_retired()
        looked_at = call - GROWTH_LAG
        if self.holds_every_routing() or looked_at <= self.resync_call:
            return
        received = self.records.read_ring(looked_at, timeout_s, self.poisoned_or_failed)
        if received is None or received.most <= self.window:
            return
        if self.frozen:
            if not self.said_frozen:
                self.said_frozen = True
                logger.warning(
                    f"mega_moe fused: call {looked_at} brought a rank {received.most} rows, more than the receive "
                    f"window's {self.window}, but a CUDA graph uses these buffers: they do not grow, and calls run "
                    f"such rows in further rounds (raise receive_load to avoid them)")
            return
        grown = self.shape.grown_receive_rows(received.most, self.tiles)
        logger.info(
            f"mega_moe fused: call {looked_at} brought a rank {received.most} rows, more than the receive window's "
            f"{self.window} (receive_load {self.shape.receive_load}): it ran in several rounds, and every rank grows "
            f"the window to {grown - self.tiles.block_m} rows from call {call} on"
        )
        old = (self.recv, self.recv_scales, self.recv_native, self.recv_meta, self.h, self.h_scales,
               self.recv_ptrs, self.recv_meta_ptrs)
        self._retire(old)
        self._allocate_rows(grown)
        for allocate_rows in self._grow_hooks:
            self._retire(allocate_rows(grown))

    def _retire(self, tensors: tuple) -> None:
        """Keep ``tensors`` until the device has run what is launched so far (kernels of
        earlier calls read them)."""
        event = None
        if self._device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._retired.append((event, tensors))

    def _release_retired(self) -> None:
        self._retired = [(event, held) for event, held in self._retired if event is not None and not event.query()]

    @property
    def symmetric_bytes(self) -> int:
        held = (self.recv_meta, self.combine, self.flags)
        receive = sum(t.numel() * t.element_size() for t in (self.recv, self.recv_scales) if t is not None)
        if self.recv_native is not None:
            receive = max(receive, self.recv_native.numel() * self.recv_native.element_size())
        return receive + sum(t.numel() * t.element_size() for t in held)

    @property
    def local_bytes(self) -> int:
        held = (self.h, self.h_scales)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def failure(self) -> str | None:
        """What made a call on these buffers fail on the device, or None (reads host memory
        only)."""
        return self.records.failure(self.timeout_s)

    def raise_if_failed(self) -> None:
        """Raise if a call on these buffers failed on the device."""
        message = self.failure()
        if message is not None:
            raise RuntimeError(message)

    def poisoned_or_failed(self) -> bool:
        """Raise if a call failed; whether the device poisoned the buffers after the host's
        last acknowledgement (a wait for a record then ends: a poisoned call writes none)."""
        self.raise_if_failed()
        epoch, _ = self.records.poisoned()
        return epoch not in (0, self.acknowledged)

    def bad_id_message(self) -> str | None:
        """The message of a poisoning not yet raised for (``sync``), or None; reads host memory only."""
        epoch, call = self.records.poisoned()
        if epoch in (0, self.acknowledged):
            return None
        bad = self.records.bad_id(call)
        shape = self.shape
        if call == 0:
            return describe_bad_id(bad, shape.ep, shape.local_experts, shape.top_k, shape.rank, 0, 0)
        if bad is None:  # the record of a poisoning is written before its epoch: never
            return f"mega_moe fused: call {call} poisoned the buffers (epoch {epoch}) but recorded no bad id"
        return describe_bad_id(bad, shape.ep, shape.local_experts, shape.top_k, shape.rank, call, self.calls + 1)

    def raise_pending(self) -> None:
        """Before a call launches anything: raise a recorded failure (``RuntimeError``) or a
        bad expert id not yet raised for (``ValueError``). Raising for a bad id
        acknowledges it (``sync.acknowledge_kernel``, queued on the current stream), and every
        rank numbers its calls alike from there (``CALL_RESYNC_GAP``)."""
        self.raise_if_failed()
        message = self.bad_id_message()
        if message is None:
            return
        epoch, call = self.records.poisoned()
        self.acknowledged = epoch
        launch(acknowledge_kernel, (1,), self.state, epoch)
        self.calls = self.resync_call = call + CALL_RESYNC_GAP
        self.resident = None
        raise ValueError(message)

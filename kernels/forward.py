"""Host side of the fused forward: the buffers it needs, the routing layout (shared with
the backward), the four launches, and the checks every call makes before launching.

Counts, offsets and tile counts are computed and read on the device, and every grid is
sized by capacity. The host waits for the device in one place only: it reads from host
memory the record a forward's layout kernel wrote (``ForwardBuffers.received_rows``),
once that forward's launches are made (the GPU keeps the call's kernels queued). Where an
expert id was out of range, the layout let the kernels do nothing, and the reader raises
naming it; where the receive buffers hold fewer rows than any routing can bring
(``ForwardShape.receive_load``) and the most rows its layout found any rank receives did
not fit, the layout let the kernels do nothing too, and the forward grows the buffers and
runs again (``ForwardBuffers.grow_to_fit``). A forward reads its own record at once only
where it must (buffers that may not fit, or no backward to read it): otherwise its
backward does, or the next forward, so that the host may run a call ahead of the device
(``ForwardBuffers.unread_forward``). A failure on the device (``sync``) is read from the
status record, also in host memory.
"""

import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from titan_megamoe.kernels import sync
from titan_megamoe.kernels.configs import INTERPRET, RowsGemmTiles, TileConfig
from titan_megamoe.kernels.dispatch_gemm1 import dispatch_gemm1_kernel
from titan_megamoe.kernels.gemm2_combine import (
    combine_reduce_kernel,
    combine_release_kernel,
    rows_gemm_combine_kernel,
)
from titan_megamoe.kernels.gluon.sm90.grouped_gemm import (
    FP8_BLOCK,
    CombineRows,
    ExpertLayout,
    GemmTiles,
    grouped_gemm,
)
from titan_megamoe.kernels.gluon.sm90.arrivals import ChunkFlags
from titan_megamoe.kernels.gluon.sm90.gate_up_gemm import (
    GATE_UP_BLOCK_N,
    GateUpTensors,
    gate_up_gemm,
    gate_up_tile_rows,
)
from titan_megamoe.kernels.gluon.sm90.mma import MMA_ROWS
from titan_megamoe.kernels.launch import fork_stream, join_stream, launch
from titan_megamoe.kernels.layout import layout_kernel
from titan_megamoe.kernels.mainloop import mx_dot
from titan_megamoe.kernels.quantize import quantize_rows, quantize_weights
from titan_megamoe.kernels.sync import (
    NUM_BLOCKS,
    RECEIVED_BAD_ID,
    RECEIVED_BAD_RANK,
    RECEIVED_BAD_SLOT,
    RECEIVED_CALL,
    RECEIVED_COUNTS,
    RECEIVED_MOST,
    RECEIVED_ROWS,
    RECEIVED_SLOTS,
    RECEIVED_STATUS,
    STATE_WORDS,
    STATUS_WORDS,
    FlagLayout,
)
from titan_megamoe.precision import NATIVE, Format

logger = logging.getLogger(__name__)

TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
"""Activation dtypes as the kernels name them (the rounding of ``h`` before quantizing)."""

RECEIVED_POLL_S = 20e-6
"""How long ``received_rows`` sleeps between reads of a record not yet written."""

RECEIVE_GROWTH = 1.25
"""Receive buffers that must grow (``ForwardBuffers.grow_to_fit``) take this multiple of the
rows that did not fit, at most what any routing can bring: a load that creeps up makes
the group allocate (collectively) seldom."""


class BadExpertId(NamedTuple):
    """An expert id outside [0, E) that a call's layout found (``sync.BAD_EXPERT_ID``)."""

    rank: int
    """The first rank of the group whose ``topk_idx`` holds one."""
    slot: int
    """Its flat index there, ``token * top_k + j``: the rank's first negative id, else
    its first one from E on."""
    value: int


class ReceivedRows(NamedTuple):
    """What a forward's layout kernel records of the rows this rank received
    (``ForwardBuffers.received_rows``)."""

    total: int
    """All of them, each local expert's padded to ``row_align``."""
    most: int
    """The most any rank of the group receives, counted as ``total``."""
    per_expert: tuple[int, ...]
    """Each local expert's."""
    bad_id: BadExpertId | None = None
    """An id out of range in some rank's ``topk_idx``: the call then computed nothing."""

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
        """Rows of a receive buffer that holds ``received`` rows (each local expert's
        aligned), and a tile's rows of slack that the last expert's last tile reads past
        its rows (``layout``)."""
        align = tiles.row_align
        return math.ceil(received / align) * align + tiles.block_m

    def most_receive_rows(self, tiles: TileConfig) -> int:
        """Rows of a receive buffer that any routing fits: every source's every row, each
        expert's alignment padding (``TileConfig.row_align``)."""
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


class ForwardBuffers:
    """Everything one (group, shape, tiles) needs, allocated once and reused by every call.

    Symmetric (peers write into them): the receive buffer and the origin of each of its
    rows, the combine buffer, the flag buffer. Local: GEMM1's output ``h``, the layout
    arrays, the per-call state and the status record (in host memory on GPUs, so the host
    can read a failure without synchronising). Every call runs on the stream the buffers
    were made on: the protocol orders one stream's calls, not two.

    The buffers with a row per received row (the receive buffer, its rows' origins, ``h``,
    and those ``on_grow`` adds) hold ``ForwardShape.receive_rows``; where that is fewer
    than any routing can bring, they grow when a call brings more (``grow_to_fit``).
    """

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
        self._grow_hooks: list[Callable[[int], None]] = []
        self._allocate_rows(shape.receive_rows(tiles))
        self.combine, self.combine_ptrs = symmetric((shape.rows_per_rank, shape.hidden), shape.dtype)
        self.flags, self.flag_ptrs = symmetric((self.flag_layout.words,), torch.int64)

        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        num_experts = shape.ep * shape.local_experts
        pinned = device.type == "cuda"
        self.status = torch.zeros(STATUS_WORDS, dtype=torch.int64, pin_memory=pinned)
        self.received = torch.zeros(RECEIVED_SLOTS.value, RECEIVED_COUNTS.value + shape.local_experts,
                                    dtype=torch.int64, pin_memory=pinned)
        """The received-rows record (``sync``), in host memory: ``received_rows`` reads it."""
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=device)
        self.state[sync.STATUS_ADDR.value] = self.status.data_ptr()
        self.state[sync.RECEIVED_ADDR.value] = self.received.data_ptr()
        self.dest_start = ints(num_experts)
        self.item_start = ints(num_experts)
        self.local_base = ints(shape.local_experts)
        self.block_base = ints(shape.local_experts)
        self.local_rows = ints(shape.local_experts)
        self.src_offset = ints(shape.ep * shape.local_experts)
        self.src_rows = ints(shape.ep * shape.local_experts)
        # Sort keys in the narrowest type that holds -1 .. E (``sort_rows``).
        key_dtype = torch.int16 if num_experts < 2**15 else torch.int32
        self.expert_edges = torch.arange(num_experts + 1, dtype=key_dtype, device=device)
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.timeout_s = 0.0
        """The deadline of the last call (for the failure message)."""
        self.calls = 0
        """Calls (forward or backward) made on these buffers, counted on the host."""
        self.received_wait_s = 0.0
        """Host seconds calls have spent waiting for a record to be written
        (``received_rows``: a forward for its own, a backward for its forward's); tools
        that time the host leave them out."""
        self.warned_unsized = False
        """Whether a backward said it could not size its buffers by its forward's rows."""
        self.resident = None
        """``(call, inputs_key)`` of the forward whose expert inputs the receive buffer holds."""
        self.unread_forward: int | None = None
        """A forward call whose record no one has read yet (``fused_forward`` with
        ``backward_reads_record``): its backward reads it (``check_record``), else the next
        forward on these buffers does."""

    def _allocate_rows(self, rows: int) -> None:
        """(Re)allocate the buffers with a row per received row, ``rows`` each (symmetric
        ones collectively)."""
        shape, scale_k = self.shape, self.row_format.row_scale_k
        # The old buffers go first (nothing in flight reads them: ``grow_to_fit``).
        self.recv = self.recv_scales = self.recv_native = self.recv_meta = self.h = self.h_scales = None
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

    def on_grow(self, allocate_rows: Callable[[int], None]) -> None:
        """Have ``grow_to_fit`` also call ``allocate_rows(rows)`` when the buffers grow (the
        backward's buffers per received row)."""
        self._grow_hooks.append(allocate_rows)

    @property
    def capacity_rows(self) -> int:
        """The most rows (each local expert's aligned) a call may bring a rank: the
        receive buffers' rows less the tile of slack (``layout``)."""
        return self.recv.shape[0] - self.tiles.block_m

    def checks_fit(self) -> bool:
        """Whether a routing can bring a rank more rows than ``capacity_rows``."""
        return self.recv.shape[0] < self.shape.most_receive_rows(self.tiles)

    def check_record(self, call: int, timeout_s: float, reader: str) -> ReceivedRows | None:
        """The record of forward ``call`` (``received_rows``), read by ``reader`` (the
        forward, its backward, or a later forward); raises ``ValueError`` naming a bad
        expert id it holds (``describe_bad_id``). None if the slot has been rewritten."""
        if self.unread_forward == call:
            self.unread_forward = None
        received = self.received_rows(call, timeout_s)
        if received is not None and received.bad_id is not None:
            raise ValueError(describe_bad_id(received.bad_id, self.shape, call, reader))
        return received

    def grow_to_fit(self, call: int, received: ReceivedRows) -> bool:
        """After a forward's first run (``call``, its launches made, and ``received`` its
        record, ``received_rows``): where the most rows any rank of the group receives did
        not fit the receive buffers, the layout let the call do nothing (``layout``); grow
        every buffer with a row per received row to ``ForwardShape.grown_receive_rows`` and
        return True: the forward runs again. Buffers that hold every row any routing can
        bring always fit.

        Every rank reads the same count for the same call, so all grow alike, collectively.
        Nothing in flight touches the old buffers: the call's kernels stored nothing, and
        its count exchange, the call's start barrier, ran after every peer's earlier calls."""
        if received.most <= self.capacity_rows:
            return False
        grown = self.shape.grown_receive_rows(received.most, self.tiles)
        logger.info(
            f"mega_moe fused: call {call} brings a rank {received.most} rows, more than the receive buffers' "
            f"{self.capacity_rows}: every rank grows them to {grown - self.tiles.block_m} rows and runs the "
            f"call again (receive_load {self.shape.receive_load} sized them for "
            f"{self.shape.receive_rows(self.tiles) - self.tiles.block_m})"
        )
        self._allocate_rows(grown)
        for allocate_rows in self._grow_hooks:
            allocate_rows(grown)
        return True

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

    def received_rows(self, call: int, timeout_s: float) -> ReceivedRows | None:
        """The rows this rank received in ``call`` (a forward's, ``fused_forward``) and
        any bad expert id, read from the record its layout kernel writes into host memory:
        at once if the device has run that kernel, else once it has (raises if the call
        failed, or past ``timeout_s``). None if that slot has since been written by a call
        ``RECEIVED_SLOTS`` or more later."""
        slot = self.received[call % RECEIVED_SLOTS.value]
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            words = slot.tolist()
            written = words[RECEIVED_CALL.value]
            # The kernel writes the rows before the call: a second read of the call tells
            # whether the slot was rewritten between the two.
            if written == call and slot[RECEIVED_CALL.value].item() == call:
                self.received_wait_s += time.monotonic() - start
                bad_id = None
                if words[RECEIVED_STATUS.value] == sync.BAD_EXPERT_ID.value:
                    bad_id = BadExpertId(words[RECEIVED_BAD_RANK.value], words[RECEIVED_BAD_SLOT.value],
                                         words[RECEIVED_BAD_ID.value])
                return ReceivedRows(words[RECEIVED_ROWS.value], words[RECEIVED_MOST.value],
                                    tuple(words[RECEIVED_COUNTS.value:]), bad_id)
            if written > call:
                return None
            self.raise_if_failed()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"mega_moe fused: call {call} had not published the rows it received after "
                    f"{timeout_s:.1f} s (its record holds call {written})"
                )
            time.sleep(RECEIVED_POLL_S)

    def publish_received(self, call: int, total: int, most: int, per_expert: list[int]) -> None:
        """Write ``call``'s record as its layout kernel would, with no bad id, for tools
        whose launches compile the kernels without running them
        (``scripts/kernel_resources.py``, the virtual-rank tests' loading pass): the forward
        and its backward read it."""
        record = torch.zeros_like(self.received[0])
        record[RECEIVED_ROWS.value], record[RECEIVED_MOST.value] = total, most
        record[RECEIVED_COUNTS.value:] = torch.tensor(per_expert)
        record[RECEIVED_CALL.value] = call
        self.received[call % RECEIVED_SLOTS.value] = record

    def failure(self) -> str | None:
        """What made a call on these buffers fail on the device, or None (reads host memory
        only)."""
        return describe_failure(self.status.tolist(), self.timeout_s)

    def raise_if_failed(self) -> None:
        """Raise if a call on these buffers failed on the device."""
        message = self.failure()
        if message is not None:
            raise RuntimeError(message)


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


def weights_in_bf16(fmt: Format, tiles: TileConfig) -> bool:
    """Whether the GEMMs take quantized weights dequantized to bf16 (the same values): MX
    held in bf16, or handed over so to a mainloop that scales only its A operand
    (``mx_dequantized_weights``; ``quantize_weights`` refuses either for other than 1 x K
    blocks)."""
    return bool(fmt.round_k or tiles.mx_dequantized_weights)


def weight_scale_rows(fmt: Format, tiles: TileConfig) -> int:
    """Rows of a weight scale block as the GEMM kernels take it (``W_SCALE_N``): the
    format's, or 0 where the weights are handed over in bf16 (``weights_in_bf16``)."""
    return 0 if weights_in_bf16(fmt, tiles) else fmt.weight_block[0]


def pad(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def describe_failure(status: list[int], timeout_s: float) -> str | None:
    """The message of a status record (``sync``), or None when it records no failure."""
    code, rank, index, seen, expected, _claim, call = status[:7]
    if not code:
        return None
    if code == sync.RECEIVE_OVERFLOW.value:
        what = (f"rank {rank}: call {call} brings rank {index} {seen} rows, more than the {expected} its receive "
                "buffers hold, after its forward grew them")
    elif code == sync.PEER_FAILED.value:
        what = (f"rank {rank} stopped in call {call} because rank {index} failed "
                f"({sync.FAILURES.get(seen, seen)})")
    else:
        what = (f"rank {rank} timed out after {timeout_s:g} s waiting for "
                f"{sync.FAILURES.get(code, code)}[{index}] (value {seen}, expected {expected}) "
                f"in call {call}: a peer stopped or fell that far behind")
    return (f"mega_moe fused kernels: {what}. Every rank of the EP group stopped in that call "
            "and no result of it was returned; the process must restart (on GPUs the kernels "
            "ended its CUDA context)")


def describe_bad_id(bad: BadExpertId, shape: ForwardShape, call: int, reader: str) -> str:
    """The message of forward ``call``, whose layout found an expert id out of range, as
    this rank (``shape.rank``) raises it where ``reader`` read the call's record."""
    token, slot = divmod(bad.slot, shape.top_k)
    owner = "" if bad.rank == shape.rank else f"rank {bad.rank}'s "
    return (f"mega_moe fused forward: {owner}topk_idx holds expert id {bad.value}, outside "
            f"[0, {shape.ep * shape.local_experts}) ({shape.ep} EP ranks x {shape.local_experts} local "
            f"experts), at token {token}, slot {slot}: the router's top-k indices must name experts of "
            f"the EP group. Every rank of the group raises this; no rank sent a row of forward call {call}, "
            f"whose output is undefined (raised by {reader}), and later calls run normally")


def check_call(num_tokens: int, buffers: ForwardBuffers, comm_programs: int, num_programs: int, what: str) -> None:
    """Raise before any launch if this call cannot run on ``buffers``."""
    buffers.raise_if_failed()
    if num_tokens > buffers.shape.capacity_tokens_per_rank:
        raise ValueError(
            f"mega_moe fused {what}: {num_tokens} tokens exceed capacity_tokens_per_rank = "
            f"{buffers.shape.capacity_tokens_per_rank}, which its buffers were sized for"
        )
    if not 0 < comm_programs < num_programs:
        raise ValueError(f"comm_sms = {comm_programs} must be in [1, {num_programs - 1}]")
    if buffers.stream is not None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"mega_moe fused {what}: cannot be captured in a CUDA graph: each call advances "
                "epochs counted on the host and on the device, which a replay would not"
            )
        stream = torch.cuda.current_stream(buffers.stream.device)
        if stream != buffers.stream:
            raise RuntimeError(
                f"mega_moe fused {what}: called on {stream}, but its buffers belong to "
                f"{buffers.stream}: the protocol orders the calls of one stream only"
            )


def after_launches(buffers: ForwardBuffers) -> None:
    """Under the interpreter, launches are synchronous: raise now if one failed (on GPUs
    the kernels stop the process instead, see ``sync``)."""
    if INTERPRET:
        buffers.raise_if_failed()


def inputs_key(x, topk_idx, topk_w, w1, w3, score_before_experts: bool) -> tuple:
    """What identifies the expert inputs a forward dispatched: each tensor's storage and
    version (a tensor changed in place, or freed and replaced, gives another key)."""
    return (score_before_experts,) + tuple(
        (t.data_ptr(), -1 if t.is_inference() else t._version) for t in (x, topk_idx, topk_w, w1, w3)
    )


def routing_numel(shape: ForwardShape, num_tokens: int, top_k: int) -> int:
    """Elements of a call's routing (``sort_rows``)."""
    return num_tokens * top_k + shape.ep * shape.local_experts + 1


def sort_rows(topk_idx: torch.Tensor, buffers: ForwardBuffers) -> torch.Tensor:
    """The call's routing, int32 ``[order | send_start]``: the rows' send order (flat slot
    ids, sorted by expert, stable) and each expert's first position in it. The forward
    returns it for its backward, which routes the same rows without sorting them again."""
    shape = buffers.shape
    flat = topk_idx.reshape(-1)
    n = flat.numel()
    # Clamped first so that no bad id can wrap into the valid range (ids below 0 sort as
    # -1, ids from E on as E), then sorted in the narrowest type that holds them
    # (``expert_edges``): each byte of key is a radix pass.
    experts = shape.ep * shape.local_experts
    keys = flat.clamp(-1, experts).to(buffers.expert_edges.dtype)
    sorted_experts, order = torch.sort(keys, stable=True)
    routing = torch.empty(routing_numel(shape, *topk_idx.shape), dtype=torch.int32, device=topk_idx.device)
    routing[:n].copy_(order)
    torch.searchsorted(sorted_experts, buffers.expert_edges, out_int32=True, out=routing[n:])
    return routing


def split_routing(routing: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, send_start)`` views of a routing (``sort_rows``) of ``num_rows`` rows."""
    return routing[:num_rows], routing[num_rows:]


def layout(topk_idx: torch.Tensor, routing: torch.Tensor, buffers: ForwardBuffers, timeout_s: float,
           needs_input: bool = True, skip_overflow: bool = False) -> torch.Tensor:
    """Run the layout kernel on a call's routing (``sort_rows``): a new epoch, whose count
    exchange is also the call's start barrier (``sync``). ``needs_input``: whether the
    peers must send this rank its expert inputs (published as NEEDS_INPUT).
    ``skip_overflow``: rows that do not fit the receive buffers make the call do nothing
    (a forward's first run, ``ForwardBuffers.grow_to_fit``), not fail. Returns the rows
    received per local expert (int64)."""
    shape, flags = buffers.shape, buffers.flag_layout
    flat = topk_idx.reshape(-1)
    order, send_start = split_routing(routing, flat.numel())
    tokens_per_expert = torch.empty(shape.local_experts, dtype=torch.int64, device=topk_idx.device)
    buffers.calls += 1
    buffers.timeout_s = timeout_s
    launch(layout_kernel, (1,),
        order, flat, flat.numel(), send_start, buffers.flags, buffers.flag_ptrs, buffers.state,
        buffers.dest_start, buffers.item_start, buffers.local_base, buffers.block_base, buffers.local_rows,
        buffers.src_offset, buffers.src_rows, tokens_per_expert, shape.rank, shape.ep,
        shape.local_experts, int(needs_input), int(timeout_s * 1e9), buffers.calls, buffers.capacity_rows,
        int(skip_overflow),
        COUNTS=flags.counts, COUNT_READY=flags.count_ready, NEEDS_INPUT=flags.needs_input,
        BAD_IDS=flags.bad_ids, EP_PAD=pad(shape.ep), LOCAL_PAD=pad(shape.local_experts), BLOCK_M=buffers.tiles.block_m,
        ROW_ALIGN=buffers.tiles.row_align, num_warps=4,
    )
    after_launches(buffers)  # what follows a failed layout must not run on its arrays
    return tokens_per_expert


def preact_shape(shape: ForwardShape, tiles: TileConfig, load: float, num_tokens: int) -> tuple[int, int]:
    """Shape of the saved pre-activations ``[gate | up]`` of a call of ``num_tokens``
    tokens: the receive layout's first rows, ``load`` times the layout's rows at the mean
    load (the rows a rank receives on average, plus half an alignment's padding per local
    expert), in whole alignments and at most the receive buffer's rows
    (``OperatorSettings.save_gemm1_load``). The call's own routed rows stand for the mean,
    not the capacity's: the ranks of a job pass like counts, and rows past the saved ones
    are recomputed."""
    align = tiles.row_align
    mean = num_tokens * shape.top_k
    rows = math.ceil(load * (mean + shape.local_experts * align // 2) / align) * align
    return min(rows, shape.most_receive_rows(tiles)), 2 * shape.inter


def fused_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    buffers: ForwardBuffers,
    score_before_experts: bool,
    comm_programs: int,
    num_programs: int,
    timeout_s: float,
    preact: torch.Tensor | None = None,
    backward_reads_record: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``y [T, H]``, the rows received per local expert (int64), see ``reference``, the
    call's routing (``sort_rows``) and its number on ``buffers`` (``received_rows``), which
    its backward takes.

    ``num_programs`` persistent programs run each GEMM; the first ``comm_programs`` of
    them dispatch before they join GEMM1. ``preact`` (``preact_shape``), when given,
    receives GEMM1's pre-activations of the receive layout's first rows for the backward. With a quantized
    ``buffers.row_format`` the weights are quantized in its weight blocks and ``x`` once
    per token before the kernels send it (held in bf16: rounded so).

    Once its launches are made it reads its layout's record (``ForwardBuffers.check_record``):
    an expert id out of range in any rank's ``topk_idx`` raises ``ValueError`` naming it,
    on every rank (the kernels did nothing); a first run whose rows did not fit the receive
    buffers did nothing, and the second runs on grown buffers (``ForwardBuffers.grow_to_fit``).
    With ``backward_reads_record`` (autograd will run the call's backward, which reads the
    record anyway) and buffers that hold any routing's rows, the forward leaves the record
    to its backward, else to the next forward, and returns without waiting for the device:
    the host stays ahead of the GPU. The ranks of a group pass it alike.
    """
    shape, tiles, flags = buffers.shape, buffers.tiles, buffers.flag_layout
    num_tokens, top_k = topk_idx.shape
    check_call(num_tokens, buffers, comm_programs, num_programs, "forward")
    ep_pad, local_pad = pad(shape.ep), pad(shape.local_experts)
    routing = sort_rows(topk_idx, buffers)
    order, send_start = split_routing(routing, topk_idx.numel())
    inputs = inputs_key(x, topk_idx, topk_w, w1, w3, score_before_experts)
    fmt = buffers.row_format
    w1_scales = w2_scales = w3_scales = sent_scales = None
    sent = x
    if fmt.quantized:
        in_bf16 = weights_in_bf16(fmt, tiles)
        (w1, w1_scales), (w2, w2_scales), (w3, w3_scales) = quantize_weights([w1, w2, w3], fmt, in_bf16)
        if not score_before_experts:
            sent, sent_scales = quantize_rows(x, fmt.activation_block[1], fmt.power_of_two, bool(fmt.round_k))
    y = torch.empty_like(x)
    gluon_gemm1 = runs_gluon_gemm1(tiles, fmt, x.dtype, shape.hidden, shape.inter)

    def run(first: bool) -> torch.Tensor:
        tokens_per_expert = layout(topk_idx, routing, buffers, timeout_s, skip_overflow=first)
        # With GEMM1 on the Gluon core the dispatch kernel runs the communication programs
        # alone, and the core runs the others on a stream beside it: its load warp waits
        # for the rows it copies, as the tl kernel's GEMM programs do.
        side = fork_stream(x.device) if gluon_gemm1 else None
        launch(dispatch_gemm1_kernel, (comm_programs if gluon_gemm1 else num_programs,),
            sent, sent_scales, topk_w, order, send_start, buffers.dest_start, buffers.item_start,
            buffers.recv_ptrs, buffers.recv_meta_ptrs, buffers.flag_ptrs, buffers.recv, buffers.recv_scales,
            buffers.recv_meta, buffers.flags, buffers.state, buffers.local_base, buffers.block_base,
            buffers.local_rows, buffers.src_offset, buffers.src_rows, w1, w1_scales, w3, w3_scales, buffers.h, buffers.h_scales,
            buffers.h if preact is None else preact, 0 if preact is None else preact.shape[0],
            shape.rank, shape.ep, shape.local_experts, shape.rows_per_rank,
            HIDDEN=shape.hidden, INTER=shape.inter, TOP_K=top_k,
            SCORE_BEFORE_EXPERTS=score_before_experts, SAVE_GEMM1=preact is not None,
            COMM_PROGRAMS=comm_programs, CHUNK_READY=flags.chunk_ready,
            MAX_CHUNKS=flags.max_chunks, EP_PAD=ep_pad, LOCAL_PAD=local_pad, BLOCK_M=tiles.block_m, TILE_M=tiles.gemm1_m,
            BLOCK_N=tiles.gemm1_n, BLOCK_K=tiles.gemm1_k, COPY_ROWS=tiles.copy_rows,
            COPY_COLS=tiles.copy_cols, UPCAST_DOT=INTERPRET, SCALE_K=fmt.row_scale_k,
            W_SCALE_N=weight_scale_rows(fmt, tiles), MX_DOT=mx_dot(fmt, tiles.mx_upcast), POWER_OF_TWO=fmt.power_of_two,
            ACT_DTYPE=TRITON_DTYPES[x.dtype], ROUND_K=fmt.round_k, CLAIM_AHEAD=bool(tiles.gemm1_claim_ahead),
            DISPATCH_ONLY=gluon_gemm1, num_warps=tiles.gemm1_warps, num_stages=tiles.gemm1_stages,
        )
        if gluon_gemm1:
            with torch.cuda.stream(side):
                gate_up_gemm(
                    buffers.recv, w1, w3, expert_layout(buffers), chunk_flags(buffers),
                    GateUpTensors(buffers.h, buffers.h_scales, preact),
                    GemmTiles(tiles.gemm1_n, tiles.gemm1_k, tiles.gemm1_stages), act_dtype=x.dtype,
                    x_scale=buffers.recv_scales, w1_scale=w1_scales, w3_scale=w3_scales,
                    power_of_two=fmt.power_of_two, programs=num_programs - comm_programs,
                )
            join_stream(side)
        rows_gemm_combine(buffers, tiles, tiles.gemm2, buffers.h, buffers.h_scales, w2, w2_scales, None, fmt,
                          fmt.row_scale_k, num_programs)
        reduce(buffers, topk_w, x, y, topk_w, num_tokens, top_k, num_programs,
               scale_by_score=not score_before_experts, score_dot=False)
        after_launches(buffers)
        return tokens_per_expert

    tokens_per_expert = run(first=True)
    call = buffers.calls
    deferred = backward_reads_record and not buffers.checks_fit()
    if not deferred:
        received = buffers.check_record(call, timeout_s, "the forward itself")
        if received is None:
            raise RuntimeError(f"mega_moe fused forward: call {call}'s record was overwritten before it was read")
        if buffers.grow_to_fit(call, received):
            tokens_per_expert = run(first=False)
    buffers.resident = (buffers.calls, inputs)
    # An earlier forward's record that no backward read: read last, so that a raise here
    # leaves the buffers' state that of this call, which every rank ran.
    earlier, buffers.unread_forward = buffers.unread_forward, call if deferred else None
    if earlier is not None:
        buffers.check_record(earlier, timeout_s, "the next forward on these buffers (no backward ran)")
    return y, tokens_per_expert, routing, buffers.calls


GLUON_OPERANDS = (torch.bfloat16, torch.float8_e4m3fn)
"""Operand dtypes the Gluon core multiplies (``TileConfig.gemm2_kernel``)."""


@functools.cache
def say_once(message: str) -> None:
    """``message`` in the log, the first time only."""
    logger.warning(message)


def gluon_takes_rows(fmt: Format, dtype: torch.dtype) -> bool:
    """Whether the Gluon core's GEMM1 and backward's first GEMM take rows in ``fmt`` of
    activation ``dtype``: blockwise fp8 (any activation dtype: the rows are e4m3), or bf16."""
    return fmt.name == "fp8_block" or (dtype == torch.bfloat16 and not (fmt.quantized or fmt.round_k))


def runs_gluon_gemm1(tiles: TileConfig, fmt: Format, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether GEMM1 runs the Gluon core (``TileConfig.gemm1_kernel``): the row names it,
    and it takes the operands (bf16 rows, or blockwise fp8 ones whose ``h`` is scaled per
    128 columns) and the layer (sizes multiples of its tiles); where the row names it and
    it cannot, the log says so, once."""
    if tiles.gemm1_kernel != "gluon":
        return False
    tile_rows = gate_up_tile_rows(fmt.quantized)
    if (gluon_takes_rows(fmt, dtype) and inter % GATE_UP_BLOCK_N == hidden % tiles.gemm1_k == 0
            and tiles.block_m % tile_rows == 0):
        return True
    say_once(f"mega_moe fused: the tile row names the Gluon core for GEMM1, which takes bf16 or blockwise fp8 rows, "
             f"an intermediate size that is a multiple of {GATE_UP_BLOCK_N} and blocks of whole tiles; {fmt.name} on "
             f"{dtype} rows with intermediate size {inter} and block_m {tiles.block_m} (tiles of {tile_rows} rows) "
             f"runs the tl kernel instead")
    return False


def expert_layout(buffers: ForwardBuffers) -> ExpertLayout:
    """The receive layout of the buffers' current call, as the Gluon core reads it."""
    return ExpertLayout(buffers.local_base, buffers.local_rows, buffers.block_base,
                        buffers.state[NUM_BLOCKS.value:NUM_BLOCKS.value + 1], buffers.tiles.block_m,
                        buffers.capacity_rows)


def chunk_flags(buffers: ForwardBuffers) -> ChunkFlags:
    """Where the buffers' received chunks are announced, as the Gluon core waits for them."""
    shape, flags = buffers.shape, buffers.flag_layout
    return ChunkFlags(buffers.flags, buffers.flag_ptrs, buffers.state, buffers.src_offset, buffers.src_rows,
                      shape.rank, shape.ep, flags.chunk_ready, flags.max_chunks)


def rows_gemm_combine(buffers: ForwardBuffers, tiles: TileConfig, phase: RowsGemmTiles, a: torch.Tensor, a_scales,
                      w: torch.Tensor, w_scales, w_rest, fmt: Format, scale_k: int, num_programs: int,
                      score: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """``a [rows, K] w[e]^T`` for every received row, each pushed to its source rank's combine
    buffer, then COMBINE_READY released to every peer (``gemm2_combine``): GEMM2, and the
    dgrad GEMM with ``score = (parts, score_grad, score_grad_ptrs, parts per row)``, whose
    sums go back too. ``w [local experts, N, K]`` (or, ``w_rest`` given, as stored: see
    ``rows_gemm_combine_kernel``); quantized, ``a`` has a scale per ``scale_k`` columns
    and ``w`` per weight block of ``fmt``. ``tiles``: the tile row of ``fmt`` (the
    forward's for GEMM2, the backward's for dgrad), whose ``phase`` (``TileConfig.gemm2``,
    ``.dgrad``) names the implementation and its tiles; the receive layout's blocks are
    the buffers' (``buffers.tiles.block_m``)."""
    shape, flags, block_m = buffers.shape, buffers.flag_layout, buffers.tiles.block_m
    n_dim, k_dim = shape.hidden, a.shape[1]
    parts_tensor, score_grad, score_grad_ptrs, parts = score or (a, buffers.flags, buffers.flag_ptrs, 0)
    if phase.kernel == "gluon" and a.dtype not in GLUON_OPERANDS:
        raise ValueError(f"the tile row names the Gluon rows GEMM, which multiplies bf16 or e4m3 operands; these "
                         f"are {a.dtype} (name gemm2_kernel / dgrad_kernel 'tl' in that row)")
    release = dict(SCORE_PARTS=parts, PARTS_PAD=pad(parts), COMBINE_READY=flags.combine_ready,
                   LOCAL_PAD=pad(shape.local_experts), BLOCK_M=block_m)
    common = (buffers.recv_meta, buffers.flags, buffers.flag_ptrs, buffers.state, buffers.local_base,
              buffers.block_base, buffers.local_rows, shape.rank, shape.ep, shape.local_experts, shape.rows_per_rank)
    if phase.kernel == "tl":
        launch(rows_gemm_combine_kernel, (num_programs,),
            a, a_scales, w, w_scales, w_rest, common[0], buffers.combine, buffers.combine_ptrs, parts_tensor,
            score_grad, score_grad_ptrs, *common[1:], N=n_dim, K=k_dim, **release, TILE_M=phase.m, BLOCK_N=phase.n,
            BLOCK_K=phase.k, UPCAST_DOT=INTERPRET, SCALE_K=scale_k, W_SCALE_N=weight_scale_rows(fmt, tiles),
            MX_DOT=mx_dot(fmt, tiles.mx_upcast), W_AS_STORED=w_rest is not None,
            num_warps=phase.warps, num_stages=phase.stages,
        )
        return
    if w_rest is not None:
        raise ValueError("the Gluon rows GEMM reads the weight transposed, not as stored (w_rest)")
    if scale_k and (scale_k, weight_scale_rows(fmt, tiles)) != (FP8_BLOCK, FP8_BLOCK):
        raise ValueError(f"the Gluon rows GEMM takes blockwise fp8 (1 x {FP8_BLOCK} and {FP8_BLOCK} x {FP8_BLOCK} "
                         f"scale blocks); {fmt.name} scales 1 x {scale_k} and {fmt.weight_block}")
    grouped_gemm(a, w, buffers.combine, expert_layout(buffers), GemmTiles(phase.n, phase.k, phase.stages, phase.m // int(MMA_ROWS)),
                 a_scale=a_scales, b_scale=w_scales,
                 combine=CombineRows(buffers.recv_meta, buffers.combine_ptrs, shape.rank, shape.rows_per_rank),
                 programs=num_programs)
    # The score sums and the release, after every row is stored (stream order).
    launch(combine_release_kernel, (num_programs if parts else 1,),
           parts_tensor, score_grad, score_grad_ptrs, *common, **release)


REDUCE_MIN_TOKENS = 8
"""Fewest tokens per combine-reduction block ``reduce_tokens`` picks (each halving is
another compiled variant)."""


def reduce_tokens(most: int, num_tokens: int, num_programs: int) -> int:
    """Tokens per combine-reduction block: ``most`` (the tile table's), halved while the
    call's blocks would leave programs idle. The reduction moves ``k`` rows per token and
    is bound by memory: 4,096 tokens in 64-token blocks fill 64 of 132 SMs."""
    block_t = most
    while block_t > REDUCE_MIN_TOKENS and triton.cdiv(num_tokens, block_t) < num_programs:
        block_t //= 2
    return block_t


def reduce(buffers: ForwardBuffers, topk_w, x, out, dot_out, num_tokens: int, top_k: int,
           num_programs: int, scale_by_score: bool, score_dot: bool) -> None:
    """Sum each token's k combined rows into ``out``; ``score_dot``: also ``<row, x>`` per
    slot into ``dot_out [T, k]`` (see ``combine_reduce_kernel``)."""
    shape, tiles = buffers.shape, buffers.tiles
    block_t = reduce_tokens(tiles.reduce_tokens, num_tokens, num_programs)
    blocks = max(1, triton.cdiv(num_tokens, block_t))
    launch(combine_reduce_kernel, (min(blocks, num_programs),),
        buffers.combine, topk_w, x, out, dot_out, buffers.flags, buffers.flag_ptrs, buffers.state,
        num_tokens, shape.rank, shape.ep,
        HIDDEN=shape.hidden, TOP_K=top_k, K_PAD=pad(top_k), SCALE_BY_SCORE=scale_by_score,
        SCORE_DOT=score_dot, COMBINE_READY=buffers.flag_layout.combine_ready,
        EP_PAD=pad(shape.ep), BLOCK_T=block_t, BLOCK_H=tiles.reduce_cols,
        num_warps=tiles.reduce_warps,
    )

"""Host side of the fused backward: the buffers it adds to the forward's and its launches.

One call, all on the current stream, with no wait for the device (``sync``): the weights
as the backward's GEMMs read them (transposed, quantized), then ``buffers.rounds`` rounds
of the forward's routing (its rows' send order, ``forward.sort_rows``: the same windows
of the same receive layout), each:

1. ``layout``: the round's receive layout, and a new epoch whose count exchange is the
   round's start barrier. A rank whose receive buffer still holds this forward's expert
   inputs (the forward was the last call on these buffers, as under full activation
   checkpointing, where the layer's forward is recomputed right before its backward, and
   all of its rows came in round 0) asks for the gradient rows alone in round 0.
2. ``dispatch_grad_gemm1_kernel``: expert inputs, ``dy`` rows and scores to the owners;
   GEMM1 recomputed (or read back from the forward's ``preact``, saved by row of the full
   layout), ``dy W2``, SwiGLU backward -> ``dab = [da | db]``, ``h_wgrad`` and the
   score-gradient parts. Where the tile row says so (``grad1_kernel``) and the round's
   rows were saved, it only dispatches, and the Gluon core (``swiglu_grad_gemm``)
   computes the saved rows' tiles as they arrive; the rows past the saved ones (the device
   knows whether there are any) recompute GEMM1 in a launch of their own.
3. The dgrad rows GEMM (``forward.rows_gemm_combine``: ``rows_gemm_combine_kernel``, or
   the Gluon core and ``combine_release_kernel``): ``dab [W1 | W3]`` pushed to the source
   ranks' combine buffers, the score gradients to their ``score_grad``; COMBINE_READY.
4. The weight gradients of the round's rows: round 0 writes them, grouped over local
   experts on whole alignments (below); a later round, which only a routing that overflows
   one window brings, adds its rows' share (``accumulate_wgrad``, exiting at once where the
   round has no rows). They run while the peers may still be pushing this rank's rows.

and then ``combine_reduce_kernel``: ``dx`` summed over k in slot order (and ``<row, x>`` for
the score gradient when the score scaled the expert input; else the score gradients the
owners pushed back).

Round 0's weight gradients: unquantized, ``torch._grouped_mm`` (offsets are each expert's
aligned end, read on the device): ``dW1 = da^T x``, ``dW3 = db^T x``, then (``dab`` freed)
``dW2 = dy^T h_wgrad``. Quantized: ``x`` and ``dy`` are quantized once per token before
the first kernel, the weights and their transposes (each in its own orientation) on every
call for now, the dgrad GEMM reads ``[da | db]`` quantized, and the weight gradients run
quantized on token-major copies of their operands quantized along the rows, as the spec
says (``kernels.wgrad``); or, MX on GPUs without an MX MMA (``mx_wgrad_dequantized``),
torch's grouped GEMM on copies in the receive layout quantized along the rows and
dequantized (the same values). Native weight gradients after a quantized forward take
torch's grouped GEMM on the rows as they crossed: unquantized (``mxfp8_wgrad_bf16``: ``x``
and ``dy`` are sent as they are and GEMM1 and ``dy W2`` quantize them as they read them),
or quantized and dequantized for it (``fp8_wgrad_bf16``). MX held in bf16
(``TileConfig.mx_in_bf16``) runs the unquantized path above on operands rounded to MX
where they are made (``dy`` at its source, ``[da | db]`` in the first kernel's epilogue
beside its unrounded copy, the transposed weights as they are transposed); rows that
cross unrounded for native weight gradients are rounded as the GEMMs read them.
"""

import functools
from dataclasses import dataclass

import torch

from titan_megamoe.kernels.backward_dispatch_gemm1 import (
    ALL_TILES,
    DISPATCH_ONLY,
    PAST_SAVED_TILES,
    SAVED_TILES,
    dispatch_grad_gemm1_kernel,
)
from titan_megamoe.kernels.buffers import ForwardBuffers, SymmetricAllocator, row_buffer
from titan_megamoe.kernels.configs import INTERPRET, TileConfig
from titan_megamoe.kernels.forward import (
    TRITON_DTYPES,
    after_launches,
    check_call,
    chunk_flags,
    expert_layout,
    gluon_takes_rows,
    inputs_key,
    layout,
    reduce,
    routing_numel,
    rows_gemm_combine,
    saved_rows_of_round,
    say_once,
    weight_scale_rows,
    weights_in_bf16,
)
from titan_megamoe.kernels.gluon.sm90.grouped_gemm import FP8_BLOCK, GemmTiles
from titan_megamoe.kernels.gluon.sm90.swiglu_grad_gemm import SWIGLU_GRAD_BLOCK_N, SwigluGradTensors, swiglu_grad_gemm
from titan_megamoe.kernels.gluon.sm90.token_grouped_gemm import token_grouped_gemm
from titan_megamoe.kernels.launch import cdiv, fork_stream, join_stream, launch, next_power_of_2
from titan_megamoe.kernels.mainloop import mx_dot
from titan_megamoe.kernels.quantize import quantize_rows, quantize_weights
from titan_megamoe.kernels.sync import GEMM1_NEXT_TILE, PAST_SAVED, RECOMPUTE_NEXT_TILE
from titan_megamoe.kernels.transpose import quantize_transposed, transposed_side_by_side
from titan_megamoe.kernels.wgrad import accumulate_wgrad, dequantized_rows_kernel, token_major_kernel, wgrad_kernel
from titan_megamoe.precision import Format, Precision


class GradBuffers:
    """What the backward adds to a ``ForwardBuffers`` (same group and shape), allocated on
    the first backward: symmetric receive buffers for the ``dy`` rows and the scores, and
    the buffer the owners return score gradients into. ``precision``: the forward's
    format must be the one ``forward`` was made for. ``tiles``: the backward kernels' row
    of the tile table (its dgrad format's), with the forward's ``block_m``."""

    def __init__(self, forward: ForwardBuffers, symmetric: SymmetricAllocator, precision: Precision,
                 tiles: TileConfig):
        shape = forward.shape
        if tiles.block_m != forward.tiles.block_m:
            raise ValueError(f"the backward's tiles have block_m = {tiles.block_m}, the forward's "
                             f"{forward.tiles.block_m}: both kernels read one receive layout")
        x_link, self.dy_link = precision.backward_link
        if precision.forward != shape.row_format or (x_link != shape.row_format) != shape.native_resend:
            raise ValueError(f"precision {precision.name!r} does not match the forward buffers' row format "
                             f"{shape.row_format.name} (native_resend = {shape.native_resend})")
        self.mx_wgrad_block = precision.wgrad.activation_block[1] if (
            precision.wgrad.scaled_mma and tiles.mx_wgrad_dequantized) else 0
        """Tokens per MX block of the weight gradients' operands when they are quantized along
        the tokens in the receive layout (``mx_wgrad_dequantized``); 0 otherwise."""
        if self.mx_wgrad_block and forward.tiles.row_align % self.mx_wgrad_block:
            raise ValueError(f"mx_wgrad_dequantized = 1 quantizes whole {self.mx_wgrad_block}-token blocks "
                             f"of the receive layout; its row_align = {forward.tiles.row_align} is not a multiple")
        self.dy_link = tiles.operand_format(self.dy_link)
        self.tiles = tiles
        self.grad_format = tiles.operand_format(precision.dgrad)
        """Format of the backward's data-gradient GEMMs (``dy W2``, dgrad), as the kernels
        hold it (``TileConfig.operand_format``)."""
        for field, weight in (("w2_as_stored", "W2"), ("w13_as_stored_rows", "W1 and W3")):
            if getattr(tiles, field) and self.grad_format.quantized:
                raise ValueError(f"{field} = {getattr(tiles, field)} reads {weight} unquantized; the backward's "
                                 f"format is {self.grad_format.name}")
        whole_k_steps = shape.inter % tiles.dgrad_k == 0
        self._w13_as_stored_below = tiles.w13_as_stored_rows * shape.local_experts if whole_k_steps else 0
        self.wgrad_format = precision.wgrad
        """Format of the weight-gradient GEMMs."""
        self._symmetric, self._hidden, self._dtype = symmetric, shape.hidden, shape.dtype
        self._allocate_rows(forward.recv.shape[0])
        forward.on_grow(self._allocate_rows)
        self.score_grad, self.score_grad_ptrs = symmetric((shape.rows_per_rank,), torch.float32)

    def _allocate_rows(self, rows: int) -> tuple:
        """(Re)allocate the receive buffers of the ``dy`` rows and the scores, ``rows`` each,
        collectively, as the forward's grow (``ForwardBuffers.on_grow``); returns the old
        ones, which kernels in flight may still read."""
        old = tuple(getattr(self, name, None) for name in ("recv_grad", "recv_grad_scales", "recv_grad_ptrs",
                                                           "recv_score", "recv_score_ptrs"))
        self.recv_grad, self.recv_grad_scales, self.recv_grad_ptrs, _ = row_buffer(
            self._symmetric, rows, self._hidden, self._dtype, self.dy_link.row_scale_k)
        self.recv_score, self.recv_score_ptrs = self._symmetric((rows,), torch.float32)
        return old

    def reads_w13_as_stored(self, num_tokens: int, top_k: int) -> bool:
        """Whether a call of ``num_tokens`` tokens has the dgrad GEMM read W1 and W3 as stored
        (``TileConfig.w13_as_stored_rows``; never for an intermediate size that is not a
        whole number of K steps)."""
        return num_tokens * top_k < self._w13_as_stored_below

    @property
    def symmetric_bytes(self) -> int:
        held = (self.recv_grad, self.recv_grad_scales, self.recv_score, self.score_grad)
        return sum(t.numel() * t.element_size() for t in held if t is not None)


def per_call_bytes(forward: ForwardBuffers, grad: GradBuffers) -> int:
    """Most bytes a backward call takes from the caching allocator at once besides its
    outputs, where the routing brings every row it can (a call holds its rows' share of
    what is sized per received row, a window's): ``dab`` and the score-gradient parts
    throughout; up to the dgrad GEMM the
    transposed weights (those the GEMMs do not read as stored: ``w2_as_stored``,
    ``w13_as_stored_rows``), in e4m3 where the backward is quantized, with the e4m3 copies
    of ``dab`` and ``dy``; then, quantized, up to three token-major copies for quantized
    weight gradients (an upper bound: ``dab`` and ``h`` are freed once copied). A quantized
    forward adds ``h`` for the weight gradients and GEMM1's
    e4m3 weights."""
    shape, tiles = forward.shape, grad.tiles
    rows = forward.recv.shape[0]
    hidden, inter, itemsize = shape.hidden, shape.inter, shape.dtype.itemsize
    parts = cdiv(inter, min(tiles.grad1_n, tiles.grad1_saved_n))  # the narrower launch's
    weights = 3 * shape.local_experts * inter * hidden
    # W1 and W3 transposed unless every call (up to the capacity) reads them as stored.
    w13_copied = not grad.reads_w13_as_stored(shape.capacity_tokens_per_rank, shape.top_k)
    transposed = weights // 3 * ((not tiles.w2_as_stored) + 2 * w13_copied)
    fmt = grad.grad_format
    # A quantized operand per element: e4m3 and fp32 scales, or the activation dtype (held in bf16).
    scaled = 1 + 4 / fmt.row_scale_k if fmt.row_scale_k else itemsize
    weight_bytes = itemsize if weights_in_bf16(fmt, tiles) else scaled
    total = rows * 2 * inter * itemsize + rows * 4 * parts
    x_fmt = forward.row_format
    if x_fmt.quantized:
        h_copy = rows * inter * itemsize if x_fmt.row_scale_k else 0
        total += h_copy + int(2 * weights // 3 * weight_bytes)
    if not fmt.quantized:
        return total + transposed * itemsize
    dy_copy = shape.capacity_tokens_per_rank * hidden if grad.dy_link.quantized else 0
    through_dgrad = (rows * 2 * inter + dy_copy) * scaled + weights * weight_bytes
    if grad.mx_wgrad_block:
        # Then copies of every operand rounded along the tokens, a GEMM's pair at a time.
        return total + int(max(through_dgrad, rows * (hidden + 2 * inter) * shape.dtype.itemsize))
    if not grad.wgrad_format.quantized:
        # Then the rows that crossed quantized, dequantized one at a time.
        dequantized = rows * hidden * shape.dtype.itemsize if grad.dy_link.quantized else 0
        return total + int(max(through_dgrad, dequantized))
    kt = _token_major_length(shape, tiles, grad.wgrad_format, rows)
    token_major = kt * (3 * inter + hidden)
    return total + int(max(through_dgrad, (shape.capacity_tokens_per_rank * hidden + token_major) * scaled))


def _token_span(tiles: TileConfig, fmt: Format) -> int:
    """Tokens each local expert's rows are padded to a multiple of in the token-major
    layout: whole token blocks, and whole K steps of the weight-gradient GEMM (a scaled
    MMA's step spans several blocks; both are powers of two)."""
    return max(fmt.activation_block[1], tiles.wgrad_k)


TOKEN_MAJOR_STEPS_PER_MEAN = 4
"""A token-major copy's length (``_token_major_length``) is a multiple of this fraction of
the rows a rank receives on average: each length compiles the copy and GEMM kernels once."""


def _token_major_length(shape, tiles: TileConfig, fmt: Format, received: int) -> int:
    """Tokens along the token-major copies of a call that received ``received`` rows
    (each local expert's aligned): each local expert's rows padded to whole spans
    (``_token_span``), rounded up to a step of ``TOKEN_MAJOR_STEPS_PER_MEAN``, at most
    what any routing brings."""
    span = _token_span(tiles, fmt)
    step = max(1, cdiv(shape.rows_per_rank, TOKEN_MAJOR_STEPS_PER_MEAN * span))
    spans = min(cdiv(cdiv(received, span), step) * step,
                cdiv(shape.ep * shape.rows_per_rank, span))
    return span * (spans + shape.local_experts)


def _token_major(buffers: ForwardBuffers, tiles: TileConfig, fmt: Format, block_start: torch.Tensor,
                 received: int, block_major: bool, t, t_scales, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``cols`` columns of the rows ``t`` (e4m3 in ``fmt``'s row blocks when
    ``t_scales`` is given) as ``token_major_kernel`` lays them out: ``([cols, kt] e4m3,
    [cols, kt / token block] scales)`` (``block_major``: scales ``[kt / token block, cols]``),
    ``kt`` = ``_token_major_length`` for ``received`` rows. ``block_start``:
    ``_token_block_starts``."""
    kt = _token_major_length(buffers.shape, tiles, fmt, received)
    token_block = fmt.activation_block[1]
    out = torch.empty(cols, kt, dtype=torch.float8_e4m3fn, device=t.device)
    scale_shape = (kt // token_block, cols) if block_major else (cols, kt // token_block)
    scales = torch.empty(scale_shape, dtype=torch.float32, device=t.device)
    shape = buffers.shape
    block_c = tiles.token_major_row_bytes // t.element_size()
    launch(token_major_kernel, (cdiv(cols, block_c) * (kt // token_block),),
        t, t_scales, out, scales, buffers.local_base, buffers.local_rows, block_start, shape.local_experts,
        STRIDE=t.shape[1], COLS=cols, SCALE_K=token_block if t_scales is not None else 0, KT=kt,
        TOKEN_BLOCK=token_block, POWER_OF_TWO=fmt.power_of_two, BLOCK_C=block_c,
        LOCAL_PAD=next_power_of_2(shape.local_experts), SCALES_BLOCK_MAJOR=block_major,
        num_warps=tiles.token_major_warps,
    )
    return out, scales


def _token_block_starts(buffers: ForwardBuffers, tiles: TileConfig, fmt: Format) -> torch.Tensor:
    """``[local experts + 1]``: each expert's first token block in the token-major layout,
    its rows zero-padded to whole spans (``_token_span``), one expert after another (read
    on the device)."""
    token_block, span = fmt.activation_block[1], _token_span(tiles, fmt)
    blocks = (buffers.local_rows + span - 1) // span * (span // token_block)
    block_start = torch.zeros(buffers.shape.local_experts + 1, dtype=torch.int32, device=blocks.device)
    torch.cumsum(blocks, 0, out=block_start[1:])
    return block_start


DEQUANTIZE_ROWS, DEQUANTIZE_COLS = 32, 128
"""Rows and columns of a ``dequantized_rows_kernel`` program (rows capped at the receive
layout's alignment)."""


def _dequantized(buffers: ForwardBuffers, rows: torch.Tensor, scales: torch.Tensor | None,
                 scale_k: int, mx_token_block: int = 0) -> torch.Tensor:
    """Received ``rows`` in the activation dtype: as they are, or, with ``scales`` (e4m3
    rows, one scale per ``scale_k`` columns), dequantized, each expert's padding rows 0
    (rows past the last expert's blocks unwritten). ``mx_token_block`` > 0: also quantized
    along the tokens in MX blocks of that many rows and dequantized again
    (``dequantized_rows_kernel``)."""
    if scales is None and not mx_token_block:
        return rows
    shape = buffers.shape
    out = torch.empty(rows.shape, dtype=shape.dtype, device=rows.device)
    block_r = mx_token_block or min(DEQUANTIZE_ROWS, buffers.tiles.row_align)
    grid = (cdiv(rows.shape[0], block_r), cdiv(rows.shape[1], DEQUANTIZE_COLS))
    launch(dequantized_rows_kernel, grid,
        rows, scales, out, rows.shape[0], buffers.local_base, buffers.local_rows, shape.local_experts,
        COLS=rows.shape[1], SCALE_K=scale_k if scales is not None else 0,
        LOCAL_PAD=next_power_of_2(shape.local_experts),
        ROW_ALIGN=buffers.tiles.row_align, BLOCK_R=block_r, BLOCK_C=DEQUANTIZE_COLS, MX_TOKEN_BLOCK=mx_token_block,
        num_warps=4,
    )
    return out


def _quantized_wgrad(buffers: ForwardBuffers, tiles: TileConfig, fmt: Format, block_start: torch.Tensor,
                     a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                     outs: tuple[torch.Tensor, ...]) -> None:
    """``A_e^T B_e`` over each local expert's rows, both operands quantized along the
    rows in ``fmt`` (``kernels.wgrad``), into ``outs``: one ``[experts, a_cols, b_cols]``, or
    two that split the ``a_cols`` rows in halves. ``a``, ``b``: the operands' token-major
    copies (``_token_major``, ``a_cols`` and ``b_cols`` columns), made with ``block_start``."""
    shape = buffers.shape
    token_block = fmt.activation_block[1]
    (at, at_scales), (bt, bt_scales) = a, b
    (a_cols, kt), b_cols = at.shape, bt.shape[0]
    # One expert's tiles after another (the grid's first axis varies fastest): the tiles
    # running together then share their expert's operands in L2.
    grid = (cdiv(b_cols, tiles.wgrad_n), cdiv(a_cols, tiles.wgrad_m), shape.local_experts)
    launch(wgrad_kernel, grid,
        at, at_scales, bt, bt_scales, outs[0], outs[-1], block_start,
        M=a_cols, N=b_cols, SPLIT_M=a_cols // 2 if len(outs) == 2 else 0, KT=kt, TOKEN_BLOCK=token_block,
        BLOCK_M=tiles.wgrad_m, BLOCK_N=tiles.wgrad_n, BLOCK_K=tiles.wgrad_k, MX_DOT=mx_dot(fmt, tiles.mx_upcast),
        UPCAST_DOT=INTERPRET,
        num_warps=tiles.wgrad_warps, num_stages=tiles.wgrad_stages,
    )


def runs_gluon_wgrad(tiles: TileConfig, fmt: Format, hidden: int, inter: int) -> bool:
    """Whether the quantized weight gradients run the Gluon core grouped along the tokens
    (``TileConfig.wgrad_kernel``): the row names it, and it takes the format (blockwise
    fp8) and the layer (hidden and intermediate sizes multiples of its 128 x 128 tiles);
    where the row names it and it cannot, the log says so, once."""
    if tiles.wgrad_kernel != "gluon":
        return False
    if fmt.name == "fp8_block" and hidden % FP8_BLOCK == inter % FP8_BLOCK == 0:
        return True
    say_once(f"mega_moe fused: the tile row names the Gluon weight-gradient GEMM, which takes blockwise fp8 and "
             f"sizes that are multiples of {FP8_BLOCK}; {fmt.name} with hidden size {hidden} and intermediate size "
             f"{inter} runs the tl kernel instead")
    return False


def runs_gluon_grad1(tiles: TileConfig, fmt: Format, dtype: torch.dtype, hidden: int, inter: int,
                     quantize_on_read: bool) -> bool:
    """Whether the saved tiles of the backward's first kernel run the Gluon core
    (``TileConfig.grad1_kernel``): the row names it, and it takes the operands (bf16 rows,
    or blockwise fp8 ones whose ``[da | db]`` copy is scaled per 128 columns, as they
    crossed) and the layer (sizes multiples of its tiles); where the row names it and it
    cannot, the log says so, once."""
    if tiles.grad1_kernel != "gluon":
        return False
    if (gluon_takes_rows(fmt, dtype) and not quantize_on_read
            and inter % SWIGLU_GRAD_BLOCK_N == hidden % tiles.grad1_k == 0):
        return True
    say_once(f"mega_moe fused: the tile row names the Gluon core for the backward's first kernel, which takes bf16 or "
             f"blockwise fp8 rows as they crossed and an intermediate size that is a multiple of "
             f"{SWIGLU_GRAD_BLOCK_N}; {fmt.name} on {dtype} rows (quantized as read: {quantize_on_read}) with "
             f"intermediate size {inter} runs the tl kernel instead")
    return False


def release_preact(preact: torch.Tensor) -> None:
    """Hand the saved pre-activations' memory back to the caching allocator once the
    launches that read them are queued (stream order keeps it theirs until they have run),
    though autograd references the tensor until the backward returns: the weight
    gradients, the backward's peak, then take its place. A tensor that is not the whole of
    its storage (a view) is left as it is. A second backward over the same graph finds
    it released (``preact_released``) and recomputes GEMM1."""
    storage = preact.untyped_storage()
    if preact.storage_offset() or storage.nbytes() != preact.numel() * preact.element_size():
        return
    if preact.is_cuda and torch.cuda.is_current_stream_capturing():  # a graph's memory is its pool's
        return
    if preact.is_cuda:  # the launches above may run on another stream than the allocation's
        preact.record_stream(torch.cuda.current_stream(preact.device))
    storage.resize_(0)


def preact_released(preact: torch.Tensor) -> bool:
    """Whether an earlier backward released these pre-activations (``release_preact``)."""
    return preact.numel() > 0 and preact.untyped_storage().nbytes() == 0


@dataclass
class _Operands:
    """What every round of one backward multiplies: the rows it sends, and the weights as
    its GEMMs read them."""

    sent: torch.Tensor
    """The expert inputs as they cross (``x``, or e4m3 with ``x_scales``)."""
    x_scales: torch.Tensor | None
    dy_sent: torch.Tensor
    dy_scales: torch.Tensor | None
    w1: torch.Tensor
    """W1 and W3 as a recomputed GEMM1 reads them (quantized in the forward's format)."""
    w1_scales: torch.Tensor | None
    w3: torch.Tensor
    w3_scales: torch.Tensor | None
    w2_operand: torch.Tensor
    """W2 as ``dy W2`` reads it: transposed, or as stored."""
    w2_operand_scales: torch.Tensor | None
    w13t: torch.Tensor
    """``[W1 | W3]`` transposed as the dgrad GEMM reads it, or W1 as stored beside ``w3_stored``."""
    w13t_scales: torch.Tensor | None
    w3_stored: torch.Tensor | None
    recv_rows: torch.Tensor
    """The receive buffer's view of the expert inputs (native where they cross unquantized
    for quantize-on-read weight gradients)."""
    recv_row_scales: torch.Tensor | None
    recomputes: bool
    """Whether any row may lie past the saved pre-activations (GEMM1 then recomputed for it,
    on ``w1``, ``w3`` as above)."""


def fused_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    preact: torch.Tensor | None,
    routing: torch.Tensor,
    buffers: ForwardBuffers,
    grad: GradBuffers,
    score_before_experts: bool,
    comm_programs: int,
    num_programs: int,
    timeout_s: float,
) -> tuple[torch.Tensor, ...]:
    """``(dx, d_topk_w, dw1, dw2, dw3)``, see ``reference.moe_backward``. ``preact``: the
    forward's saved pre-activations of the first rows of the call's full receive layout
    (``preact_shape``), or None to recompute GEMM1 (for the rows past them too); they are
    consumed: their memory is released once read (``release_preact``). ``routing``: the
    forward's (``forward.fused_forward``). The host waits for nothing (module docstring)."""
    shape = buffers.shape
    num_tokens, top_k = topk_idx.shape
    check_call(num_tokens, buffers, comm_programs, num_programs, "backward")
    expected = routing_numel(shape, num_tokens, top_k)
    if routing.dtype != torch.int32 or routing.shape != (expected,):
        raise ValueError(f"the forward's routing is {routing.dtype} of shape {tuple(routing.shape)}; expected "
                         f"int32 of shape ({expected},) for {num_tokens} tokens x top-{top_k} (sort_rows)")
    most = shape.most_receive_rows(buffers.tiles)
    if preact is not None and (preact.shape[1] != 2 * shape.inter or preact.shape[0] > most):
        raise ValueError(
            f"saved pre-activations have shape {tuple(preact.shape)}; expected [at most {most}, "
            f"{2 * shape.inter}] (preact_shape)"
        )
    window, rounds = buffers.window, buffers.rounds
    saved_rows = 0 if preact is None else preact.shape[0]
    tokens_per_expert = torch.empty(shape.local_experts, dtype=torch.int64, device=x.device)
    # Native weight gradients after a quantized forward: x and dy cross unquantized (the
    # expert inputs again, into the receive buffer's native view) and the scaled GEMMs
    # quantize them as they read them.
    quantize_on_read = shape.native_resend
    inputs = (buffers.calls, inputs_key(x, topk_idx, topk_w, w1, w3, score_before_experts))
    resident = not quantize_on_read and buffers.resident == inputs
    layout(topk_idx, routing, buffers, timeout_s, 0, rounds, tokens_per_expert, needs_input=not resident,
           saved_rows=saved_rows)
    # Launched after the first layout, which tells the device whether GEMM1 is recomputed.
    ops = _operands(dy, x, topk_idx, w1, w2, w3, buffers, grad, score_before_experts,
                    recomputes=preact is None or saved_rows < most - buffers.tiles.block_m)
    # The last round that reads the saved rows (their memory goes back after it).
    last_saved_round = min(rounds, -(-saved_rows // window)) - 1
    weight_grads = None
    for round_index in range(rounds):
        if round_index:
            layout(topk_idx, routing, buffers, timeout_s, round_index, rounds, tokens_per_expert,
                   saved_rows=saved_rows)
        saved = saved_rows_of_round(preact, round_index, window)
        if saved is not None and not saved.shape[0]:
            saved = None
        weight_grads = _backward_round(
            ops, x, topk_w, routing[: num_tokens * top_k], top_k, saved,
            buffers, grad, score_before_experts, comm_programs, num_programs, weight_grads,
            release=preact if round_index == last_saved_round else None)

    dx = torch.empty_like(x)
    d_topk_w = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    reduce(buffers, topk_w, x, dx, num_tokens, top_k, num_programs, scale_by_score=score_before_experts,
           score_out=d_topk_w, score_src=None if score_before_experts else grad.score_grad)
    after_launches(buffers)
    return dx, d_topk_w, *weight_grads


def _operands(dy, x, topk_idx, w1, w2, w3, buffers: ForwardBuffers, grad: GradBuffers, score_before_experts: bool,
              recomputes: bool) -> _Operands:
    """The backward's operands (``_Operands``), made once per call. ``recomputes``: a round
    may recompute GEMM1 (its quantized weights are then made, gated on the device by
    ``PAST_SAVED`` where the saved rows may cover every row)."""
    shape, tiles = buffers.shape, grad.tiles
    num_tokens, top_k = topk_idx.shape
    x_fmt, fmt = buffers.row_format, grad.grad_format
    quantize_on_read = shape.native_resend
    recv_rows, recv_row_scales = ((buffers.recv_native, None) if quantize_on_read
                                  else (buffers.recv, buffers.recv_scales))
    w1_scales = w3_scales = x_scales = dy_scales = w3_stored = None
    sent, dy_sent = x, dy
    # K-major copies of the weights as the backward's GEMMs read them (W2 as stored where
    # the row says so).
    if fmt.quantized:
        in_bf16 = weights_in_bf16(fmt, tiles)
        w2_operand, w2_operand_scales = quantize_transposed([w2], fmt, tiles.transpose_block, in_bf16)
        w13t, w13t_scales = quantize_transposed([w1, w3], fmt, tiles.transpose_block, in_bf16)
        if grad.dy_link.quantized:
            dy_sent, dy_scales = quantize_rows(dy, fmt.activation_block[1], fmt.power_of_two, bool(fmt.round_k))
    else:
        w2_operand_scales = w13t_scales = None
        w2_operand = w2 if tiles.w2_as_stored else transposed_side_by_side([w2], tiles.transpose_block)
        # The dgrad GEMM's B: [W1 | W3] transposed, or W1 and W3 as stored (one B split along K).
        stored = grad.reads_w13_as_stored(num_tokens, top_k) and (w3.data_ptr() - w1.data_ptr()) % 16 == 0
        w13t, w3_stored = ((w1, w3) if stored
                           else (transposed_side_by_side([w1, w3], tiles.transpose_block), None))
    # GEMM1's quantized operands where it is recomputed: where the saved rows may cover
    # every row the device says whether any lies past them.
    if x_fmt.quantized and recomputes:
        gate = buffers.state[PAST_SAVED.value:PAST_SAVED.value + 1]
        (w1, w1_scales), (w3, w3_scales) = quantize_weights([w1, w3], x_fmt, weights_in_bf16(x_fmt, tiles), gate=gate)
    if x_fmt.quantized and not score_before_experts and not quantize_on_read:
        sent, x_scales = quantize_rows(x, x_fmt.activation_block[1], x_fmt.power_of_two, bool(x_fmt.round_k))
    return _Operands(sent, x_scales, dy_sent, dy_scales, w1, w1_scales, w3, w3_scales, w2_operand,
                     w2_operand_scales, w13t, w13t_scales, w3_stored, recv_rows, recv_row_scales, recomputes)


def _backward_round(ops: _Operands, x, topk_w, order: torch.Tensor, top_k: int, saved: torch.Tensor | None,
                    buffers: ForwardBuffers, grad: GradBuffers, score_before_experts: bool, comm_programs: int,
                    num_programs: int, weight_grads: tuple | None, release: torch.Tensor | None) -> tuple:
    """Steps 2-4 of one round (module docstring), after its layout; ``saved``: the round's
    saved pre-activations (``saved_rows_of_round``), None where it has none. Returns the
    weight gradients: round 0's, or ``weight_grads`` with this round's rows added.
    ``release``: saved pre-activations whose memory goes back once this round's first
    kernels are queued. ``order``: the routing's send order (``sort_rows``)."""
    shape, tiles, flags = buffers.shape, grad.tiles, buffers.flag_layout
    x_fmt, fmt = buffers.row_format, grad.grad_format
    scale_k = fmt.row_scale_k
    # The backward's first kernel takes one weight block and rounding rule: the backward's,
    # or the forward's where only GEMM1 is quantized (never both: ``fused_support``).
    w_fmt = fmt if fmt.quantized else x_fmt
    quantize_on_read = shape.native_resend
    block_n, stages = ((tiles.grad1_n, tiles.grad1_stages) if saved is None
                       else (tiles.grad1_saved_n, tiles.grad1_saved_stages))
    parts = cdiv(shape.inter, block_n)
    hold = buffers.recv.shape[0]
    dab = torch.empty(hold, 2 * shape.inter, dtype=shape.dtype, device=x.device)
    # A forward in e4m3 keeps GEMM2's e4m3 operand in ``h``: the weight gradients get their own.
    h_wgrad = (torch.empty(hold, shape.inter, dtype=shape.dtype, device=x.device) if x_fmt.row_scale_k
               else buffers.h)
    dab_q = dab_scales = None
    if fmt.quantized:
        # [da | db] for the dgrad GEMM: e4m3 with scales, or rounded in the activation dtype.
        dab_q = torch.empty(hold, 2 * shape.inter, dtype=torch.float8_e4m3fn if scale_k else shape.dtype,
                            device=x.device)
        if scale_k:
            dab_scales = torch.empty(hold, 2 * shape.inter // scale_k, dtype=torch.float32, device=x.device)
    score_parts = torch.empty(hold, parts, dtype=torch.float32, device=x.device)
    recv_rows, recv_row_scales = ops.recv_rows, ops.recv_row_scales

    def first_kernel(programs: int = num_programs, **variant) -> None:
        launch(
            dispatch_grad_gemm1_kernel, (programs,),
            ops.sent, ops.x_scales, ops.dy_sent, ops.dy_scales, topk_w, order, buffers.send_first, buffers.send_end,
            buffers.dest_start, buffers.item_start, buffers.recv_ptrs, grad.recv_grad_ptrs, grad.recv_score_ptrs,
            buffers.recv_meta_ptrs, buffers.flag_ptrs, recv_rows, recv_row_scales, grad.recv_grad,
            grad.recv_grad_scales, grad.recv_score, buffers.recv_meta, buffers.flags, buffers.state,
            buffers.local_base, buffers.block_base, buffers.local_rows, buffers.src_offset, buffers.src_rows, ops.w1,
            ops.w1_scales, ops.w2_operand, ops.w2_operand_scales, ops.w3, ops.w3_scales,
            dab if saved is None else saved, h_wgrad, dab, dab_q, dab_scales, score_parts, shape.rank, shape.ep,
            shape.local_experts, shape.rows_per_rank, 0 if saved is None else saved.shape[0],
            HIDDEN=shape.hidden, INTER=shape.inter, TOP_K=top_k,
            SCORE_BEFORE_EXPERTS=score_before_experts, NEEDS_INPUT=flags.needs_input, CHUNK_READY=flags.chunk_ready,
            MAX_CHUNKS=flags.max_chunks, EP_PAD=next_power_of_2(shape.ep),
            LOCAL_PAD=next_power_of_2(shape.local_experts),
            BLOCK_M=tiles.block_m, ROW_ALIGN=buffers.tiles.row_align, TILE_M=tiles.grad1_m, BLOCK_N=block_n,
            BLOCK_K=tiles.grad1_k, COPY_ROWS=tiles.copy_rows, COPY_COLS=tiles.copy_cols,
            UPCAST_DOT=INTERPRET, X_SCALE_K=x_fmt.row_scale_k, GRAD_SCALE_K=scale_k,
            W_SCALE_N=weight_scale_rows(w_fmt, tiles), MX_DOT=mx_dot(w_fmt, tiles.mx_upcast),
            QUANTIZE_ON_READ=quantize_on_read,
            POWER_OF_TWO=w_fmt.power_of_two, ACT_DTYPE=TRITON_DTYPES[x.dtype],
            ZERO_PADDING=not grad.wgrad_format.quantized and not grad.dy_link.quantized,
            X_ROUND_K=x_fmt.round_k, GRAD_ROUND_K=fmt.round_k, W2_AS_STORED=bool(tiles.w2_as_stored),
            num_warps=tiles.grad1_warps,
            **variant,
        )

    if saved is not None and runs_gluon_grad1(tiles, fmt, shape.dtype, shape.hidden, shape.inter, quantize_on_read):
        # The communication programs dispatch alone; the core runs the others on a stream
        # beside them, its load warp waiting for the rows it copies.
        side = fork_stream(x.device)
        first_kernel(comm_programs, TILES=DISPATCH_ONLY.value, NEXT_TILE=GEMM1_NEXT_TILE.value,
                     COMM_PROGRAMS=comm_programs, EPILOGUE_PARTS=1, num_stages=1)
        with torch.cuda.stream(side):
            swiglu_grad_gemm(
                grad.recv_grad, ops.w2_operand, expert_layout(buffers), chunk_flags(buffers),
                SwigluGradTensors(saved, grad.recv_score, dab, h_wgrad, score_parts, dab_q, dab_scales),
                GemmTiles(tiles.grad1_saved_n, tiles.grad1_k, tiles.grad1_saved_stages), saved_m=tiles.grad1_m,
                score_before_experts=score_before_experts, row_align=buffers.tiles.row_align,
                dy_scale=grad.recv_grad_scales, w2t_scale=ops.w2_operand_scales, b_k_major=not tiles.w2_as_stored,
                power_of_two=fmt.power_of_two, programs=num_programs - comm_programs,
            )
        join_stream(side)
    else:
        first_kernel(TILES=(ALL_TILES if saved is None else SAVED_TILES).value,
                     NEXT_TILE=GEMM1_NEXT_TILE.value, COMM_PROGRAMS=comm_programs,
                     EPILOGUE_PARTS=1 if saved is None else tiles.grad1_saved_parts, num_stages=stages)
    if saved is not None and saved.shape[0] < buffers.window and ops.recomputes:
        # The tiles past the saved rows, if any arrived (the kernel finds none otherwise):
        # GEMM1 recomputed and rounded as the forward would have saved it, in tiles as wide
        # (the score-gradient parts are per tile column), after the first launch has
        # dispatched every row.
        first_kernel(TILES=PAST_SAVED_TILES.value, NEXT_TILE=RECOMPUTE_NEXT_TILE.value, COMM_PROGRAMS=0,
                     EPILOGUE_PARTS=tiles.grad1_saved_parts, num_stages=tiles.grad1_stages)
    if release is not None:
        release_preact(release)
    rows_gemm_combine(buffers, tiles, tiles.dgrad, dab_q if fmt.quantized else dab, dab_scales, ops.w13t,
                      ops.w13t_scales, ops.w3_stored, fmt, scale_k, num_programs,
                      score=(score_parts, grad.score_grad, grad.score_grad_ptrs, parts))
    # The weight gradients read neither: their memory goes to what those allocate (the
    # caching allocator hands it out in stream order, after the kernel above).
    del first_kernel, dab_q, dab_scales, score_parts
    if weight_grads is not None:
        dw1, dw2, dw3 = weight_grads
        y_rows = (grad.recv_grad, grad.recv_grad_scales,
                  0 if grad.recv_grad_scales is None else grad.dy_link.row_scale_k)
        x_rows = (recv_rows, recv_row_scales, 0 if recv_row_scales is None else x_fmt.row_scale_k)
        accumulate_wgrad(buffers, (dab, None, 0), x_rows, (dw1, dw3))
        accumulate_wgrad(buffers, y_rows, (h_wgrad, None, 0), (dw2,))
        return weight_grads
    return _first_round_wgrad(buffers, grad, x, dab, h_wgrad, recv_rows, recv_row_scales, num_programs)


def _first_round_wgrad(buffers: ForwardBuffers, grad: GradBuffers, x, dab, h_wgrad, recv_rows,
                       recv_row_scales, num_programs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dw1, dw2, dw3)`` of round 0's rows (module docstring), each operand freed as soon
    as it is read."""
    shape, tiles = buffers.shape, grad.tiles
    x_fmt, scale_k = buffers.row_format, grad.grad_format.row_scale_k
    wgrad_fmt = grad.wgrad_format
    if wgrad_fmt.quantized and not grad.mx_wgrad_block:
        # Each operand freed as soon as its token-major copy exists, the narrowest first:
        # h's copy, then [da | db] (dW1 and dW3 first), so that neither is held beside
        # the other or beside more than two copies (docs/perf-history.md v28); dW2 allocated once
        # [da | db]'s copy is freed, so that the peak holds the three weight gradients
        # beside two copies, not beside [da | db] (v32).
        dw1, dw3 = (torch.empty(shape.local_experts, shape.inter, shape.hidden, dtype=shape.dtype, device=x.device)
                    for _ in range(2))
        starts = _token_block_starts(buffers, tiles, wgrad_fmt)
        gluon = runs_gluon_wgrad(tiles, wgrad_fmt, shape.hidden, shape.inter)
        token_major = functools.partial(_token_major, buffers, tiles, wgrad_fmt, starts, buffers.window, gluon)

        def wgrad(a, b, outs):
            if gluon:
                token_grouped_gemm(*a, *b, starts, outs, GemmTiles(tiles.wgrad_n, tiles.wgrad_k, tiles.wgrad_stages),
                                   num_programs)
            else:
                _quantized_wgrad(buffers, tiles, wgrad_fmt, starts, a, b, outs)

        h_major = token_major(h_wgrad, None, shape.inter)
        del h_wgrad
        dab_major = token_major(dab, None, 2 * shape.inter)
        del dab
        wgrad(dab_major, token_major(recv_rows, recv_row_scales, shape.hidden), (dw1, dw3))
        del dab_major
        dw2 = torch.empty(shape.local_experts, shape.hidden, shape.inter, dtype=shape.dtype, device=x.device)
        wgrad(token_major(grad.recv_grad, grad.recv_grad_scales, shape.hidden), h_major, (dw2,))
        return dw1, dw2, dw3
    # torch's grouped GEMM on the rows in the activation dtype, a pair of operands at a
    # time: dequantized where they crossed quantized (``fp8_wgrad_bf16``), and for MX
    # weight gradients (``mx_wgrad_dequantized``) quantized along the tokens and
    # dequantized again, every operand.
    # dW1 and dW3 first: [da | db] is freed before dW2 is allocated, so that the
    # backward's peak holds the three weight gradients or [da | db], not both.
    mx_block = grad.mx_wgrad_block
    align = buffers.tiles.row_align
    ends = torch.cumsum((buffers.local_rows + align - 1) // align * align, 0, dtype=torch.int32)
    x_rows = _dequantized(buffers, recv_rows, recv_row_scales, x_fmt.row_scale_k, mx_block)
    dab_rows = _dequantized(buffers, dab, None, 0, mx_block)
    del dab
    dw1 = torch._grouped_mm(dab_rows[:, : shape.inter].t(), x_rows, offs=ends)
    dw3 = torch._grouped_mm(dab_rows[:, shape.inter :].t(), x_rows, offs=ends)
    del x_rows, dab_rows
    dy_rows = _dequantized(buffers, grad.recv_grad, grad.recv_grad_scales, scale_k, mx_block)
    h_rows = _dequantized(buffers, h_wgrad, None, 0, mx_block)
    del h_wgrad
    dw2 = torch._grouped_mm(dy_rows.t(), h_rows, offs=ends)
    return dw1, dw2, dw3

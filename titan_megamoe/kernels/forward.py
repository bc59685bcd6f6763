"""Host side of the fused forward: the routing (shared with the backward), the launches
of a round, and the checks every call makes before launching.

A forward, on the current stream, with no wait for the device (``sync``): sort the rows
by expert (``sort_rows``), quantize what its format quantizes, then ``buffers.rounds``
rounds of [layout, dispatch + GEMM1 + SwiGLU, GEMM2 + combine], and the combine reduction.
Before it launches anything a call raises what the host records hold
(``ForwardBuffers.raise_pending``: a failure, a bad expert id of an earlier call) and, at
a forward, grows the receive buffers for the rows an earlier call brought
(``ForwardBuffers.grow_for_later_calls``).
"""

import functools
import logging
import math

import torch
import triton.language as tl

from titan_megamoe.kernels.buffers import ForwardBuffers, ForwardShape, capturing
from titan_megamoe.kernels.configs import INTERPRET, RowsGemmTiles, TileConfig
from titan_megamoe.kernels.dispatch_gemm1 import dispatch_gemm1_kernel
from titan_megamoe.kernels.gemm2_combine import (
    combine_reduce_kernel,
    combine_release_kernel,
    rows_gemm_combine_kernel,
)
from titan_megamoe.kernels.gluon.sm90.arrivals import ChunkFlags
from titan_megamoe.kernels.gluon.sm90.gate_up_gemm import (
    GATE_UP_BLOCK_N,
    GateUpTensors,
    gate_up_gemm,
    gate_up_tile_rows,
)
from titan_megamoe.kernels.gluon.sm90.grouped_gemm import (
    FP8_BLOCK,
    CombineRows,
    ExpertLayout,
    GemmTiles,
    grouped_gemm,
)
from titan_megamoe.kernels.gluon.sm90.mma import MMA_ROWS
from titan_megamoe.kernels.launch import cdiv, fork_stream, join_stream, launch, next_power_of_2
from titan_megamoe.kernels.layout import layout_kernel
from titan_megamoe.kernels.mainloop import mx_dot
from titan_megamoe.kernels.quantize import quantize_rows, quantize_weights
from titan_megamoe.kernels.sync import NUM_BLOCKS
from titan_megamoe.precision import Format

logger = logging.getLogger(__name__)

TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
"""Activation dtypes as the kernels name them (the rounding of ``h`` before quantizing)."""


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


def check_call(num_tokens: int, buffers: ForwardBuffers, comm_programs: int, num_programs: int, what: str) -> None:
    """Raise before any launch if this call cannot run on ``buffers``, or if an earlier one
    recorded a failure or a bad expert id (``ForwardBuffers.raise_pending``)."""
    buffers.raise_pending()
    if num_tokens > buffers.shape.capacity_tokens_per_rank:
        raise ValueError(
            f"mega_moe fused {what}: {num_tokens} tokens exceed capacity_tokens_per_rank = "
            f"{buffers.shape.capacity_tokens_per_rank}, which its buffers were sized for"
        )
    if not 0 < comm_programs < num_programs:
        raise ValueError(f"comm_sms = {comm_programs} must be in [1, {num_programs - 1}]")
    if buffers.stream is not None and not capturing(buffers.stream.device):
        stream = torch.cuda.current_stream(buffers.stream.device)
        if stream != buffers.stream:
            raise RuntimeError(
                f"mega_moe fused {what}: called on {stream}, but its buffers belong to "
                f"{buffers.stream}: the protocol orders the calls of one stream (a CUDA graph may be "
                "captured on another and replayed on that one)"
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
           round_index: int, rounds: int, tokens_per_expert: torch.Tensor, needs_input: bool = True,
           saved_rows: int = 0) -> None:
    """Launch the layout kernel of round ``round_index`` of ``rounds`` on a call's routing
    (``sort_rows``): a new epoch, whose count exchange is also the round's start barrier
    (``sync``). ``needs_input`` False: the host found the receive buffer holding this
    call's forward's expert inputs (``layout_kernel``). ``saved_rows``: the forward's saved
    pre-activations' rows (the backward's). Writes the rows received per local expert over
    the call into ``tokens_per_expert`` (int64)."""
    shape, flags = buffers.shape, buffers.flag_layout
    flat = topk_idx.reshape(-1)
    order, send_start = split_routing(routing, flat.numel())
    if round_index == 0:
        buffers.calls += 1
        buffers.timeout_s = timeout_s
    captured = capturing(topk_idx.device)
    if captured:
        buffers.frozen = True
    launch(layout_kernel, (1,),
        order, flat, flat.numel(), send_start, buffers.flags, buffers.flag_ptrs, buffers.state,
        buffers.send_first, buffers.send_end, buffers.dest_start, buffers.item_start, buffers.local_base,
        buffers.block_base, buffers.local_rows, buffers.src_offset, buffers.src_rows, tokens_per_expert,
        shape.rank, shape.ep, shape.local_experts, int(needs_input), int(timeout_s * 1e9),
        0 if captured else buffers.calls, buffers.window, round_index, rounds, saved_rows,
        COUNTS=flags.counts, COUNT_READY=flags.count_ready, NEEDS_INPUT=flags.needs_input,
        BAD_IDS=flags.bad_ids, EP_PAD=next_power_of_2(shape.ep), LOCAL_PAD=next_power_of_2(shape.local_experts),
        BLOCK_M=buffers.tiles.block_m,
        ROW_ALIGN=buffers.tiles.row_align, num_warps=4,
    )
    after_launches(buffers)  # what follows a failed layout must not run on its arrays


def saved_rows_of_round(preact: torch.Tensor | None, round_index: int, window: int) -> torch.Tensor | None:
    """The saved pre-activations of round ``round_index``'s window: they are saved by row of
    a call's full receive layout, so round ``r`` holds rows ``r * window ..`` of them (a view;
    0 rows where the window lies past them). None where nothing is saved."""
    if preact is None:
        return None
    first = min(round_index * window, preact.shape[0])
    return preact[first:first + window]


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y [T, H]``, the rows received per local expert (int64), see ``reference``, and the
    call's routing (``sort_rows``), which its backward takes.

    ``num_programs`` persistent programs run each GEMM; the first ``comm_programs`` of
    them dispatch before they join GEMM1. ``preact`` (``preact_shape``), when given,
    receives GEMM1's pre-activations of the first rows of the call's full receive layout
    for the backward. With a quantized ``buffers.row_format`` the weights are quantized in
    its weight blocks and ``x`` once per token before the kernels send it (held in bf16:
    rounded so). The host waits for nothing: ``buffers.rounds`` rounds run whatever the
    routing, and an expert id out of range poisons the buffers (``sync``): ``y`` is NaN, and
    a later call raises ``ValueError`` naming it on every rank."""
    shape, tiles, flags = buffers.shape, buffers.tiles, buffers.flag_layout
    num_tokens, top_k = topk_idx.shape
    check_call(num_tokens, buffers, comm_programs, num_programs, "forward")
    inputs = inputs_key(x, topk_idx, topk_w, w1, w3, score_before_experts)
    if not capturing(x.device):
        buffers.grow_for_later_calls(buffers.calls + 1, timeout_s)
    window, rounds = buffers.window, buffers.rounds
    routing = sort_rows(topk_idx, buffers)
    order = routing[: topk_idx.numel()]
    fmt = buffers.row_format
    w1_scales = w2_scales = w3_scales = sent_scales = None
    sent = x
    if fmt.quantized:
        in_bf16 = weights_in_bf16(fmt, tiles)
        (w1, w1_scales), (w2, w2_scales), (w3, w3_scales) = quantize_weights([w1, w2, w3], fmt, in_bf16)
        if not score_before_experts:
            sent, sent_scales = quantize_rows(x, fmt.activation_block[1], fmt.power_of_two, bool(fmt.round_k))
    y = torch.empty_like(x)
    tokens_per_expert = torch.empty(shape.local_experts, dtype=torch.int64, device=x.device)
    gluon_gemm1 = runs_gluon_gemm1(tiles, fmt, x.dtype, shape.hidden, shape.inter)
    for round_index in range(rounds):
        layout(topk_idx, routing, buffers, timeout_s, round_index, rounds, tokens_per_expert)
        saved = saved_rows_of_round(preact, round_index, window)
        # With GEMM1 on the Gluon core the dispatch kernel runs the communication programs
        # alone, and the core runs the others on a stream beside it: its load warp waits
        # for the rows it copies, as the tl kernel's GEMM programs do.
        side = fork_stream(x.device) if gluon_gemm1 else None
        launch(dispatch_gemm1_kernel, (comm_programs if gluon_gemm1 else num_programs,),
            sent, sent_scales, topk_w, order, buffers.send_first, buffers.send_end, buffers.dest_start,
            buffers.item_start, buffers.recv_ptrs, buffers.recv_meta_ptrs, buffers.flag_ptrs, buffers.recv,
            buffers.recv_scales, buffers.recv_meta, buffers.flags, buffers.state, buffers.local_base,
            buffers.block_base, buffers.local_rows, buffers.src_offset, buffers.src_rows, w1, w1_scales, w3,
            w3_scales, buffers.h, buffers.h_scales, buffers.h if saved is None else saved,
            0 if saved is None else saved.shape[0], shape.rank, shape.ep, shape.local_experts, shape.rows_per_rank,
            HIDDEN=shape.hidden, INTER=shape.inter, TOP_K=top_k,
            SCORE_BEFORE_EXPERTS=score_before_experts, SAVE_GEMM1=saved is not None,
            COMM_PROGRAMS=comm_programs, CHUNK_READY=flags.chunk_ready,
            MAX_CHUNKS=flags.max_chunks, EP_PAD=next_power_of_2(shape.ep),
            LOCAL_PAD=next_power_of_2(shape.local_experts),
            BLOCK_M=tiles.block_m, TILE_M=tiles.gemm1_m, BLOCK_N=tiles.gemm1_n, BLOCK_K=tiles.gemm1_k,
            COPY_ROWS=tiles.copy_rows, COPY_COLS=tiles.copy_cols, UPCAST_DOT=INTERPRET, SCALE_K=fmt.row_scale_k,
            W_SCALE_N=weight_scale_rows(fmt, tiles), MX_DOT=mx_dot(fmt, tiles.mx_upcast),
            POWER_OF_TWO=fmt.power_of_two, ACT_DTYPE=TRITON_DTYPES[x.dtype], ROUND_K=fmt.round_k,
            CLAIM_AHEAD=bool(tiles.gemm1_claim_ahead), DISPATCH_ONLY=gluon_gemm1,
            num_warps=tiles.gemm1_warps, num_stages=tiles.gemm1_stages,
        )
        if gluon_gemm1:
            with torch.cuda.stream(side):
                gate_up_gemm(
                    buffers.recv, w1, w3, expert_layout(buffers), chunk_flags(buffers),
                    GateUpTensors(buffers.h, buffers.h_scales, saved),
                    GemmTiles(tiles.gemm1_n, tiles.gemm1_k, tiles.gemm1_stages), act_dtype=x.dtype,
                    x_scale=buffers.recv_scales, w1_scale=w1_scales, w3_scale=w3_scales,
                    power_of_two=fmt.power_of_two, programs=num_programs - comm_programs,
                )
            join_stream(side)
        rows_gemm_combine(buffers, tiles, tiles.gemm2, buffers.h, buffers.h_scales, w2, w2_scales, None, fmt,
                          fmt.row_scale_k, num_programs)
    reduce(buffers, topk_w, x, y, num_tokens, top_k, num_programs, scale_by_score=not score_before_experts)
    after_launches(buffers)
    buffers.resident = (buffers.calls, inputs)
    return y, tokens_per_expert, routing


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
                        buffers.window)


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
    release = dict(SCORE_PARTS=parts, PARTS_PAD=next_power_of_2(parts), COMBINE_READY=flags.combine_ready,
                   LOCAL_PAD=next_power_of_2(shape.local_experts), BLOCK_M=block_m)
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
    while block_t > REDUCE_MIN_TOKENS and cdiv(num_tokens, block_t) < num_programs:
        block_t //= 2
    return block_t


def reduce(buffers: ForwardBuffers, topk_w, x, out, num_tokens: int, top_k: int, num_programs: int,
           scale_by_score: bool, score_out=None, score_src=None) -> None:
    """Sum each token's k combined rows into ``out``, once every owner's last round has
    stored them; with ``score_out [T, k]``: ``<row, x>`` per slot into it, or, with
    ``score_src``, the score gradients the owners pushed back (``combine_reduce_kernel``)."""
    shape, tiles = buffers.shape, buffers.tiles
    block_t = reduce_tokens(tiles.reduce_tokens, num_tokens, num_programs)
    blocks = max(1, cdiv(num_tokens, block_t))
    launch(combine_reduce_kernel, (min(blocks, num_programs),),
        buffers.combine, topk_w, x, out, score_out, score_src, buffers.flags, buffers.flag_ptrs, buffers.state,
        num_tokens, shape.rank, shape.ep,
        HIDDEN=shape.hidden, TOP_K=top_k, K_PAD=next_power_of_2(top_k), SCALE_BY_SCORE=scale_by_score,
        SCORE_DOT=score_out is not None and score_src is None, SCORE_COPY=score_src is not None,
        COMBINE_READY=buffers.flag_layout.combine_ready, EP_PAD=next_power_of_2(shape.ep), BLOCK_T=block_t,
        BLOCK_H=tiles.reduce_cols, num_warps=tiles.reduce_warps,
    )

"""The ``fused`` backend: forward and backward run the Triton kernels of
``titan_megamoe.kernels``.

Buffers are allocated once per (group, shape, precision, tiles) and reused by every
layer and step; the first forward and the first backward of each log their size. Their
receive window holds ``settings.receive_load`` times the mean rows a rank receives: a call
whose routing brings more runs the rows past it in further rounds through the same
buffers (``kernels.buffers``), and the window grows for later calls. With a capacity (required when EP > 1) the shape is fixed; a single
rank without one sizes its buffers for the call's tokens and replaces them when a call
brings another count, so memory does not grow with every new token count. Per layer, the backward keeps the op's
inputs and the forward's routing (4 bytes per routed row: the backward does not sort the
rows again; it re-derives the layout from it on the device), plus, with
``settings.save_gemm1``, GEMM1's pre-activations of up to ``settings.save_gemm1_load``
times the mean rows a rank receives (``saved_shapes``), which spares it recomputing GEMM1
for those rows.

What a call needs besides its tensors (the buffers, the program counts, the saved
pre-activations' shape) is resolved at the first call of its kind and looked up after
(``CallPlan``): at small token counts the layer is bound by the host's time per call.

The host never waits for the device (``kernels.sync``). A failure on the device (a peer
past the deadline) stops every rank's kernels; this module prints its message on stderr
as soon as it is recorded and raises it at every later call, since the error PyTorch
raises for the stopped kernels names nothing. An expert id out of range stops nothing: it
poisons the buffers, so that the call's outputs and those of every call made before the
host finds it are NaN, and the first call whose host finds the record raises
``ValueError`` naming the id, on every rank (the message is printed on stderr as soon as
it is recorded too).
"""

import atexit
import dataclasses
import logging
import sys
import threading
import time
from dataclasses import dataclass

import torch

from titan_megamoe import fused_support, symm
from titan_megamoe.kernels.backward import GradBuffers, fused_backward, per_call_bytes, preact_released
from titan_megamoe.kernels.buffers import ForwardBuffers, ForwardShape
from titan_megamoe.kernels.configs import INTERPRET, TileConfig, tile_config
from titan_megamoe.kernels.forward import fused_forward, preact_shape, routing_numel
from titan_megamoe.precision import Format
from titan_megamoe.settings import OperatorSettings

logger = logging.getLogger(__name__)

DEFAULT_COMM_PROGRAMS = 1 if INTERPRET else 32
"""Programs that dispatch rows before joining GEMM1 when ``comm_sms`` is 0. The
interpreter runs programs one after another, so there a single sender must finish
everything before any GEMM tile waits."""

_BUFFERS: dict[tuple, ForwardBuffers] = {}
_GRAD_BUFFERS: dict[int, GradBuffers] = {}
"""Backward buffers, by ``id`` of the forward buffers they extend."""


@dataclass(frozen=True)
class CallPlan:
    """What every call of one kind (``_plan``) needs beyond its tensors."""

    buffers: ForwardBuffers
    comm_programs: int
    num_programs: int


_PLANS: dict[tuple, CallPlan] = {}
"""Plans by what decides them (``_plan``)."""


def _tiles(device: torch.device, fmt: Format) -> TileConfig:
    """The tile-table row of the kernels whose GEMMs run in ``fmt`` on ``device``."""
    target, _ = fused_support.arch(device)
    return tile_config(target, fmt.name)


def _check_runs(x: torch.Tensor, w1: torch.Tensor, settings: OperatorSettings) -> None:
    reason = fused_support.why_not(x.device, x.dtype, settings.precision, weight_dtype=w1.dtype,
                                   intermediate_size=w1.shape[1])
    if reason:
        raise NotImplementedError(f"mega_moe fused backend cannot run: {reason}")


def _shape(x, topk_idx, w1, group: symm.Group, settings: OperatorSettings) -> ForwardShape:
    ep = 1 if group is None else group.size()
    capacity = settings.capacity_tokens_per_rank
    if not capacity:
        if ep > 1:
            raise ValueError(
                f"mega_moe fused backend: capacity_tokens_per_rank = 0 with EP = {ep}; every rank "
                "must size its symmetric buffers alike: pass the most tokens any rank feeds a layer"
            )
        capacity = x.shape[0]
    return ForwardShape(
        ep=ep,
        rank=0 if group is None else group.rank(),
        capacity_tokens_per_rank=max(capacity, 1),
        top_k=topk_idx.shape[1],
        local_experts=w1.shape[0],
        hidden=x.shape[1],
        inter=w1.shape[1],
        dtype=x.dtype,
        row_format=settings.precision.forward,
        native_resend=settings.precision.backward_resends_native,
        receive_load=settings.receive_load,
    )


def _buffers(group: symm.Group, device: torch.device, shape: ForwardShape, settings: OperatorSettings) -> ForwardBuffers:
    tiles = _tiles(device, settings.precision.forward)
    sized_by_call = not settings.capacity_tokens_per_rank
    key_shape = dataclasses.replace(shape, capacity_tokens_per_rank=0) if sized_by_call else shape
    grad_tiles = _tiles(device, settings.precision.dgrad)
    key = ("" if group is None else group.group_name, str(device), key_shape, settings.precision.name, tiles, grad_tiles)
    held = _BUFFERS.get(key)
    if held is not None and held.shape == shape:
        return held
    if held is not None and held.frozen:
        raise ValueError(
            f"mega_moe fused: a call of {shape.capacity_tokens_per_rank} tokens on buffers sized for "
            f"{held.shape.capacity_tokens_per_rank}, which a CUDA graph captured and so cannot change: set "
            "capacity_tokens_per_rank to the most tokens a call passes")
    if held is not None:  # a single rank's call with another token count: replace, do not accumulate
        del _BUFFERS[key]
        _GRAD_BUFFERS.pop(id(held), None)
        for stale in [k for k, plan in _PLANS.items() if plan.buffers is held]:
            del _PLANS[stale]
    sized_for = f"{dataclasses.replace(shape, rank=0)} precision {settings.precision.name}, {tiles}"
    buffers = ForwardBuffers(shape, tiles, device, symm.allocator(group, device, sized_for))
    rows, cols = preact_shape(shape, tiles, settings.save_gemm1_load, shape.capacity_tokens_per_rank)
    target, _ = fused_support.arch(device)
    logger.info(
        f"mega_moe fused: {settings.precision.name} GEMMs on {target}: "
        f"{fused_support.describe_mma(target, settings.precision)}; "
        f"buffers for {shape.capacity_tokens_per_rank} tokens/rank x top-{shape.top_k}, "
        f"hidden {shape.hidden}, EP {shape.ep}: {buffers.symmetric_bytes / 2**30:.2f} GiB symmetric + "
        f"{buffers.local_bytes / 2**30:.2f} GiB local (a receive window of {buffers.window} rows, receive_load "
        f"{settings.receive_load}: a call runs {buffers.rounds} round(s), which hold the "
        f"{shape.most_receive_rows(tiles) - tiles.block_m} rows any routing can bring; it grows when a call "
        f"brings more than one window); saving GEMM1's pre-activations would keep "
        f"{rows * cols * shape.dtype.itemsize / 2**30:.2f} GiB per layer ({rows} rows: save_gemm1_load "
        f"{settings.save_gemm1_load})"
    )
    _BUFFERS[key] = buffers
    _start_reporting()
    return buffers


def _grad_buffers(group: symm.Group, buffers: ForwardBuffers, settings: OperatorSettings) -> GradBuffers:
    if id(buffers) not in _GRAD_BUFFERS:
        sized_for = f"backward of {dataclasses.replace(buffers.shape, rank=0)}"
        allocate = symm.allocator(group, buffers.recv.device, sized_for)
        grad_tiles = _tiles(buffers.recv.device, settings.precision.dgrad)
        grad = GradBuffers(buffers, allocate, settings.precision, grad_tiles)
        logger.info(
            f"mega_moe fused: backward buffers {grad.symmetric_bytes / 2**30:.2f} GiB symmetric, "
            f"plus per backward call up to {per_call_bytes(buffers, grad) / 2**30:.2f} GiB (a routing that "
            "brings every row it can; a call holds its rows' share)"
        )
        _GRAD_BUFFERS[id(buffers)] = grad
    return _GRAD_BUFFERS[id(buffers)]


def prepare(x, topk_idx, w1, group: symm.Group, settings: OperatorSettings) -> None:
    """Allocate, ahead of the first call, the forward and backward buffers such a call
    uses (for a real group of several ranks, collectively). Virtual ranks need it: an
    allocation there may synchronise the device while another virtual rank's kernels
    wait for this one, which would never come."""
    _grad_buffers(group, _plan(x, topk_idx, w1, group, settings).buffers, settings)


def release_buffers() -> None:
    """Drop every cached buffer set and call plan: their memory goes back to the caching
    allocator (or, symmetric over several ranks, to torch's symmetric memory) once nothing
    in flight uses it, and the next call allocates them again, collectively. For tools
    that measure one configuration after another; over several ranks every rank calls it
    at the same point, after every rank's last call has finished."""
    _PLANS.clear()
    _GRAD_BUFFERS.clear()
    _BUFFERS.clear()


def failures() -> list[str]:
    """Messages of the device-side failures recorded so far (host memory only)."""
    return [message for b in list(_BUFFERS.values()) if (message := b.failure()) is not None]


def raise_pending() -> None:
    """Raise what the device recorded and no call has raised yet, on any buffer set: a
    failure (``RuntimeError``) or a bad expert id (``ValueError``, acknowledged as a call
    would). Every call does this before it launches; a program that replays CUDA graphs,
    which run no host code, calls it to learn of a bad id in a replay (the replay's
    outputs are NaN)."""
    for buffers in list(_BUFFERS.values()):
        buffers.raise_pending()


def pending_bad_ids() -> list[str]:
    """Messages of the bad expert ids recorded and not yet raised (host memory only)."""
    return [message for b in list(_BUFFERS.values()) if (message := b.bad_id_message()) is not None]


REPORT_INTERVAL_S = 0.05
"""How often the reporting thread reads the failure records."""

_reported: set[str] = set()
_report_lock = threading.Lock()
_reporting = False


def _report_new_failures() -> None:
    with _report_lock:
        for message in failures() + pending_bad_ids():
            if message not in _reported:
                _reported.add(message)
                print(message, file=sys.stderr, flush=True)


def _start_reporting() -> None:
    """Print each device-side failure and bad expert id on stderr as soon as it is recorded
    (a daemon thread reads the records every ``REPORT_INTERVAL_S``), and at exit. Raising at
    the next call is not enough: another thread that meets the lost CUDA context first,
    such as NCCL's watchdog, aborts the process, and the error PyTorch reports names
    nothing; and a bad id is raised only once the host finds it, which may be a later call."""
    global _reporting
    if _reporting:
        return
    _reporting = True
    atexit.register(_report_new_failures)

    def poll() -> None:
        while True:
            time.sleep(REPORT_INTERVAL_S)
            _report_new_failures()

    threading.Thread(target=poll, name="mega_moe-failure-report", daemon=True).start()


def record_waits() -> tuple[int, float]:
    """``(waits, seconds)``: how often, and how long in all, calls so far waited for the
    device to write a received-rows record (``kernels.records``: only a host running
    ``GROWTH_LAG`` calls ahead of its GPU on buffers that may grow ever does), over every
    buffer set."""
    held = list(_BUFFERS.values())
    return sum(b.records.waits for b in held), sum(b.records.wait_s for b in held)


def _symmetric_bytes(buffers: ForwardBuffers) -> int:
    """Bytes of ``buffers``' symmetric buffers and, once allocated, their backward's."""
    grad = _GRAD_BUFFERS.get(id(buffers))
    return buffers.symmetric_bytes + (0 if grad is None else grad.symmetric_bytes)


def symmetric_bytes(precision: str, **shape_fields) -> int:
    """Bytes of the symmetric buffers this process holds for ``precision`` (a name) and
    shapes whose ``ForwardShape`` fields equal ``shape_fields`` (outside PyTorch's caching
    allocator unless ``symm.in_caching_allocator``)."""
    return sum(_symmetric_bytes(buffers) for key, buffers in _BUFFERS.items()
               if key[3] == precision and all(getattr(buffers.shape, k) == v for k, v in shape_fields.items()))


def held_bytes(x, topk_idx, w1, group: symm.Group, settings: OperatorSettings) -> dict[str, int]:
    """What the buffers of a call of this kind hold across calls, forward and (once
    allocated) backward: ``symmetric_bytes``, ``local_bytes``, and
    ``symmetric_in_allocator`` (``symm.in_caching_allocator``)."""
    buffers = _plan(x, topk_idx, w1, group, settings).buffers
    return {"symmetric_bytes": _symmetric_bytes(buffers), "local_bytes": buffers.local_bytes,
            "symmetric_in_allocator": symm.in_caching_allocator(group)}


def persistent_programs(sms: int, ranks_per_device: int, reserved_sms: int) -> int:
    """Programs per persistent kernel on one rank: one per SM of its share of the GPU's
    SMs left after ``reserved_sms``. Raises where that leaves fewer than two (one that
    dispatches, one that computes)."""
    programs = (sms - reserved_sms) // ranks_per_device
    if programs < 2:
        per_rank = f" shared by {ranks_per_device} ranks" if ranks_per_device > 1 else ""
        raise ValueError(f"reserved_sms = {reserved_sms} leaves {max(sms - reserved_sms, 0)} of the GPU's {sms} "
                         f"SMs{per_rank}: the fused kernels need at least 2 programs per rank")
    return programs


def _programs(x: torch.Tensor, group: symm.Group, settings: OperatorSettings) -> tuple[int, int]:
    """``(dispatching programs, programs per persistent kernel)`` on this rank. The
    interpreter runs three programs, whatever ``reserved_sms`` says."""
    if INTERPRET:
        num_programs = 3
    else:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        num_programs = persistent_programs(sms, symm.ranks_per_device(group), settings.reserved_sms)
    return settings.comm_sms or min(DEFAULT_COMM_PROGRAMS, num_programs - 1), num_programs


def _saved_preact_shape(shape: ForwardShape, tiles: TileConfig, settings: OperatorSettings,
                        num_tokens: int) -> tuple[int, int]:
    """The pre-activations a call of ``num_tokens`` saves: ``preact_shape``, or 0 rows when
    GEMM1 is recomputed instead."""
    if not settings.save_gemm1:
        return 0, 2 * shape.inter
    return preact_shape(shape, tiles, settings.save_gemm1_load, num_tokens)


def saved_shapes(x, topk_idx, w1, group: symm.Group, settings: OperatorSettings
                 ) -> tuple[tuple[int, int], tuple[int]]:
    """Shapes of what the forward returns for its backward: the pre-activations
    (``_saved_preact_shape``) and the routing (``kernels.forward.sort_rows``)."""
    shape = _shape(x, topk_idx, w1, group, settings)
    tiles = _tiles(x.device, settings.precision.forward)
    return _saved_preact_shape(shape, tiles, settings, x.shape[0]), (routing_numel(shape, *topk_idx.shape),)


def _plan(x, topk_idx, w1, group: symm.Group, settings: OperatorSettings) -> CallPlan:
    """The plan of a call: checked, allocated and sized at the first call of its kind, then
    looked up. Its kind is all the plan depends on; with a capacity the token count is not
    part of it (the kernels' ``check_call`` compares each call's count with the capacity).
    The tile rows are part of it: a row changed at run time (``profile_layer --tiles``)
    gets buffers and kernels of its own."""
    key = (
        settings.encode(),  # what the ops carry; a string hashes once, a dataclass at every lookup
        _tiles(x.device, settings.precision.forward),
        _tiles(x.device, settings.precision.dgrad),
        None if group is None else (group.group_name, group.rank()),
        x.device,
        x.dtype,
        w1.dtype,
        x.shape[1],
        0 if settings.capacity_tokens_per_rank else x.shape[0],
        topk_idx.shape[1],
        w1.shape,
    )
    plan = _PLANS.get(key)
    if plan is None:
        _check_runs(x, w1, settings)
        buffers = _buffers(group, x.device, _shape(x, topk_idx, w1, group, settings), settings)
        plan = CallPlan(buffers, *_programs(x, group, settings))
        _PLANS[key] = plan
    return plan


def moe_forward(x, topk_idx, topk_w, w1, w2, w3, group: symm.Group, score_before_experts: bool,
                settings: OperatorSettings) -> tuple[torch.Tensor, ...]:
    """``(y, tokens per local expert, saved pre-activations, routing)``."""
    plan = _plan(x, topk_idx, w1, group, settings)
    buffers = plan.buffers
    preact = x.new_empty(_saved_preact_shape(buffers.shape, buffers.tiles, settings, x.shape[0]))
    y, tokens_per_expert, routing = fused_forward(
        *(t.contiguous() for t in (x, topk_idx, topk_w, w1, w2, w3)),
        buffers,
        score_before_experts,
        plan.comm_programs,
        plan.num_programs,
        settings.timeout_s,
        preact=preact if settings.save_gemm1 else None,
    )
    return y, tokens_per_expert, preact, routing


def moe_backward(dy, x, topk_idx, topk_w, w1, w2, w3, saved: torch.Tensor, routing: torch.Tensor,
                 group: symm.Group, score_before_experts: bool, settings: OperatorSettings) -> tuple[torch.Tensor, ...]:
    """``(dx, d_topk_w, dw1, dw2, dw3)``; ``saved`` and ``routing`` as the forward returned
    them. The backward consumes ``saved``; a second backward over the same graph
    (``retain_graph``) recomputes GEMM1 instead. The kernels compute the weight gradients
    in the activations' dtype: float32 weights get them cast, as their own copies' would be."""
    plan = _plan(x, topk_idx, w1, group, settings)
    dx, d_topk_w, *weight_grads = fused_backward(
        *(t.contiguous() for t in (dy, x, topk_idx, topk_w, w1, w2, w3)),
        saved if settings.save_gemm1 and not preact_released(saved) else None,
        routing,
        plan.buffers,
        _grad_buffers(group, plan.buffers, settings),
        score_before_experts,
        plan.comm_programs,
        plan.num_programs,
        settings.timeout_s,
    )
    # One weight at a time: each bf16 gradient is freed as its float32 copy lands, so
    # float32 experts never hold all three gradients in both dtypes at once.
    for i, w in enumerate((w1, w2, w3)):
        weight_grads[i] = weight_grads[i].to(w.dtype)
    return dx, d_topk_w, *weight_grads

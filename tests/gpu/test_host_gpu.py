"""The host runs ahead of the GPU (``kernels.sync``: no host wait), at the Qwen3-30B-A3B
expert shapes on one GPU:

- steady-state calls, forward and backward, recomputed under activation checkpointing,
  in every precision, synchronise nothing (``torch.cuda.set_sync_debug_mode("error")``)
  and never wait for a host record (``HostRecords.read_ring``, instrumented);
- a routing that brings more rows than the receive window (``receive_load`` under the
  mean) is computed exactly in further rounds, with no wait, and the buffers then grow;
- a layer's forward and backward captured in a CUDA graph and replayed on new inputs give
  what eager calls give, bit for bit.
"""

import contextlib

import pytest
import torch
from problems import expert_weight_shards
from ranks import run_ranks

from titan_megamoe.precision import get_precision
from titan_megamoe.reference import relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
TOKENS = 1024
PRECISIONS = ("bf16", "fp8", "fp8_bwd", "mxfp8")
TOLERANCE = {"bf16": 1e-2, "fp8": 8e-2, "fp8_bwd": 8e-2, "mxfp8": 8e-2}
"""Against fp32 (DESIGN.md, Tolerances)."""


def _skip_unless_fused_runs(precision: str) -> None:
    from titan_megamoe.fused_support import unsupported_reason

    reason = unsupported_reason(torch.device("cuda"), torch.bfloat16, get_precision(precision), True)
    if reason:
        pytest.skip(reason)


def _problem(seed: int, skewed: bool = False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g, device="cuda").bfloat16()
    scores = torch.rand(TOKENS, EXPERTS, generator=g, device="cuda")
    if skewed:  # most slots on the first 16 experts
        scores[:, :16] += 0.8
    idx = scores.topk(TOP_K, dim=1).indices
    w = torch.softmax(torch.randn(TOKENS, TOP_K, generator=g, device="cuda"), dim=1)
    dy = torch.randn(TOKENS, HIDDEN, generator=g, device="cuda").bfloat16()
    return x, idx, w, dy


def _weights(seed: int):
    return [w.requires_grad_() for w in expert_weight_shards(seed, 0, 1, EXPERTS, HIDDEN, INTER)]


def _settings(precision: str, **changes):
    from titan_megamoe.settings import OperatorSettings

    return OperatorSettings(precision=precision, backend="fused", capacity_tokens_per_rank=TOKENS, save_gemm1=True,
                            **changes)


@contextlib.contextmanager
def _counted_record_reads():
    """Count the host's reads of received-rows records, and those that waited."""
    from titan_megamoe.kernels.records import HostRecords

    counts = {"reads": 0}
    read = HostRecords.read_ring

    def counting(self, *args, **kwargs):
        counts["reads"] += 1
        return read(self, *args, **kwargs)

    HostRecords.read_ring = counting
    try:
        yield counts
    finally:
        HostRecords.read_ring = read


def _layer(x, idx, w, weights, settings, checkpointed: bool):
    from torch.utils.checkpoint import checkpoint

    from titan_megamoe.ops import mega_moe

    def call(x, w, w1, w2, w3):
        return mega_moe(x, idx, w, w1, w2, w3, None, score_before_experts=False, settings=settings)[0]

    if checkpointed:
        return checkpoint(call, x, w, *weights, use_reentrant=False)
    return call(x, w, *weights)


def _no_host_wait(rank, world, precision):
    """Two warm-up steps, then steady-state steps (plain, and checkpointed: the backward
    recomputes the forward right before it) under ``set_sync_debug_mode("error")``: no
    synchronising call, no record read that waits; the last step matches fp32."""
    from titan_megamoe import fused, reference

    settings = _settings(precision)
    weights = _weights(1)
    problems = [_problem(seed) for seed in range(4)]
    x = problems[0][0].clone().requires_grad_()
    w = problems[0][2].clone().requires_grad_()
    for checkpointed in (False, True):  # warm-up: buffers, kernels, the caching allocator
        _layer(x, problems[0][1], w, weights, settings, checkpointed).backward(problems[0][3])
    torch.cuda.synchronize()
    waits = fused.record_waits()[0]
    with _counted_record_reads() as counts:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step, (xs, idx, ws, dy) in enumerate(problems):
                for t in (x, w, *weights):
                    t.grad = None
                with torch.no_grad():
                    x.copy_(xs)
                    w.copy_(ws)
                y = _layer(x, idx, w, weights, settings, checkpointed=step % 2 == 1)
                y.backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(f"{precision}: {len(problems)} steps, {counts['reads']} record reads, "
          f"{fused.record_waits()[0] - waits} waits", flush=True)
    assert fused.record_waits()[0] == waits and counts["reads"] == 0, counts
    xs, idx, ws, dy = problems[-1]
    f32 = [t.detach().float() for t in weights]
    y_ref, _ = reference.moe_forward(xs.float(), idx, ws, *f32, None, False, get_precision("bf16"))
    grads_ref = reference.moe_backward(dy.float(), xs.float(), idx, ws, *f32, None, False, get_precision("bf16"))
    for name, got, want in zip(("y", "dx", "d_topk_w", "dw1", "dw2", "dw3"), (y, x.grad, w.grad, *(
            t.grad for t in weights)), (y_ref, *grads_ref)):
        err = relative_error(got, want)
        print(f"{precision} {name}: {err:.1e} from fp32", flush=True)
        assert torch.isfinite(got).all() and err < TOLERANCE[precision], (name, err)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_steady_state_calls_never_wait(precision):
    _skip_unless_fused_runs(precision)
    run_ranks(_no_host_wait, 1, precision, backend="nccl", timeout_s=600)


def _rounds_then_growth(rank, world, precision):
    """A receive window of a third of the mean rows and a skewed routing: every call runs
    in rounds and matches fp32 (a quantized precision's output also its spec), the host
    waiting for nothing; ``GROWTH_LAG`` (here 2) calls later the window grows, once, to hold
    the call's rows in its first round."""
    from titan_megamoe import fused, reference
    from titan_megamoe.kernels import buffers as buffers_module
    from titan_megamoe.ops import mega_moe

    buffers_module.GROWTH_LAG = 2
    settings = _settings(precision, receive_load=0.35)
    weights = _weights(2)
    xs, idx, ws, dy = _problem(5, skewed=True)
    buffers = fused._plan(xs, idx, weights[0], None, settings).buffers
    window, rounds = buffers.window, buffers.rounds
    f32 = [t.detach().float() for t in weights]
    y_ref, _ = reference.moe_forward(xs.float(), idx, ws, *f32, None, False, get_precision("bf16"))
    grads_ref = reference.moe_backward(dy.float(), xs.float(), idx, ws, *f32, None, False, get_precision("bf16"))
    spec = get_precision(precision)
    y_spec, _ = reference.moe_forward(xs, idx, ws, *(t.detach() for t in weights), None, False, spec)
    for step in range(3):
        x, w = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        for t in weights:
            t.grad = None
        y = mega_moe(x, idx, w, *weights, None, score_before_experts=False, settings=settings)[0]
        y.backward(dy)
        torch.cuda.synchronize()
        record = buffers.records.read_ring(buffers.calls, timeout_s=1.0, stop=lambda: False)
        print(f"{precision} step {step}: window {buffers.window} rows, {buffers.rounds} round(s); the rank received "
              f"{record.most} rows", flush=True)
        for name, got, want in zip(("y", "dx", "d_topk_w", "dw1", "dw2", "dw3"),
                                   (y, x.grad, w.grad, *(t.grad for t in weights)), (y_ref, *grads_ref)):
            err = relative_error(got, want)
            print(f"  {name}: {err:.1e} from fp32", flush=True)
            assert torch.isfinite(got).all() and err < TOLERANCE[precision], (step, name, err)
        if precision != "bf16":
            assert relative_error(y, y_spec) < 1e-2, (step, "y against its spec")
    assert record.most > window and rounds > 1, (record.most, window, rounds)
    assert window < record.most <= buffers.window, (window, record.most, buffers.window)
    assert fused.record_waits()[0] == 0


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_rows_past_the_window_run_in_rounds_then_the_window_grows(precision):
    _skip_unless_fused_runs(precision)
    run_ranks(_rounds_then_growth, 1, precision, backend="nccl", timeout_s=600)


def _graph_replays_match_eager(rank, world, precision):
    """A layer's forward and backward captured in a CUDA graph (after eager warm-up calls
    on the same stream), replayed on new inputs copied into its static ones: output and
    every gradient equal, bit for bit, an eager call's on the same inputs. A replay whose
    routing holds a bad expert id returns NaN; ``fused.raise_pending()`` raises it, and the
    replays after it compute again."""
    from titan_megamoe import fused

    settings = _settings(precision)
    weights = _weights(3)
    static = [t.clone() for t in _problem(10)]
    x = static[0].requires_grad_()
    w = static[2].requires_grad_()
    for _ in range(2):
        _layer(x, static[1], w, weights, settings, False).backward(static[3])
    torch.cuda.synchronize()
    for t in (x, w, *weights):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _layer(x, static[1], w, weights, settings, False)
        y.backward(static[3])
    leaves = (x, w, *weights)
    for seed in (11, 12, "bad id", 13):
        if seed == "bad id":
            with torch.no_grad():
                static[1][7, 2] = EXPERTS + 1
            graph.replay()
            torch.cuda.synchronize()
            assert torch.isnan(y.float()).all(), "a poisoned replay returned numbers"
            with pytest.raises(ValueError, match=rf"expert id {EXPERTS + 1}, .* at token 7, slot 2, in a call replayed "
                                                 "from a CUDA graph"):
                fused.raise_pending()
            continue
        fresh = _problem(seed)
        with torch.no_grad():
            for target, source in zip(static, fresh):
                target.copy_(source)
        graph.replay()
        replayed = [y.detach().clone()] + [t.grad.clone() for t in leaves]
        eager_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        eager_y = _layer(eager_leaves[0], static[1], eager_leaves[1], eager_leaves[2:], settings, False)
        eager_y.backward(static[3])
        eager = [eager_y.detach()] + [t.grad for t in eager_leaves]
        torch.cuda.synchronize()
        for name, got, want in zip(("y", "dx", "d_topk_w", "dw1", "dw2", "dw3"), replayed, eager):
            print(f"{precision} replay {seed} {name}: max difference {float((got - want).abs().max()):.1e}",
                  flush=True)
            assert torch.equal(got, want), (seed, name)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_cuda_graph_replays_match_eager(precision):
    _skip_unless_fused_runs(precision)
    run_ranks(_graph_replays_match_eager, 1, precision, backend="nccl", timeout_s=600)

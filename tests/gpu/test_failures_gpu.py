"""Failures are loud on every rank, and call orderings the protocol must get right, on
real GPUs (Qwen3-30B-A3B expert shapes):

- a peer that arrives past the deadline: both ranks stop in that call, none returns a
  result, each names who failed and why, and every later call raises at once;
- an out-of-range expert id on one rank: found on the device, it poisons both ranks'
  buffers (the call returns NaN on both), the next call raises on both naming it,
  nothing stops, and the call after runs on both;
- forwards F1 F2 then backwards B1 B2 and B2 B1, where one owner must have the expert
  inputs resent (its copy of F2's input changed) and the other reuses them;
- what the protocol cannot serve is refused: eager calls on a second stream.

A rank whose kernels stopped has lost its CUDA context: such ranks report through
``fused.failures()`` (which the fused backend also prints as soon as it is recorded)
and leave with ``os._exit`` (no collective can run any more).
"""

import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from problems import expert_weight_shards
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
TOKENS = 2048


def _problem(rank: int, world: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g, device="cuda").bfloat16()
    idx = torch.rand(TOKENS, EXPERTS, generator=g, device="cuda").topk(TOP_K, dim=1).indices
    w = torch.softmax(torch.randn(TOKENS, TOP_K, generator=g, device="cuda"), dim=1)
    return x, idx, w, *expert_weight_shards(seed + 1000, rank, world, EXPERTS, HIDDEN, INTER)


def _settings(**changes):
    from titan_megamoe.settings import OperatorSettings

    return OperatorSettings(precision="bf16", backend="fused", capacity_tokens_per_rank=TOKENS, **changes)


def _stopped_call(rank, world, spoil, expected):
    """One good call, then a call ``spoil(rank, problem)`` makes fail; every rank must
    raise in that call and report ``expected[rank]``."""
    from titan_megamoe import fused

    try:
        settings = _settings(timeout_s=3.0)
        problem = _problem(rank, world, 0)
        group = dist.group.WORLD
        fused.moe_forward(*problem, group, False, settings)
        torch.cuda.synchronize()
        dist.barrier()
        # NCCL's watchdog aborts a process whose CUDA context is lost while it still
        # tracks a collective: let it retire the barrier before the call that stops.
        time.sleep(1.0)
        problem = spoil(rank, problem)
        outcome = "returned a result"
        try:
            y = fused.moe_forward(*problem, group, False, settings)[0]
            y.sum().item()
        except RuntimeError as error:
            outcome = f"raised: {str(error)[:120]}"
        print(f"rank {rank}: the call {outcome}; recorded: {fused.failures()}", flush=True)
        assert outcome.startswith("raised"), outcome
        (message,) = fused.failures()
        assert expected[rank] in message and "the process must restart" in message, message
        time.sleep(3 * fused.REPORT_INTERVAL_S)
        assert message in fused._reported, "the failure was not printed"
        with pytest.raises(RuntimeError, match="the process must restart"):
            fused.moe_forward(*problem, group, False, settings)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _late(rank, problem):
    if rank == 1:
        time.sleep(8.0)  # well past the 3 s deadline
    return problem


def test_a_late_peer_stops_every_rank():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    expected = ["rank 0 timed out after 3 s waiting for COUNT_READY[1] (value 1, expected 2) at epoch 2",
                "rank 1 stopped at epoch 2 because rank 0 failed (COUNT_READY)"]
    run_ranks(_stopped_call, 2, _late, expected, backend="nccl", timeout_s=300)


def _bad_id_on_rank_0(rank, world):
    """Rank 0's ``topk_idx`` holds an id past the last expert: both ranks' calls return NaN,
    and their next calls raise ValueError naming it; neither device faults; the call after
    (valid ids) runs on both and matches the reference."""
    from titan_megamoe import fused, reference
    from titan_megamoe.precision import get_precision
    from titan_megamoe.reference import relative_error

    group = dist.group.WORLD
    settings = _settings(timeout_s=30.0)
    x, idx, w, w1, w2, w3 = _problem(rank, world, 0)
    bad = idx.clone()
    if rank == 0:
        bad[17, 3] = EXPERTS + 7
    owner = "" if rank == 0 else "rank 0's "
    assert torch.isnan(fused.moe_forward(x, bad, w, w1, w2, w3, group, False, settings)[0]).all()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=rf"{owner}topk_idx holds expert id {EXPERTS + 7}, outside \[0, {EXPERTS}\) "
                                         r"\(2 EP ranks x 64 local experts\), at token 17, slot 3"):
        fused.moe_forward(x, idx, w, w1, w2, w3, group, False, settings)
    assert fused.failures() == []
    y = fused.moe_forward(x, idx, w, w1, w2, w3, group, False, settings)[0]
    expected, _ = reference.moe_forward(x, idx, w, w1, w2, w3, group, False, get_precision("bf16"))
    err = relative_error(y, expected)
    print(f"rank {rank}: raised for the bad id; the next call {err:.1e} from the reference", flush=True)
    assert err < 1e-2, err


def test_a_bad_expert_id_poisons_every_rank():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(_bad_id_on_rank_0, 2, backend="nccl", timeout_s=300)


def _orderings(rank, world):
    """F1 F2 B1 B2 and F1 F2 B2 B1 against the fp32 reference. Before B2, rank 0's copy of
    F2's input is changed in place (same values, new version): rank 0 must have the inputs
    resent, rank 1 reuses the ones it holds; rank 0's receive buffer is poisoned so a
    missing resend shows."""
    from titan_megamoe import fused, reference
    from titan_megamoe.precision import get_precision
    from titan_megamoe.reference import relative_error

    group, settings, bf16 = dist.group.WORLD, _settings(), get_precision("bf16")
    problems = [_problem(rank, world, seed) for seed in (1, 2)]
    dys = [torch.randn_like(p[0]) for p in problems]
    expected = []
    for p, dy in zip(problems, dys):
        f32 = [t.float() for t in (p[0], *p[3:])]
        expected.append(reference.moe_backward(dy.float(), f32[0], p[1], p[2], *f32[1:], group, False, bf16))
    for order in ((0, 1), (1, 0)):
        saved = [fused.moe_forward(*p, group, False, settings)[2:] for p in problems]
        for i in order:
            if i == 1 and rank == 0:
                problems[1][0].mul_(1.0)
                for buffers in fused._BUFFERS.values():
                    buffers.recv.fill_(float("nan"))
            grads = fused.moe_backward(dys[i], *problems[i], *saved[i], group, False, settings)
            for name, got, want in zip(("dx", "d_topk_w", "dw1", "dw2", "dw3"), grads, expected[i]):
                err = relative_error(got, want)
                print(f"rank {rank} order {order} B{i + 1} {name}: {err:.1e}", flush=True)
                assert torch.isfinite(got).all() and err < 1e-2, (order, i, name, err)


def test_call_orderings_with_resent_and_reused_inputs():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(_orderings, 2, backend="nccl", timeout_s=600)


def _refusals(rank, world):
    from titan_megamoe import fused

    problem = _problem(0, 1, 3)
    settings = _settings()
    fused.moe_forward(*problem, None, False, settings)
    with torch.cuda.stream(torch.cuda.Stream()):
        with pytest.raises(RuntimeError, match="its buffers belong to"):
            fused.moe_forward(*problem, None, False, settings)


def test_a_second_stream_is_refused():
    run_ranks(_refusals, 1, backend="nccl", timeout_s=300)

"""The stock backend (``titan_megamoe.stock``): forward and every gradient against the
reference op on 1, 2 and 4 gloo ranks; its grouped-GEMM path (torch's CPU
``_grouped_mm``) and the GEMM routing of the quantized recipes; where it says it runs.
The last tests need a CUDA GPU: bf16, fp8 and fp8_bwd against the reference there."""

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from problems import EXPERTS, HIDDEN, INTER, TOP_K, make_problem, make_weights, rel_err
from ranks import run_ranks
from titan_megamoe import reference, stock
from titan_megamoe.precision import get_precision

FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-2
LOW_PRECISION_TOLERANCE = 8e-2
"""Two chained e4m3 GEMMs on random data are off by ~6% (see test_reference.py)."""

NAMES = ("y", "dx", "d_topk_w", "dw1", "dw2", "dw3")

FP8_INTER = 96
"""Intermediate size where torchao's fp8 GEMMs run: a multiple of 32 (``INTER`` is 48)."""

TOKENS = {
    "random": (37, 29, 41, 5),
    "skewed": (64, 3, 0, 22),  # experts 0-2 take everything: ranks 2, 3 of 4 receive nothing
    "first_rank_only": (17, 1, 9, 30),  # experts 0-3 only: rank 1 of 2 receives nothing
}
"""Tokens on each rank (the first ``world_size`` entries) per routing scenario."""


@dataclass(frozen=True)
class Case:
    """One comparison of ``stock.routed_experts`` with the reference op."""

    routing: str
    score_before: bool
    precision: str = "bf16"
    reference_precision: str = "bf16"
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    forward_tolerance: float = FP32_TOLERANCE
    gradient_tolerance: float = FP32_TOLERANCE
    grouped: bool = False
    """Run the grouped-GEMM (CUDA) path on the CPU, through torch's CPU ``_grouped_mm``."""
    inter: int = INTER


@contextlib.contextmanager
def poisoned_allocations():
    """Every uninitialised allocation (``torch.empty``, ``new_empty``, collective outputs)
    filled with NaN, so that rows the path fails to write show up in its results."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    # PyTorch fills uninitialised memory only in deterministic mode.
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling


def _rank_inputs(rank: int, world_size: int, case: Case):
    """This rank's ``(x, topk_idx, topk_w, w1, w2, w3, dy)`` on the case's device and
    dtype (``topk_w`` stays fp32); every rank derives the same global problem."""
    device = torch.device(case.device)
    local = EXPERTS // world_size
    shard = slice(rank * local, (rank + 1) * local)
    x, idx, w = make_problem(TOKENS[case.routing][rank], case.routing, seed=100 + rank)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(200 + rank))
    w1, w2, w3 = (t[shard] for t in _weights(case.inter))
    floats = [t.to(device=device, dtype=case.dtype) for t in (x, w1, w2, w3, dy)]
    x, w1, w2, w3, dy = floats
    return x, idx.to(device), w.to(device), w1, w2, w3, dy


def _weights(inter: int):
    """``make_weights()``, or weights of the same scale with another intermediate size."""
    if inter == INTER:
        return make_weights()
    g = torch.Generator().manual_seed(1234)
    w1, w3 = (torch.randn(EXPERTS, inter, HIDDEN, generator=g) / HIDDEN**0.5 for _ in range(2))
    return w1, torch.randn(EXPERTS, HIDDEN, inter, generator=g) / inter**0.5, w3


def _stock_results(inputs, group, case: Case) -> list[torch.Tensor]:
    x, idx, w, w1, w2, w3, dy = inputs
    leaves = [t.clone().requires_grad_(True) for t in (x, w, w1, w2, w3)]
    xl, wl, w1l, w2l, w3l = leaves
    precision = get_precision(case.precision)
    y = stock.routed_experts(xl, idx, wl, w1l, w2l, w3l, group, case.score_before, precision)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def _reference_results(inputs, group, case: Case) -> list[torch.Tensor]:
    x, idx, w, w1, w2, w3, dy = inputs
    precision = get_precision(case.reference_precision)
    y, _ = reference.moe_forward(x, idx, w, w1, w2, w3, group, case.score_before, precision)
    grads = reference.moe_backward(dy, x, idx, w, w1, w2, w3, group, case.score_before, precision)
    return [y] + list(grads)


def check_rank(rank: int, world_size: int, case: Case) -> None:
    """One rank: the stock path's output and gradients against the reference op's."""
    group = None if world_size == 1 else dist.group.WORLD
    inputs = _rank_inputs(rank, world_size, case)
    # The deterministic fill needs cuBLAS settings on a GPU: poison on the CPU only.
    poison = poisoned_allocations() if case.device == "cpu" else contextlib.nullcontext()
    for_loop_devices = stock._FOR_LOOP_DEVICES
    try:
        if case.grouped:
            stock._FOR_LOOP_DEVICES = ()
        with poison:
            results = _stock_results(inputs, group, case)
    finally:
        stock._FOR_LOOP_DEVICES = for_loop_devices
    expected = _reference_results(inputs, group, case)
    errors = {}
    for name, got, want in zip(NAMES, results, expected):
        assert got is not None and got.shape == want.shape and got.dtype == want.dtype, (case, name)
        errors[name] = rel_err(got, want)  # an expected all-zero gradient needs exact zeros
    limits = {name: case.forward_tolerance if name == "y" else case.gradient_tolerance for name in NAMES}
    assert all(errors[n] <= limits[n] for n in NAMES), f"rank {rank}, {case}: {errors}"


def check_ranks(rank: int, world_size: int, cases: list[Case]) -> None:
    """:func:`check_rank` for each case in turn (one set of rank processes for all)."""
    for case in cases:
        check_rank(rank, world_size, case)


def _receives_nothing(routing: str, world_size: int) -> set[int]:
    """Ranks whose experts no token of any rank is routed to."""
    local = EXPERTS // world_size
    routed = torch.cat([make_problem(n, routing, seed=100 + r)[1].flatten()
                        for r, n in enumerate(TOKENS[routing][:world_size])])
    return {r for r in range(world_size) if not ((routed // local) == r).any()}


# ---------------------------------------------------------------------------------------
# fp32 on the CPU: TorchTitan's for-loop path, within 1e-5 of the reference.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("score_before", [False, True])
@pytest.mark.parametrize("routing", ["random", "skewed", "first_rank_only"])
def test_one_rank_matches_reference(routing, score_before):
    check_rank(0, 1, Case(routing, score_before))


def test_one_rank_without_tokens():
    inputs = list(_rank_inputs(2, 4, Case("skewed", False)))  # rank 2 of "skewed" has 0 tokens
    assert inputs[0].shape[0] == 0
    results = _stock_results(inputs, None, Case("skewed", False))
    assert results[0].shape == (0, HIDDEN) and results[1].shape == (0, HIDDEN)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in results[3:])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_match_reference(world_size):
    cases = [Case(routing, score_before) for routing in TOKENS for score_before in (False, True)]
    run_ranks(check_ranks, world_size, cases, timeout_s=600)


def test_scenarios_include_ranks_receiving_nothing():
    assert _receives_nothing("first_rank_only", 2) == {1}
    assert _receives_nothing("skewed", 4) == {2, 3}
    assert 0 in TOKENS["skewed"][:4]  # and a rank that sends nothing


# ---------------------------------------------------------------------------------------
# The grouped-GEMM path (what CUDA runs), here on torch's CPU _grouped_mm: it computes in
# bf16 as TorchTitan's _run_experts_grouped_mm casts, so inputs are bf16.
# ---------------------------------------------------------------------------------------

GROUPED_BF16 = dict(dtype=torch.bfloat16, forward_tolerance=BF16_TOLERANCE,
                    gradient_tolerance=BF16_TOLERANCE, grouped=True)


@pytest.mark.parametrize("score_before", [False, True])
def test_grouped_path_one_rank(score_before):
    check_rank(0, 1, Case("skewed", score_before, **GROUPED_BF16))


def test_grouped_path_two_ranks():
    cases = [Case("first_rank_only", score_before, **GROUPED_BF16) for score_before in (False, True)]
    run_ranks(check_ranks, 2, cases, timeout_s=300)


@pytest.mark.parametrize("precision, alignment", [("fp8", 16), ("fp8_bwd", 16), ("mxfp8", 32)])
def test_quantized_recipes_route_every_grouped_gemm(precision, alignment, monkeypatch):
    """With torchao's GEMM replaced by a recording bf16 one: all three grouped GEMMs of the
    forward reach it, on token groups aligned as torchao needs."""
    calls = []

    def recording_grouped_mm(a, b_t, offs=None, **kwargs):
        calls.append(offs.clone())
        return torch._grouped_mm(a, b_t, offs=offs)

    monkeypatch.setattr(stock, "_FOR_LOOP_DEVICES", ())
    monkeypatch.setattr(stock, "_torchao_grouped_mm", lambda recipe: recording_grouped_mm)
    case = Case("skewed", False, dtype=torch.bfloat16, inter=FP8_INTER)
    x, idx, w, w1, w2, w3, _ = _rank_inputs(0, 1, case)
    y = stock.routed_experts(x, idx, w, w1, w2, w3, None, False, get_precision(precision))
    y_ref, _ = reference.moe_forward(x, idx, w, w1, w2, w3, None, False, get_precision("bf16"))
    assert rel_err(y, y_ref) <= BF16_TOLERANCE
    assert len(calls) == 3
    sizes = torch.diff(calls[0], prepend=calls[0].new_zeros(1))
    assert (sizes % alignment == 0).all() and (sizes > 0).all()


# ---------------------------------------------------------------------------------------
# Errors, and where the backend says it runs.
# ---------------------------------------------------------------------------------------


def test_torchao_fp8_needs_sizes_multiple_of_32(monkeypatch):
    monkeypatch.setattr(stock, "_FOR_LOOP_DEVICES", ())
    x, idx, w, w1, w2, w3, _ = _rank_inputs(0, 1, Case("random", False, dtype=torch.bfloat16))
    assert INTER % 32
    with pytest.raises(ValueError, match=f"intermediate {INTER}"):
        stock.routed_experts(x, idx, w, w1, w2, w3, None, False, get_precision("fp8"))


def test_quantized_precision_refused_on_cpu():
    x, idx, w, w1, w2, w3, _ = _rank_inputs(0, 1, Case("random", False))
    with pytest.raises(NotImplementedError, match="'fp8'"):
        stock.routed_experts(x, idx, w, w1, w2, w3, None, False, get_precision("fp8"))


def test_bad_inputs_raise():
    x, idx, w, w1, w2, w3, _ = _rank_inputs(0, 1, Case("random", False))
    bf16 = get_precision("bf16")
    with pytest.raises(ValueError, match="topk_w must be float32"):
        stock.routed_experts(x, idx, w.double(), w1, w2, w3, None, False, bf16)
    with pytest.raises(ValueError, match="w2 must have shape"):
        stock.routed_experts(x, idx, w, w1, w2.transpose(1, 2), w3, None, False, bf16)


def _route_out_of_range(rank: int, world_size: int) -> None:
    x, idx, w, w1, w2, w3, _ = _rank_inputs(rank, world_size, Case("random", False))
    if rank == 0:
        idx[3, 1] = EXPERTS
    # Every rank raises, not only the one holding the bad id: none is left waiting.
    with pytest.raises(ValueError, match=rf"outside \[0, {EXPERTS}\).*\[1, 0\]"):
        stock.routed_experts(x, idx, w, w1, w2, w3, dist.group.WORLD, False, get_precision("bf16"))


def test_out_of_range_expert_raises_on_every_rank():
    run_ranks(_route_out_of_range, 2, timeout_s=120)


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _reason(device, precision, dtype=torch.bfloat16):
    return stock.unsupported_reason(device, dtype, get_precision(precision), True)


def test_runs_bf16_on_cpu_refuses_quantized():
    assert _reason(CPU, "bf16") is None
    assert _reason(CPU, "bf16", torch.float32) is None
    for precision in ("fp8", "fp8_bwd", "mxfp8", "mxfp8_wgrad_bf16"):
        reason = _reason(CPU, precision)
        assert reason is not None and repr(precision) in reason and "CUDA" in reason
    # torchao has no fp8 grouped GEMM with bf16 weight gradients: no stock recipe anywhere.
    assert _reason(CPU, "fp8_wgrad_bf16") == "precision 'fp8_wgrad_bf16' has no stock grouped-GEMM recipe"
    assert "floating point" in _reason(CPU, "bf16", torch.int32)


def _fake_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_mxfp8_refused_on_sm90(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0))
    for precision in ("mxfp8", "mxfp8_wgrad_bf16"):
        reason = _reason(CUDA, precision)
        assert reason is not None and "SM100" in reason and "SM90" in reason
    assert _reason(CUDA, "bf16") is None
    assert _reason(CUDA, "bf16", torch.float32) is None  # runs bf16 GEMMs, as stock does
    # fp8 runs on SM90 wherever torchao's MoE training imports.
    for precision in ("fp8", "fp8_bwd"):
        reason = _reason(CUDA, precision)
        assert reason is None or "torchao" in reason


def test_fp8_refused_below_sm90(monkeypatch):
    _fake_gpu(monkeypatch, (8, 9))
    for precision in ("fp8", "fp8_bwd"):
        reason = _reason(CUDA, precision)
        assert reason is not None and "SM90" in reason and "SM89" in reason
    assert _reason(CUDA, "bf16") is None


def test_mxfp8_on_sm100_needs_torchao_kernels(monkeypatch):
    _fake_gpu(monkeypatch, (10, 0))
    reason = _reason(CUDA, "mxfp8")
    # This CPU host has no SM100 kernels (or no importable torchao MoE training).
    assert reason is not None and "torchao" in reason


# ---------------------------------------------------------------------------------------
# On a CUDA GPU (skipped elsewhere): TorchTitan's grouped GEMMs and torchao's fp8 ones.
# ---------------------------------------------------------------------------------------

GPU_CASES = {
    # bf16 GEMMs against the bf16 spec on the same bf16 inputs.
    "bf16": dict(precision="bf16", forward_tolerance=BF16_TOLERANCE, gradient_tolerance=BF16_TOLERANCE),
    # torchao's fp8 rowwise format against the unquantized spec.
    "fp8": dict(precision="fp8", forward_tolerance=LOW_PRECISION_TOLERANCE,
                gradient_tolerance=LOW_PRECISION_TOLERANCE),
    "fp8_bwd": dict(precision="fp8_bwd", forward_tolerance=BF16_TOLERANCE,
                    gradient_tolerance=LOW_PRECISION_TOLERANCE),
}


def _gpu_case(name: str, routing: str, score_before: bool) -> Case:
    reason = _reason(CUDA, GPU_CASES[name]["precision"])
    if reason is not None:
        pytest.skip(reason)
    return Case(routing, score_before, device="cuda", dtype=torch.bfloat16, inter=FP8_INTER,
                **GPU_CASES[name])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("score_before", [False, True])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_one_rank(name, score_before):
    check_rank(0, 1, _gpu_case(name, "skewed", score_before))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_two_ranks(name):
    cases = [_gpu_case(name, routing, score_before) for routing in TOKENS for score_before in (False, True)]
    run_ranks(check_ranks, 2, cases, backend="nccl", timeout_s=300)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("score_before", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_matches_stock_torchtitan(precision, score_before, monkeypatch):
    """The same layer through TorchTitan's MoE (with torchao's converter for fp8, as
    ``quantize.grouped_mm.float8`` applies it, and its expert function compiled as
    ``apply_compile`` does) and through the stock backend: the same output and
    gradients."""
    from torchtitan.models.moe import moe as moe_module
    from torchtitan.models.moe import utils as moe_utils
    from torchtitan.models.moe.moe import MoE, MoEArgs

    reason = _reason(CUDA, precision)
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    args = MoEArgs(num_experts=EXPERTS, num_shared_experts=0, top_k=TOP_K, score_func="softmax",
                   score_before_experts=score_before, load_balance_coeff=None)
    moe = MoE(args, dim=HIDDEN, hidden_dim=FP8_INTER).cuda()
    with torch.no_grad():
        moe.init_weights(0.02, CUDA)
    moe.to(torch.bfloat16)
    weights = [getattr(moe.experts, n).detach().clone().requires_grad_(True) for n in ("w1", "w2", "w3")]
    if precision == "fp8":
        from torchao.prototype.moe_training.conversion_utils import MoETrainingConfig
        from torchao.quantization.quant_api import quantize_

        quantize_(moe, MoETrainingConfig(), filter_fn=lambda module, fqn: fqn == "experts")
        monkeypatch.setattr(moe_utils, "TOKEN_GROUP_ALIGN_SIZE_M", 16)  # as the converter sets it
        compiled = torch.compile(moe_module._run_experts_grouped_mm, fullgraph=True)
        monkeypatch.setattr(moe_module, "_run_experts_grouped_mm", compiled)
    x = torch.randn(256, HIDDEN, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    y_stock = moe(x.view(1, *x.shape)).view(x.shape)
    y_stock.backward(dy)
    stock_grads = [x.grad] + [getattr(getattr(moe.experts, n).grad, "_data", getattr(moe.experts, n).grad)
                              for n in ("w1", "w2", "w3")]
    x_ours = x.detach().clone().requires_grad_(True)
    scores, idx, _ = moe.router(x_ours, None)
    y = stock.routed_experts(x_ours, idx, scores, *weights, None, score_before, get_precision(precision))
    y.backward(dy)
    for name, got, want in zip(("y", "dx", "dw1", "dw2", "dw3"), [y, x_ours.grad] + [w.grad for w in weights],
                               [y_stock] + stock_grads):
        assert rel_err(got, want) <= 1e-6, name

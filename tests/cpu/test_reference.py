"""The operator's reference backend against a float64 per-slot formula, on 1 and 2 ranks."""

import pytest
import torch
import torch.distributed as dist

from problems import (
    EXPERTS, HIDDEN, INTER, NAMES, TOP_K, assert_compiles_like_eager, check_ep_rank, make_problem,
    make_routing, make_weights, rel_err, run_naive, run_op,
)
from ranks import run_ranks
from titan_megamoe.ops import mega_moe
from titan_megamoe.precision import E4M3_MAX, FP8_BLOCK, MXFP8, NATIVE
from titan_megamoe.reference import quantize_operand
from titan_megamoe.settings import OperatorSettings

REFERENCE = OperatorSettings(backend="reference")

@pytest.mark.parametrize("score_before", [False, True])
@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_single_rank_matches_formula(score_before, routing):
    x, idx, w = make_problem(37, routing, seed=0)
    w1, w2, w3 = make_weights()
    dy = torch.randn_like(x)
    y, counts, grads = run_op(x, idx, w, w1, w2, w3, None, score_before, "bf16", dy)
    y_ref, grads_ref = run_naive(x, idx, w, w1, w2, w3, score_before, dy)
    assert rel_err(y, y_ref) < 1e-5
    for name, g, g_ref in zip(NAMES, grads, grads_ref):
        assert rel_err(g, g_ref) < 1e-5, name
    assert torch.equal(counts, torch.bincount(idx.flatten(), minlength=EXPERTS))


@pytest.mark.parametrize("score_before", [False, True])
def test_gradcheck_float64(score_before):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=g, dtype=torch.float64)
    w1, w3 = (torch.randn(EXPERTS, 8, 16, generator=g, dtype=torch.float64) / 4 for _ in range(2))
    w2 = torch.randn(EXPERTS, 16, 8, generator=g, dtype=torch.float64) / 3
    idx = make_routing("random", 5, g)
    topk_w = torch.softmax(torch.randn(5, TOP_K, generator=g), dim=1)  # fp32 by contract

    def fn(x_, w1_, w2_, w3_):
        return mega_moe(
            x_, idx, topk_w, w1_, w2_, w3_, None, score_before_experts=score_before, settings=REFERENCE
        )[0]

    inputs = tuple(t.requires_grad_(True) for t in (x, w1, w2, w3))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


# e4m3 keeps 3 mantissa bits: one quantized operand is off by ~2.6% (Frobenius, random
# data), and an output that went through two chained quantized GEMMs by 6.2% (fp8) to
# 6.9% (mxfp8, power-of-two scales). 8e-2 bounds that with margin; 6e-2 would reject the
# formats themselves.
LOW_PRECISION_TOLERANCE = 8e-2


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd", "fp8_wgrad_bf16", "mxfp8", "mxfp8_wgrad_bf16"])
def test_low_precision_within_tolerance(precision):
    tolerance = LOW_PRECISION_TOLERANCE
    x, idx, w = make_problem(300, "random", seed=5)
    w1, w2, w3 = make_weights()
    dy = torch.randn_like(x)
    y, _, grads = run_op(x, idx, w, w1, w2, w3, None, False, precision, dy)
    y_ref, _, grads_ref = run_op(x, idx, w, w1, w2, w3, None, False, "bf16", dy)
    errors = [rel_err(y, y_ref)] + [rel_err(g, r) for g, r in zip(grads, grads_ref)]
    assert max(errors) <= tolerance, dict(zip(("y",) + NAMES, errors))
    # The format must really have been applied where the precision says so.
    forward_quantized = precision in ("fp8", "fp8_wgrad_bf16", "mxfp8", "mxfp8_wgrad_bf16")
    assert (errors[0] > 1e-4) == forward_quantized
    assert errors[3] > 1e-4  # dw1 always goes through a quantized dgrad or wgrad GEMM


def test_formats_store_representable_values():
    g = torch.Generator().manual_seed(7)
    t = torch.randn(5, 300, generator=g) * torch.logspace(-3, 3, 300)
    assert torch.equal(quantize_operand(t, NATIVE, is_weight=False), t)
    for fmt, block in ((FP8_BLOCK, 128), (MXFP8, 32)):
        q = quantize_operand(t, fmt, is_weight=False)
        assert rel_err(q, t) < 6e-2
        # Each block holds at most 2^8 distinct magnitudes times one scale: the ratio of
        # every value to its block's largest stays an e4m3 value over e4m3's max.
        for start in range(0, 300, block):
            blk = q[:, start : start + block]
            amax = blk.abs().amax(dim=1, keepdim=True)
            if fmt == MXFP8:
                scale = torch.exp2(torch.ceil(torch.log2(t[:, start : start + block].abs().amax(1, keepdim=True) / E4M3_MAX)))
                assert (amax / scale <= E4M3_MAX).all()
                assert torch.equal((blk / scale).to(torch.float8_e4m3fn).float() * scale, blk)


def test_fp8_weight_tiles_are_128x128():
    w = torch.randn(256, 256)
    w[:128, :128] *= 1000.0  # one loud tile must not coarsen its neighbours
    q = quantize_operand(w, FP8_BLOCK, is_weight=True)
    assert rel_err(q[128:, 128:], w[128:, 128:]) < 6e-2
    assert rel_err(q[:128, 128:], w[:128, 128:]) < 6e-2


# --------------------------------------------------------------------------------------
# Two gloo ranks: each rank's result must equal the formula over all experts.
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("routing", ["random", "skewed", "first_rank_only"])
@pytest.mark.parametrize("score_before", [False, True])
def test_two_ranks_match_formula(routing, score_before):
    run_ranks(check_ep_rank, 2, routing, score_before, "bf16", 1e-5)


def test_two_ranks_fp8_within_tolerance():
    run_ranks(check_ep_rank, 2, "random", False, "fp8", LOW_PRECISION_TOLERANCE)


def _bad_id_on_rank_one(rank: int, world_size: int) -> None:
    """Rank 1 routes one slot to an expert the group lacks: both ranks raise, naming it."""
    x, idx, w = make_problem(6, "random", seed=rank)
    if rank == 1:
        idx[3, 1] = world_size * EXPERTS
    w1, w2, w3 = make_weights()
    with pytest.raises(ValueError, match=rf"expert id {world_size * EXPERTS}, outside .*on EP rank 1"):
        mega_moe(x, idx, w, w1, w2, w3, dist.group.WORLD, score_before_experts=False, settings=REFERENCE)


def test_a_bad_expert_id_raises_on_every_rank():
    run_ranks(_bad_id_on_rank_one, 2)


# --------------------------------------------------------------------------------------
# Input errors.
# --------------------------------------------------------------------------------------


def _call(settings=REFERENCE, **overrides):
    x, idx, w = make_problem(4, "random", seed=0)
    w1, w2, w3 = make_weights()
    args = dict(x=x, topk_idx=idx, topk_w=w, w1=w1, w2=w2, w3=w3, group=None)
    args.update(overrides)
    return mega_moe(*args.values(), score_before_experts=False, settings=settings)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(x=torch.randn(4, 2, HIDDEN)), "x must be"),
        (dict(topk_idx=torch.zeros(3, TOP_K, dtype=torch.long)), "topk_idx must be"),
        (dict(topk_idx=torch.zeros(4, TOP_K)), "int32 or int64"),
        (dict(topk_w=torch.ones(4, TOP_K, dtype=torch.float64)), "topk_w must be float32"),
        (dict(w2=torch.randn(EXPERTS, INTER, HIDDEN)), "w2 must have shape"),
        (dict(topk_idx=torch.full((4, TOP_K), EXPERTS)), f"expert id {EXPERTS}, outside"),
    ],
)
def test_input_errors_name_the_bad_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        _call(**overrides)


@pytest.mark.parametrize(
    "backend, error, message",
    [
        ("magic", ValueError, r"settings.backend = 'magic' is not a backend the operator runs; "
                              r"pass backend='auto' \(here it runs 'reference'\), or one of 'fused', 'reference'"),
        ("stock", ValueError, r"settings.backend = 'stock' is TorchTitan's own path.*titan_megamoe.stock.routed_experts"),
        ("fused", NotImplementedError, r"settings.backend = 'fused' cannot run here: .*pass backend='auto'"),
    ],
)
def test_unresolved_or_unrunnable_backend_is_refused(backend, error, message):
    with pytest.raises(error, match=message):
        _call(settings=OperatorSettings(backend=backend))


def test_compiles_fullgraph():
    """The custom ops trace (fake implementations, autograd formula) without graph breaks."""
    x, idx, w = make_problem(37, "random", seed=0)
    assert_compiles_like_eager(REFERENCE, x, idx, w, *make_weights())


def test_ue8m0_scales_round_up_exactly_at_powers_of_two():
    """RCEIL: a block whose amax / 448 is a power of two keeps that scale; one ulp above
    it takes the next power (fp32 log2 would round that back down)."""
    from titan_megamoe.reference import quantize_blocks

    at = torch.tensor(448.0 * 1024)
    just_above = torch.nextafter(at, torch.tensor(float("inf")))
    t = torch.stack([torch.stack([at, at / 2]), torch.stack([just_above, at / 2]), torch.zeros(2)])
    _, scales = quantize_blocks(t, (1, 2), power_of_two=True)
    assert scales.flatten().tolist() == [1024.0, 2048.0, 1.0]


def test_fp32_scales_multiply_by_448_over_amax_and_floor_tiny_blocks():
    """fp32 scales: a block is stored as ``value * (448 / amax)`` with scale ``amax / 448``,
    each correctly rounded; a block whose maximum lies below ``AMAX_FLOOR`` is scaled as if
    it were the floor (its scale stays a normal fp32 number); every value dequantizes
    within half an e4m3 step, whatever its magnitude."""
    from titan_megamoe.precision import AMAX_FLOOR
    from titan_megamoe.reference import dequantize_blocks, quantize_blocks

    amax = torch.tensor(3.0625)
    t = torch.tensor([[3.0625, 1.3125], [2.0**-120, -(2.0**-121)]])
    q, scales = quantize_blocks(t, (1, 2), power_of_two=False)
    assert torch.equal(scales.flatten(), torch.stack([amax, torch.tensor(AMAX_FLOOR)]) / torch.tensor(448.0))
    assert q.float().tolist() == [[448.0, 192.0], [56.0, -28.0]]
    assert scales.min() >= torch.finfo(torch.float32).tiny

    g = torch.Generator().manual_seed(5)
    t = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-130, 120, (64, 1), generator=g).float())
    q, scales = quantize_blocks(t, (1, 128), power_of_two=False)
    back = dequantize_blocks(q, scales, (1, 128))
    half_step = torch.maximum(t.abs() * 2.0**-4, scales.repeat_interleave(128, -1) * 2.0**-10)
    assert bool(((back - t).abs() <= half_step * (1 + 1e-6)).all())


def test_fp8_rows_cross_the_link_quantized_and_weight_gradients_requantize_them():
    """One expert, top-1, unit scores: the reference's ``y`` and ``dw2`` are exactly the
    spec written out (rows of x and dy quantized once, 1 x 128 along H, before the link;
    dw2's operands requantized along the tokens from the dy rows that arrived), and not
    what quantizing dw2's operands from the bf16 dy would give."""
    from titan_megamoe import reference
    from titan_megamoe.precision import get_precision

    g = torch.Generator().manual_seed(11)
    tokens, hidden, inter = 300, 256, 256
    x, dy = (torch.randn(tokens, hidden, generator=g).bfloat16() for _ in range(2))
    w1, w3 = (torch.randn(1, inter, hidden, generator=g).bfloat16() / 16 for _ in range(2))
    w2 = torch.randn(1, hidden, inter, generator=g).bfloat16() / 16
    idx = torch.zeros(tokens, 1, dtype=torch.int64)
    ones = torch.ones(tokens, 1)
    fp8 = get_precision("fp8")

    def q(t, is_weight=False):
        return quantize_operand(t, FP8_BLOCK, is_weight)

    x_arrived, dy_arrived = q(x), q(dy)
    a, b = x_arrived @ q(w1[0], True).T, x_arrived @ q(w3[0], True).T
    h = (torch.nn.functional.silu(a) * b).bfloat16()
    y_spec = (q(h) @ q(w2[0], True).T).bfloat16()
    dw2_spec = q(dy_arrived.T.contiguous()) @ q(h.T.contiguous()).T
    dw2_from_bf16 = q(dy.T.contiguous()) @ q(h.T.contiguous()).T

    y, _ = reference.moe_forward(x, idx, ones, w1, w2, w3, None, False, fp8)
    _, _, _, dw2, _ = reference.moe_backward(dy, x, idx, ones, w1, w2, w3, None, False, fp8)
    assert torch.equal(y, y_spec)
    assert torch.equal(dw2[0], dw2_spec.bfloat16())
    assert rel_err(dw2_from_bf16, dw2_spec) > 1e-2  # the two choices are told apart


def test_saved_gemm1_reads_the_preactivations_in_the_activation_dtype():
    """With ``save_gemm1`` the fused forward keeps GEMM1's pre-activations in x's dtype;
    the reference backend rounds its recomputed ones the same way, so that the two
    backends' backwards agree (quantized, that rounding moves ``[da | db]`` across e4m3
    rounding boundaries)."""
    from titan_megamoe import reference
    from titan_megamoe.precision import get_precision

    x, idx, w = make_problem(37, "random", seed=0)
    x, weights = x.bfloat16(), [t.bfloat16() for t in make_weights()]
    dy = torch.randn_like(x)
    fp8_bwd = get_precision("fp8_bwd")
    recomputed = reference.moe_backward(dy, x, idx, w, *weights, None, False, fp8_bwd)
    saved = reference.moe_backward(dy, x, idx, w, *weights, None, False, fp8_bwd, saved_gemm1=True)
    assert 0 < rel_err(saved[0], recomputed[0]) < 5e-2

    leaves = [t.clone().requires_grad_(True) for t in (x, *weights)]
    settings = OperatorSettings(backend="reference", precision="fp8_bwd", save_gemm1=True)
    y, _ = mega_moe(leaves[0], idx, w, *leaves[1:], None, score_before_experts=False, settings=settings)
    y.backward(dy)
    for got, want in zip([t.grad for t in leaves], saved[:1] + saved[2:]):
        assert torch.equal(got, want)


def test_backward_is_handed_no_zero_gradients_of_the_saved_preactivations():
    """The forward's saved pre-activations and token counts are outputs of the op but no
    gradient flows into them: autograd must not materialize zeros of their shape for the
    backward (at 235B-A22B and 16,384 tokens, 0.86 GiB per layer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.filled = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name().startswith(("aten::zeros", "aten::full", "aten::fill", "aten::zero_")):
                self.filled.append(func.name())
            return func(*args, **(kwargs or {}))

    x, idx, w = make_problem(37, "random", seed=0)
    leaves = [t.clone().requires_grad_(True) for t in (x, *make_weights())]
    settings = OperatorSettings(backend="reference", save_gemm1=True)
    y, _ = mega_moe(leaves[0], idx, w, *leaves[1:], None, score_before_experts=False, settings=settings)
    with Allocations() as seen:
        y.backward(torch.randn_like(y))
    assert seen.filled == []
    assert all(t.grad is not None for t in leaves)


def test_round_to_e4m3_is_the_nearest_e4m3_ties_to_even():
    """The spec rounds to e4m3 itself (its cast is then exact on every device): every
    e4m3 value stays put, values between two neighbours go to the nearer, midpoints to the
    one with an even mantissa, subnormals included."""
    from titan_megamoe.reference import round_to_e4m3

    codes = torch.arange(0, 127, dtype=torch.uint8)  # +0 .. 448, in order
    values = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(round_to_e4m3(values), values)
    assert torch.equal(round_to_e4m3(-values), -values)
    lo, hi = values[:-1], values[1:]
    mid = (lo + hi) / 2
    even = torch.where(codes[:-1] % 2 == 0, lo, hi)
    assert torch.equal(round_to_e4m3(mid), even)
    assert torch.equal(round_to_e4m3(torch.nextafter(mid, hi)), hi)
    assert torch.equal(round_to_e4m3(torch.nextafter(mid, lo)), lo)

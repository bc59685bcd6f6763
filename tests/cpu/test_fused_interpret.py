"""The fused forward's and backward's Triton kernels at tiny shapes under the Triton
interpreter (one rank, CPU): output and every gradient against the reference backend,
both score modes, GEMM1 recomputed and saved, poisoned buffers, uneven and skewed
routing, determinism, the capacity check and a timed-out wait; and the symmetric
buffers' one-node check (gloo ranks).

The interpreter must be switched on before Triton kernels are defined, so each check
runs in a fresh process (``run_ranks``) started with ``TRITON_INTERPRET=1``.
"""

import pytest
import torch

from problems import assert_compiles_like_eager, poison_fused_buffers
from ranks import run_ranks

HIDDEN, INTER, EXPERTS, TOP_K = 32, 48, 8, 3


def _problem(num_tokens: int, routing: str, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    scores = torch.rand(num_tokens, EXPERTS, generator=g)
    if routing == "skewed":  # experts 5-7 get no rows, 0-2 most of them
        scores[:, :3] += 2.0
        scores[:, 5:] -= 2.0
    idx = scores.topk(TOP_K, dim=1).indices
    w = torch.softmax(torch.randn(num_tokens, TOP_K, generator=g), dim=1)
    w1 = (torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
    w3 = (torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5).to(dtype)
    return x, idx, w, w1, w2, w3


GRADIENTS = ("dx", "d_topk_w", "dw1", "dw2", "dw3")


def _check_against_reference(rank, world, dtype, tolerance):
    from titan_megamoe import fused, reference

    cases = [(37, "random", False, False), (37, "random", True, True),
             (20, "skewed", False, True), (20, "skewed", True, False), (1, "random", False, False)]
    for num_tokens, routing, score_before, save in cases:
        x, idx, w, w1, w2, w3 = _problem(num_tokens, routing, seed=num_tokens, dtype=dtype)
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(99)).to(dtype)
        case = (num_tokens, routing, score_before, save)

        def fused_call():
            poison_fused_buffers()
            y, counts, preact = fused.moe_forward(x, idx, w, w1, w2, w3, None, score_before, "bf16", 40, 0, save)
            assert preact.shape[0] == (fused.saved_preact_shape(x, idx, w1, None, 40, True)[0] if save else 0)
            grads = fused.moe_backward(dy, x, idx, w, w1, w2, w3, preact, None, score_before, "bf16", 40, 0)
            return y, counts, grads

        y, counts, grads = fused_call()
        # The fp32 reference on the same (rounded) inputs.
        f32 = [t.float() for t in (x, w1, w2, w3)]
        y_ref, counts_ref = reference.moe_forward(f32[0], idx, w, *f32[1:], None, score_before, "bf16")
        grads_ref = reference.moe_backward(dy.float(), f32[0], idx, w, *f32[1:], None, score_before, "bf16")
        assert torch.equal(counts, counts_ref)
        for name, got, expected in zip(("y",) + GRADIENTS, (y,) + grads, (y_ref,) + grads_ref):
            assert got.dtype == (torch.float32 if name == "d_topk_w" else dtype), (case, name)
            assert torch.isfinite(got).all(), (case, name)
            err = reference.relative_error(got, expected)
            assert err < tolerance, (case, name, err)
        y_again, _, grads_again = fused_call()
        for name, got, again in zip(("y",) + GRADIENTS, (y,) + grads, (y_again,) + grads_again):
            assert torch.equal(got, again), (case, name, "not deterministic")

    _check_input_reuse(dtype, tolerance)
    (buffers,) = fused._BUFFERS.values()
    (grad,) = fused._GRAD_BUFFERS.values()
    assert fused.symmetric_bytes(capacity_tokens=40, hidden=HIDDEN) == buffers.symmetric_bytes + grad.symmetric_bytes
    assert fused.symmetric_bytes(capacity_tokens=41) == 0
    bm = buffers.tiles.block_m
    base, rows = buffers.local_base.tolist(), buffers.local_rows.tolist()
    assert all(b % bm == 0 for b in base)
    assert all(b1 - b0 == -(-r // bm) * bm for b0, b1, r in zip(base, base[1:], rows))


def _check_input_reuse(dtype, tolerance):
    """The backward reuses the received expert inputs only when its forward was the last
    call on the buffers: two forwards then two backwards resend them (and match the
    reference); a backward right after its forward does not (poisoned rows show)."""
    from titan_megamoe import fused, reference

    problems = [_problem(37, "random", seed=1, dtype=dtype), _problem(20, "skewed", seed=2, dtype=dtype)]
    dys = [torch.randn(p[0].shape, generator=torch.Generator().manual_seed(i)).to(dtype) for i, p in enumerate(problems)]
    poison_fused_buffers()
    saved = [fused.moe_forward(*p, None, False, "bf16", 40, 0, False)[2] for p in problems]
    for p, dy, preact in zip(problems, dys, saved):
        grads = fused.moe_backward(dy, *p, preact, None, False, "bf16", 40, 0)
        f32 = [t.float() for t in (p[0], *p[3:])]
        expected = reference.moe_backward(dy.float(), f32[0], p[1], p[2], *f32[1:], None, False, "bf16")
        for name, got, want in zip(GRADIENTS, grads, expected):
            assert reference.relative_error(got, want) < tolerance, ("interleaved", name)

    p, dy = problems[0], dys[0]
    preact = fused.moe_forward(*p, None, False, "bf16", 40, 0, False)[2]
    poison_fused_buffers()
    grads = fused.moe_backward(dy, *p, preact, None, False, "bf16", 40, 0)
    assert not torch.isfinite(grads[2]).all(), "the inputs were sent again"


@pytest.mark.parametrize(
    "dtype, tolerance",
    # The interpreter rounds fp32 -> bf16 by truncation, hence the looser bf16 bound here;
    # the GPU tests hold bf16 to 1e-2 against fp32 and to ~1e-3 against the reference.
    [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)],
)
def test_forward_and_backward_match_reference(dtype, tolerance, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_check_against_reference, 1, dtype, tolerance, timeout_s=600)


def _check_training_path(rank, world):
    """The op with backend fused under autograd, against the reference backend."""
    from titan_megamoe.ops import mega_moe

    x, idx, w, w1, w2, w3 = _problem(23, "random", seed=5)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    results = {}
    for backend, save_gemm1 in (("reference", False), ("fused", False), ("fused", True)):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, w1, w2, w3)]
        y, _ = mega_moe(leaves[0], idx, leaves[1], *leaves[2:], None, score_before_experts=False,
                        precision="bf16", backend=backend, save_gemm1=save_gemm1)
        y.backward(dy)
        results[backend, save_gemm1] = [y.detach()] + [t.grad for t in leaves]
    for key in (("fused", False), ("fused", True)):
        for got, expected in zip(results[key], results["reference", False]):
            assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), key


def test_fused_backend_trains_through_the_op(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_check_training_path, 1, timeout_s=300)


def _two_rank_buffers(shape):
    """Buffers for rank 0 of 2 ranks in one process: rank 1's copies exist but rank 1
    never runs, as if it had died."""
    from titan_megamoe.kernels.forward import ForwardBuffers

    def two_copies(size, dtype):
        mine, theirs = torch.zeros(size, dtype=dtype), torch.zeros(size, dtype=dtype)
        two_copies.keep.append(theirs)
        return mine, torch.tensor([mine.data_ptr(), theirs.data_ptr()], dtype=torch.int64)

    two_copies.keep = []
    buffers = ForwardBuffers(shape, torch.device("cpu"), two_copies)
    buffers.peer_copies = two_copies.keep
    buffers.allocator = two_copies
    return buffers


def _check_timeout_and_capacity(rank, world):
    from titan_megamoe.kernels.backward import GradBuffers, fused_backward
    from titan_megamoe.kernels.forward import ForwardShape, fused_forward

    x, idx, w, w1, w2, w3 = _problem(9, "random", seed=3)
    shape = ForwardShape(ep=2, rank=0, capacity_tokens=9, top_k=TOP_K, local_experts=EXPERTS // 2,
                         hidden=HIDDEN, inter=INTER, dtype=x.dtype)
    buffers = _two_rank_buffers(shape)
    local = slice(0, EXPERTS // 2)
    args = (x, idx, w, w1[local], w2[local], w3[local], buffers, False, 1, 3)
    fused_forward(*args, max_spins=10)  # finishes: every wait gives up
    with pytest.raises(RuntimeError, match=r"rank 0 timed out waiting for COUNT_READY\[1\] \(value 0, expected 1\)"):
        fused_forward(*args, max_spins=10)
    with pytest.raises(RuntimeError, match=r"rank 0 timed out waiting for COUNT_READY\[1\]"):
        fused_backward(x, *args[:6], None, buffers, GradBuffers(buffers, buffers.allocator), False, 1, 3, max_spins=10)

    fresh = _two_rank_buffers(shape)
    too_many = torch.cat([x, x[:1]]), torch.cat([idx, idx[:1]]), torch.cat([w, w[:1]])
    with pytest.raises(ValueError, match="10 tokens exceed the capacity of 9 tokens per rank"):
        fused_forward(*too_many, *args[3:6], fresh, False, 1, 3, max_spins=10)


def test_dead_peer_times_out_and_capacity_is_checked(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_check_timeout_and_capacity, 1, timeout_s=300)


def _symmetric_buffers_need_one_node(rank, world):
    import socket

    import torch.distributed as dist

    from titan_megamoe import symm

    socket.gethostname = lambda: "node-a"
    with pytest.raises(ValueError, match="symmetric buffers over 2 ranks need CUDA devices"):
        symm.allocator(dist.group.WORLD, torch.device("cpu"))
    socket.gethostname = lambda: f"node-{rank}"
    with pytest.raises(RuntimeError, match=r"EP group spans hosts \['node-0', 'node-1'\]"):
        symm.allocator(dist.group.WORLD, torch.device("cpu"))


def test_symmetric_buffers_need_one_node():
    run_ranks(_symmetric_buffers_need_one_node, 2, timeout_s=300)


def _fused_under_activation_checkpointing(rank, world, mode):
    """A converted debug model trains the same on the fused backend as on the reference
    one under TorchTitan's full and selective AC. Full AC recomputes each layer's forward
    right before its backward (the backward reuses the received inputs); selective AC
    saves the operator's outputs, so the second layer's backward resends them."""
    import dataclasses

    import torchtitan.models.qwen3.infra.parallelize as qwen3
    from test_converter import debug_model, parse
    from torchtitan.distributed.activation_checkpoint import apply_ac

    from titan_megamoe.converter import MegaMoEConverter
    from titan_megamoe.reference import relative_error

    job = parse(f"--activation_checkpoint.mode={mode}", "--activation_checkpoint.selective_ac_option=op",
                "--mega_moe.backend=fused", "--mega_moe.capacity_tokens_per_rank=32")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = {}
    for backend in ("fused", "reference"):
        model = debug_model("qwen3", dim=64, n_heads=4, n_kv_heads=2, head_dim=16, moe_inter_dim=32,
                            vocab_size=256, moe={"num_experts": 8, "top_k": 2})
        converter = MegaMoEConverter(job, None)
        converter.settings = dataclasses.replace(converter.settings, backend=backend)
        converter.convert(model)
        apply_ac(model, job.activation_checkpoint, op_sac_save_list=qwen3._op_sac_save_list)
        model(tokens).square().mean().backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
    for name, expected in grads["reference"].items():
        assert relative_error(grads["fused"][name], expected) < 1e-4, name


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_fused_backend_under_activation_checkpointing(mode, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_fused_under_activation_checkpointing, 1, mode, timeout_s=600)


def _compiles_fullgraph(rank, world):
    """The fused backend's op, with its saved pre-activations, traces without graph
    breaks and computes what it computes eagerly."""
    assert_compiles_like_eager("fused", *_problem(23, "random", seed=4), capacity_tokens=40, save_gemm1=True)


def test_fused_backend_compiles_fullgraph(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_compiles_fullgraph, 1, timeout_s=600)

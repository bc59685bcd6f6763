"""Shared by the operator tests: problem generators, the float64 formula, comparisons."""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_megamoe.ops import mega_moe
from titan_megamoe.reference import relative_error
from titan_megamoe.settings import OperatorSettings

HIDDEN, INTER, EXPERTS, TOP_K = 64, 48, 8, 3


def naive_moe(x, idx, w, w1, w2, w3, score_before):
    """y[t] = sum_j w W2 (silu(W1 x) * W3 x) slot by slot, in whatever dtype it is given."""
    xin = x.unsqueeze(1).expand(-1, idx.shape[1], -1)
    if score_before:
        xin = xin * w.unsqueeze(2)
    a = torch.einsum("tkih,tkh->tki", w1[idx], xin)
    b = torch.einsum("tkih,tkh->tki", w3[idx], xin)
    out = torch.einsum("tkhi,tki->tkh", w2[idx], F.silu(a) * b)
    if not score_before:
        out = out * w.unsqueeze(2)
    return out.sum(1)


def make_routing(kind: str, num_tokens: int, generator) -> torch.Tensor:
    """[T, k] expert ids with distinct experts per token, for a routing scenario."""
    if kind == "random":
        scores = torch.rand(num_tokens, EXPERTS, generator=generator)
    elif kind == "skewed":  # experts 0-2 take almost everything, 5-7 get nothing
        scores = torch.rand(num_tokens, EXPERTS, generator=generator)
        scores[:, :3] += 2.0
        scores[:, 5:] -= 2.0
    elif kind == "first_rank_only":  # every slot lands on the first half of the experts
        scores = torch.rand(num_tokens, EXPERTS, generator=generator)
        scores[:, EXPERTS // 2 :] -= 2.0
    else:
        raise ValueError(kind)
    return scores.topk(TOP_K, dim=1).indices


def make_problem(num_tokens: int, routing: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    idx = make_routing(routing, num_tokens, g)
    w = torch.softmax(torch.randn(num_tokens, TOP_K, generator=g), dim=1)
    return x, idx, w


def make_weights(seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    w3 = torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5
    return w1, w2, w3


def expert_weight_shards(seed: int, rank: int, world: int, experts: int, hidden: int, inter: int):
    """``(w1, w2, w3)`` in bf16 on the GPU: rank ``rank``'s shard of ``experts`` experts split
    over ``world`` ranks. Every rank draws the same full weights from ``seed`` and keeps
    its own; on the GPU, where a real layer's hundreds of millions of values take
    milliseconds (seconds on a CPU)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    local = experts // world
    shard = slice(rank * local, (rank + 1) * local)
    return tuple((torch.randn(experts, *shape, generator=g, device="cuda") / shape[1] ** 0.5)[shard].bfloat16()
                 for shape in ((inter, hidden), (hidden, inter), (inter, hidden)))


def rel_err(a, b):
    """``relative_error``, with NaN/Inf in the result failing loudly."""
    assert torch.isfinite(a).all(), "NaN/Inf in result"
    return relative_error(a, b)


def gradient_errors(got: dict, truth: dict) -> dict:
    """Relative error of each named gradient against ``truth``'s; for expert weights
    ``[E, ...]`` (a name with "experts"), the worst expert's."""
    return {name: max(relative_error(g, t) for g, t in zip(got[name], truth[name])) if "experts" in name
            else relative_error(got[name], truth[name]) for name in truth}


def qwen3_debug_model(n_layers: int, seq: int, state: dict | None, device: str):
    """TorchTitan's qwen3 ``debugmodel_moe`` with ``n_layers`` layers on ``device``, its
    weights initialised from seed 0, or loaded from ``state``."""
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    args = dataclasses.replace(qwen3_args["debugmodel_moe"], n_layers=n_layers, max_seq_len=seq)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3Model(args)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device(device))
    if state is not None:
        model.load_state_dict(state)
    return model


def run_op(x, idx, w, w1, w2, w3, group, score_before, precision, dy):
    """Forward + backward through the custom op (reference backend, ``precision`` by
    name); returns y and all gradients."""
    leaves = [t.clone().requires_grad_(True) for t in (x, w, w1, w2, w3)]
    xl, wl, w1l, w2l, w3l = leaves
    y, counts = mega_moe(
        xl, idx, wl, w1l, w2l, w3l, group,
        score_before_experts=score_before, settings=OperatorSettings(precision=precision, backend="reference"),
    )
    y.backward(dy)
    return y.detach(), counts, [t.grad for t in leaves]


def run_naive(x, idx, w, w1, w2, w3, score_before, dy):
    leaves = [t.double().requires_grad_(True) for t in (x, w, w1, w2, w3)]
    xl, wl, w1l, w2l, w3l = leaves
    y = naive_moe(xl, idx, wl, w1l, w2l, w3l, score_before)
    y.backward(dy.double())
    return y.detach(), [t.grad for t in leaves]


NAMES = ("dx", "d_topk_w", "dw1", "dw2", "dw3")


TOKENS_PER_RANK = {"random": (29, 41), "skewed": (64, 3), "first_rank_only": (17, 1)}


def check_ep_rank(rank, world_size, routing, score_before, precision, tolerance,
                  device="cpu", dtype=torch.float32):
    """One rank of an EP run: its outputs and gradients against the formula over all
    experts. Inputs are rounded to ``dtype`` first, so the formula sees what the op saw."""
    group = dist.group.WORLD
    local = EXPERTS // world_size
    tokens_per_rank = TOKENS_PER_RANK[routing][:world_size]
    w1, w2, w3 = (t.to(dtype).double() for t in make_weights())
    problems = [make_problem(n, routing, seed=100 + r) for r, n in enumerate(tokens_per_rank)]
    problems = [(x.to(dtype).double(), idx, w) for x, idx, w in problems]
    dys = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(200 + r)).to(dtype).double()
           for r, n in enumerate(tokens_per_rank)]
    x, idx, w = problems[rank]
    shard = slice(rank * local, (rank + 1) * local)

    def on_device(t):
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    y, counts, grads = run_op(
        on_device(x), on_device(idx), w.to(device), on_device(w1[shard]), on_device(w2[shard]),
        on_device(w3[shard]), group, score_before, precision, on_device(dys[rank]),
    )
    y, counts, grads = y.cpu(), counts.cpu(), [g.cpu() for g in grads]
    # The formula over every rank's tokens: weight gradients sum over all of them.
    all_x, all_idx, all_w = (torch.cat(parts) for parts in zip(*problems))
    y_ref, grads_ref = run_naive(all_x, all_idx, all_w, w1, w2, w3, score_before, torch.cat(dys))
    mine = slice(sum(tokens_per_rank[:rank]), sum(tokens_per_rank[: rank + 1]))
    assert rel_err(y, y_ref[mine]) < tolerance
    expected = [grads_ref[0][mine], grads_ref[1][mine]] + [g[shard] for g in grads_ref[2:]]
    for name, g, g_ref in zip(NAMES, grads, expected):
        if g_ref.abs().max() == 0:  # a rank whose experts got no rows
            assert torch.equal(g.double(), torch.zeros_like(g_ref)), name
        else:
            assert rel_err(g, g_ref) < tolerance, name
    assert torch.equal(counts, torch.bincount(all_idx.flatten(), minlength=EXPERTS)[shard])


def poison_fused_buffers() -> None:
    """NaN in every buffer the fused backend keeps between calls, so that rows a kernel
    fails to write show up in its results."""
    from titan_megamoe import fused

    for buffers in fused._BUFFERS.values():
        for t in (buffers.recv, buffers.recv_scales, buffers.combine, buffers.h, buffers.h_scales):
            if t is not None:
                t.fill_(float("nan"))
    for grad in fused._GRAD_BUFFERS.values():
        for t in (grad.recv_grad, grad.recv_grad_scales, grad.recv_score, grad.score_grad):
            if t is not None:
                t.fill_(float("nan"))


def assert_compiles_like_eager(settings: OperatorSettings, x, idx, w, w1, w2, w3, backend: str = "aot_eager",
                               group=None) -> None:
    """``mega_moe`` with ``settings`` (over ``group``) traces under ``torch.compile(fullgraph=True)``
    with ``backend`` (fake implementations, autograd formula, the settings string; Inductor
    also lowers the graph around the operator) and gives, output and gradients, exactly
    what it gives eagerly."""

    def layer(x_, w_, w1_, w2_, w3_):
        return mega_moe(x_, idx, w_, w1_, w2_, w3_, group, score_before_experts=False, settings=settings)[0]

    results = []
    for fn in (layer, torch.compile(layer, backend=backend, fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, w1, w2, w3)]
        y = fn(*leaves)
        y.square().sum().backward()
        results.append([y.detach()] + [t.grad for t in leaves])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)

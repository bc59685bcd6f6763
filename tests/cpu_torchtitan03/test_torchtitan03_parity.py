"""Converted vs stock qwen3 ``debugmodel_moe`` on TorchTitan 0.3.0, built and parallelized
as its Trainer does (FSDP + EP 2) on two gloo ranks: outputs, loss, every gradient,
load-balance counts, state-dict layout and checkpoints in both directions."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from problems import rel_err
from ranks import run_ranks

TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-2
BATCH, SEQ, TOP_K = 2, 32, 8


def _parity_rank(rank, world_size, n_layers, param_dtype, tolerance, checkpoint_dir):
    from titan03_models import build, debug_moe_spec, full, trainer_config, VOCAB

    from titan_megamoe.torchtitan03 import MegaGroupedExperts, MegaMoEConverter

    # The stock side computes its experts in float32 where the comparison is at float32
    # tolerances, and as TorchTitan does (bf16 GEMMs) under bf16 mixed precision.
    stock_spec = debug_moe_spec(n_layers=n_layers, float32_experts=param_dtype == "float32")
    stock = build(stock_spec, trainer_config(stock_spec, param_dtype=param_dtype), world_size)
    state = {k: full(v).clone() for k, v in stock.state_dict().items()}
    spec = debug_moe_spec([MegaMoEConverter.Config(backend="reference")], n_layers=n_layers)
    converted = build(spec, trainer_config(spec, param_dtype=param_dtype), world_size, state)
    experts = [m for m in converted.modules() if isinstance(m, MegaGroupedExperts)]
    assert len(experts) == n_layers and all(m.plans.settings.backend == "reference" for m in experts)
    assert all(m.ep_group is not None and m.ep_group.size() == 2 for m in experts)

    # State dict: same keys, shapes and placements both ways.
    stock_sd, converted_sd = stock.state_dict(), converted.state_dict()
    assert list(stock_sd) == list(converted_sd), set(stock_sd) ^ set(converted_sd)
    assert any(key.endswith("routed_experts.inner_experts.w1_EFD") for key in converted_sd)
    for key in stock_sd:
        a, b = stock_sd[key], converted_sd[key]
        assert a.shape == b.shape, key
        assert type(a) is type(b), key
        if isinstance(a, DTensor):
            assert a.placements == b.placements, key
            assert a.device_mesh.mesh_dim_names == b.device_mesh.mesh_dim_names, key

    # Forward, loss and every gradient; each rank has its own batch.
    g = torch.Generator().manual_seed(10 + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    results = {}
    for name, model in (("stock", stock), ("converted", converted)):
        logits = full(model(tokens))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        results[name] = (logits.detach(), loss.detach())
    assert rel_err(results["converted"][0], results["stock"][0]) < tolerance
    assert rel_err(results["converted"][1], results["stock"][1]) < tolerance

    stock_params = dict(stock.named_parameters())
    checked = 0
    for name, p in converted.named_parameters():
        g_conv, g_stock = full(p.grad), full(stock_params[name].grad)
        assert g_stock.abs().max() > 0, f"{name} got no gradient in the stock model"
        assert rel_err(g_conv, g_stock) < tolerance, name
        checked += "routed_experts" in name or "router" in name
    assert checked == n_layers * 4  # w1, w2, w3 and the router gate of each layer

    stock_buffers = dict(stock.named_buffers())
    counts = 0
    for name, b in converted.named_buffers():
        if name.endswith("tokens_per_expert_E"):
            assert full(b).sum() == BATCH * SEQ * TOP_K  # every routed slot of this rank counted once
            assert torch.equal(full(b), full(stock_buffers[name])), name
            counts += 1
    assert counts == n_layers

    # Checkpoints: stock -> converted, then converted -> stock. The fused QKV projection's
    # state-dict entries are copies, so the loaded state dict goes back into the model.
    originals = {k: full(v).clone() for k, v in stock.state_dict().items()}
    dcp.save(stock.state_dict(), checkpoint_id=f"{checkpoint_dir}/stock")
    with torch.no_grad():
        for p in converted.parameters():
            p.add_(1.0)
    converted_sd = converted.state_dict()
    dcp.load(converted_sd, checkpoint_id=f"{checkpoint_dir}/stock")
    converted.load_state_dict(converted_sd)
    for key, value in converted.state_dict().items():
        assert torch.equal(full(value), originals[key]), key

    with torch.no_grad():
        for p in converted.parameters():
            p.mul_(0.5)
    dcp.save(converted.state_dict(), checkpoint_id=f"{checkpoint_dir}/converted")
    stock_sd = stock.state_dict()
    dcp.load(stock_sd, checkpoint_id=f"{checkpoint_dir}/converted")
    stock.load_state_dict(stock_sd)
    converted_now = {k: full(v) for k, v in converted.state_dict().items()}
    for key, value in stock.state_dict().items():
        assert torch.equal(full(value), converted_now[key]), key


@pytest.mark.parametrize(
    "n_layers, param_dtype, tolerance",
    [
        (2, "float32", TOLERANCE),
        # FSDP2 mixed precision: bf16 expert GEMMs on both sides (measured 0.9% apart). One
        # layer: past it, bf16 rounding of the first layer's output flips near-tied top-k
        # choices of the next router, and the two sides route some tokens differently.
        (1, "bfloat16", BF16_TOLERANCE),
    ],
)
def test_converted_matches_stock_fsdp_ep(n_layers, param_dtype, tolerance, tmp_path):
    run_ranks(_parity_rank, 2, n_layers, param_dtype, tolerance, str(tmp_path), timeout_s=600)

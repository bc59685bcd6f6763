"""Converted vs stock qwen3 ``debugmodel_moe``, parallelized by TorchTitan's own
``parallelize_qwen3`` on two gloo ranks: outputs, loss, every gradient, load-balance
counts, state-dict layout and checkpoints in both directions."""

import dataclasses

import pytest
import torch

from parity_checks import (
    assert_checkpoints_load_both_ways,
    assert_same_state_dict_layout,
    assert_training_step_matches,
    full,
)
from problems import rel_err
from ranks import run_ranks

TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-2
BATCH, SEQ = 2, 32


def job_config(layout: str, converters: list[str], param_dtype: str = "float32", backend: str = "reference"):
    from torchtitan.config import ConfigManager

    degrees = {"fsdp_ep": ("2", "1"), "tp_ep": ("1", "2")}[layout]  # (fsdp, tp)
    return ConfigManager().parse_args(
        [
            "--job.custom_config_module=titan_megamoe.config",
            "--model.name=qwen3",
            "--model.flavor=debugmodel_moe",
            f"--training.seq_len={SEQ}",
            f"--training.mixed_precision_param={param_dtype}",
            "--activation_checkpoint.mode=none",
            "--parallelism.expert_parallel_degree=2",
            f"--parallelism.data_parallel_shard_degree={degrees[0]}",
            f"--parallelism.tensor_parallel_degree={degrees[1]}",
            "--parallelism.disable_loss_parallel",
            f"--mega_moe.backend={backend}",
        ]
        + (["--model.converters", *converters] if converters else [])
    )


def model_args(score_before: bool):
    from torchtitan.models.qwen3 import qwen3_args

    base = qwen3_args["debugmodel_moe"]
    # The stock grouped-MM path computes in bf16 whatever the dtype; its for-loop path
    # computes in fp32, which a 1e-5 comparison needs.
    moe_args = dataclasses.replace(
        base.moe_args, use_grouped_mm=False, score_before_experts=score_before
    )
    return dataclasses.replace(base, n_layers=2, moe_args=moe_args, max_seq_len=SEQ)


def build(layout: str, score_before: bool, convert: bool, state: dict | None, param_dtype="float32",
          backend="reference"):
    """A parallelized model; returns (model, its job config)."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3 import parallelize_qwen3, Qwen3Model

    import cpu_compat
    from titan_megamoe.converter import MegaMoEConverter

    job = job_config(layout, ["mega_moe"] if convert else [], param_dtype, backend)
    p = job.parallelism
    dims = ParallelDims(
        dp_replicate=1, dp_shard=p.data_parallel_shard_degree, cp=1,
        tp=p.tensor_parallel_degree, pp=1, ep=2, etp=1, world_size=2,
    )
    dims.build_mesh()
    torch.manual_seed(0)
    model = Qwen3Model(model_args(score_before))
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    if state is not None:
        model.load_state_dict(state)
    if convert:
        MegaMoEConverter(job, dims).convert(model)
    parallelize_qwen3(model, dims, job)
    cpu_compat.force_sum_reduction(model)
    return model


def _parity_rank(rank, world_size, layout, score_before, param_dtype, tolerance, checkpoint_dir, backend):
    from titan_megamoe.layer import MegaMoE

    stock = build(layout, score_before, convert=False, state=None, param_dtype=param_dtype)
    state = {k: full(v).clone() for k, v in stock.state_dict().items()}
    converted = build(layout, score_before, convert=True, state=state, param_dtype=param_dtype, backend=backend)
    layers = [m for m in converted.modules() if isinstance(m, MegaMoE)]
    assert len(layers) == 2 and all(m.experts.settings.backend == backend for m in layers)

    assert_same_state_dict_layout(stock, converted)

    # With TP the ranks of a TP group see the same batch; with FSDP each rank has its own.
    data_rank = rank if layout == "fsdp_ep" else 0
    g = torch.Generator().manual_seed(10 + data_rank)
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, 2048, (BATCH, SEQ), generator=g)
    compared = assert_training_step_matches(stock, converted, tokens, labels, tolerance)
    # w1, w2, w3 and the router gate of both layers
    assert sum("experts" in name or "router" in name for name in compared) == 2 * 4

    stock_buffers = dict(stock.named_buffers())
    for name, b in converted.named_buffers():
        if name.endswith("tokens_per_expert"):
            assert b.sum() == BATCH * SEQ * 8  # every routed slot (top-8) counted once
            assert torch.equal(b, stock_buffers[name]), name

    assert_checkpoints_load_both_ways(stock, converted, checkpoint_dir)


@pytest.mark.parametrize(
    "backend, score_before, param_dtype, tolerance",
    [
        ("reference", False, "float32", TOLERANCE),
        ("reference", True, "float32", TOLERANCE),
        # FSDP2 mixed precision: bf16 compute, fp32 router scores (as stock keeps them).
        ("reference", False, "bfloat16", BF16_TOLERANCE),
        ("stock", False, "float32", TOLERANCE),
    ],
)
def test_converted_matches_stock_fsdp_ep(backend, score_before, param_dtype, tolerance, tmp_path):
    run_ranks(_parity_rank, 2, "fsdp_ep", score_before, param_dtype, tolerance, str(tmp_path), backend,
              timeout_s=600)


# --------------------------------------------------------------------------------------
# TP on the dense parts with EP borrowing the TP ranks: TorchTitan's apply_moe_ep_tp
# all-gathers the layer input over TP, splits the routed tokens across the TP ranks
# (ReordererSequenceParallel on moe.reorderer) and reduce-scatters the output. Tested on
# the MoE layer alone: DTensor cannot shard CPU attention, so the whole model cannot run
# TP on gloo.
# --------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    moe_enabled = True

    def __init__(self, moe):
        super().__init__()
        self.moe = moe


class _Blocks(torch.nn.Module):
    """The part of a TorchTitan model that apply_moe_ep_tp walks."""

    def __init__(self, moe):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": _Block(moe)})


def _tp_layer_rank(rank, world_size, score_before, backend):
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp
    from torchtitan.models.moe import MoE

    from titan_megamoe.converter import MegaMoEConverter

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=2, etp=1, world_size=2)
    dims.build_mesh()
    args = dataclasses.replace(
        model_args(score_before).moe_args, num_experts=8, top_k=3, num_shared_experts=1
    )
    layers = {}
    for name, convert in (("stock", False), ("converted", True)):
        torch.manual_seed(0)
        moe = MoE(args, dim=64, hidden_dim=32)
        with torch.no_grad():
            moe.init_weights(init_std=0.02, buffer_device=torch.device("cpu"))
        blocks = _Blocks(moe)
        if convert:
            MegaMoEConverter(job_config("tp_ep", ["mega_moe"], backend=backend), dims).convert(blocks)
        apply_moe_ep_tp(
            blocks, tp_mesh=dims.get_mesh("tp"), ep_mesh=dims.get_mesh("ep"),
            etp_mesh=None, ep_etp_mesh=None,
        )
        layers[name] = blocks.layers["0"].moe

    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(6))
    local = slice(rank * 8, (rank + 1) * 8)  # this rank's sequence shard
    outputs = {}
    for name, moe in layers.items():
        x_local = x[:, local].clone().requires_grad_(True)
        y = moe(x_local)  # this rank's sequence shard of the output
        y.backward(dy[:, local])
        outputs[name] = (y.detach(), x_local.grad)
    for a, b in zip(outputs["converted"], outputs["stock"]):
        assert rel_err(a, b) < TOLERANCE
    stock_params = dict(layers["stock"].named_parameters())
    for name, p in layers["converted"].named_parameters():
        assert rel_err(full(p.grad), full(stock_params[name].grad)) < TOLERANCE, name


@pytest.mark.parametrize("backend, score_before", [("reference", False), ("reference", True), ("stock", False)])
def test_converted_layer_matches_stock_tp_ep(backend, score_before):
    run_ranks(_tp_layer_rank, 2, score_before, backend, timeout_s=300)

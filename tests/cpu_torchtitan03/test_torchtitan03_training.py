"""A TorchTitan 0.3.0 user's config with MegaMoEConverter trains: TorchTitan's own Trainer,
built from ``titan_megamoe.torchtitan03.config_registry``'s debug MoE config on two gloo
ranks (FSDP + EP 2), runs a few steps of qwen3 ``debugmodel_moe`` on the shipped
dataset, with the same loss at every step as the stock config."""

import json

import pytest
import torch

from ranks import run_ranks

STEPS = 3


def _train_rank(rank, world_size, variant, param_dtype, spmd_backend, out_path):
    from titan03_models import debug_moe_spec

    from titan_megamoe.torchtitan03 import config_registry, MegaMoEConverter

    # The Trainer's own distributed setup is skipped (the ranks run in an initialized
    # group); this part of it matters to activation checkpointing under spmd_types.
    torch.autograd.set_multithreading_enabled(False)
    config = config_registry.debug_moe_stock() if variant == "stock" else config_registry.debug_moe_mega_moe()
    converters = [MegaMoEConverter.Config(backend="reference")] if variant == "mega_moe" else []
    # float32 experts on the stock side where the comparison is at float32 tolerances.
    config.model_spec = debug_moe_spec(converters, float32_experts=variant == "stock" and param_dtype == "float32")
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    config.training.steps = STEPS
    config.training.mixed_precision_param = param_dtype
    config.parallelism.spmd_backend = spmd_backend
    config.dump_folder = f"{out_path}.dump"
    trainer = config.build()
    losses = []
    log = trainer.metrics_processor.log

    def recording_log(step, global_avg_loss, *args, **kwargs):
        losses.append(global_avg_loss)
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = recording_log
    try:
        trainer.train()
    finally:
        trainer.close()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(losses, f)


def _losses(tmp_path, variant, param_dtype, spmd_backend="partial_dtensor") -> list[float]:
    out = tmp_path / f"{variant}-{param_dtype}-{spmd_backend}.json"
    run_ranks(_train_rank, 2, variant, param_dtype, spmd_backend, str(out), timeout_s=600)
    losses = json.loads(out.read_text())
    assert len(losses) == STEPS and all(loss == loss for loss in losses)  # NaN never passes
    return losses


@pytest.mark.parametrize(
    "param_dtype, spmd_backends, tolerance",
    [
        # Both of TorchTitan's SPMD backends on the mega_moe side: the operator's own exchange
        # runs under either (stock's dispatch needs partial_dtensor on gloo).
        ("float32", ("partial_dtensor", "spmd_types"), 1e-5),
        # TorchTitan's default mixed precision; both sides run their expert GEMMs in bf16.
        ("bfloat16", ("partial_dtensor",), 1e-3),
    ],
)
def test_mega_moe_trains_with_the_loss_of_stock(param_dtype, spmd_backends, tolerance, tmp_path):
    stock = _losses(tmp_path, "stock", param_dtype)
    assert stock[-1] < stock[0]  # it trains
    for spmd_backend in spmd_backends:
        mega_moe = _losses(tmp_path, "mega_moe", param_dtype, spmd_backend)
        assert mega_moe == pytest.approx(stock, rel=tolerance), spmd_backend

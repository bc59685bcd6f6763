"""The shipped llama4 and deepseek_v3 TOMLs: each parses as its family's debug model
with the converter, and TorchTitan's own trainer runs one training step from it on two
gloo ranks (FSDP and EP = 2, as the TOML says), with the routed experts converted and run
by the reference backend."""

from pathlib import Path

import pytest

from ranks import run_ranks

REPO = Path(__file__).resolve().parents[2]
TOMLS = {
    # file: (model name, flavor, MoE layers)
    "llama4_debug_mega_moe.toml": ("llama4", "debugmodel", 3),  # every 2nd of 6 blocks
    "deepseek_v3_debug_mega_moe.toml": ("deepseek_v3", "debugmodel", 5),  # all but the first dense one
}


@pytest.mark.parametrize("name", sorted(TOMLS))
def test_toml_names_the_family_and_the_converter(name):
    from torchtitan.config import ConfigManager

    job = ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / name)])
    model, flavor, _ = TOMLS[name]
    assert (job.model.name, job.model.flavor, job.model.converters) == (model, flavor, ["mega_moe"])
    assert job.job.custom_config_module == "titan_megamoe.config"
    assert (job.mega_moe.precision, job.mega_moe.backend) == ("auto", "auto")
    assert job.parallelism.expert_parallel_degree == 2 and job.parallelism.data_parallel_shard_degree == -1
    assert (REPO / job.model.hf_assets_path).is_dir()


def _trainer_on_cpu() -> None:
    """Let TorchTitan 0.2.2's ``Trainer`` run on gloo ranks already set up: the package's
    registrations, what ``cpu_compat`` patches, a device-memory monitor that reports nothing (it asks CUDA for
    the device's name), the process group taken as it is (``run_ranks`` made it), no
    NCCL-only timeouts, and FSDP reducing gradients with SUM (gloo has no PREMUL_SUM)."""
    import dataclasses
    from types import SimpleNamespace

    import torch.distributed as dist
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.train as titan_train

    # What importing the package registers once TorchTitan is loaded: ``ranks`` imported
    # the package first.
    import titan_megamoe.registry  # noqa: F401
    import cpu_compat

    cpu_compat.apply()
    stats = SimpleNamespace(max_active_gib=0.0, max_active_pct=0.0, max_reserved_gib=0.0, max_reserved_pct=0.0,
                            num_alloc_retries=0, num_ooms=0)
    metrics.build_device_memory_monitor = lambda: SimpleNamespace(
        device_name="cpu", get_peak_stats=lambda: stats, reset_peak_stats=lambda: None)
    dist_utils.init_distributed = lambda *args, **kwargs: dist.get_world_size()
    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
    train_spec = titan_train.train_spec_module.get_train_spec

    def summing_spec(name: str):
        spec = train_spec(name)

        def parallelize(model, *args, **kwargs):
            model = spec.parallelize_fn(model, *args, **kwargs)
            cpu_compat.force_sum_reduction(model)
            return model

        return dataclasses.replace(spec, parallelize_fn=parallelize)

    titan_train.train_spec_module.get_train_spec = summing_spec


def _one_step(rank, world, name, tmp_dir):
    import math

    import torchtitan.train as titan_train
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.config import ConfigManager

    from titan_megamoe.layer import MegaMoE

    _trainer_on_cpu()
    job = ConfigManager().parse_args([
        "--job.config_file", str(REPO / "train_configs" / name), f"--job.dump_folder={tmp_dir}",
        "--training.steps=1", "--training.seq_len=32", "--training.local_batch_size=1",
        "--mega_moe.backend=reference",
    ])
    trainer = titan_train.Trainer(job)
    logged = []
    log = trainer.metrics_processor.log
    trainer.metrics_processor.log = lambda step, loss, max_loss, grad_norm, **kw: (
        logged.append((step, loss, grad_norm)), log(step, loss, max_loss, grad_norm, **kw))
    (model,) = trainer.model_parts
    layers = [m for m in model.modules() if isinstance(m, MegaMoE)]
    assert len(layers) == TOMLS[name][2], len(layers)
    for layer in layers:
        assert layer.experts.settings.backend == "reference"
        w1 = layer.experts.w1  # experts sharded over EP (by the converter's plan), then by FSDP
        assert isinstance(w1, DTensor) and w1.device_mesh.mesh_dim_names[-1] == "ep", w1.device_mesh
        assert w1.placements[-1] == Shard(0), w1.placements
    before = layers[0].experts.w1.to_local().detach().clone()
    trainer.train()
    ((step, loss, grad_norm),) = logged
    print(f"{name} rank {rank}: step {step}, loss {loss:.4f}, grad norm {grad_norm:.4f}", flush=True)
    assert step == 1 and math.isfinite(loss) and math.isfinite(grad_norm) and grad_norm > 0
    assert not layers[0].experts.w1.to_local().detach().equal(before), "the optimizer left the experts as they were"
    trainer.close()


@pytest.mark.parametrize("name", sorted(TOMLS))
def test_toml_trains_one_step_on_the_reference_backend(name, tmp_path):
    run_ranks(_one_step, 2, name, str(tmp_path), timeout_s=300)

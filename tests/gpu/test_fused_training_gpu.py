"""The fused backend inside TorchTitan's own parallelism on 2 GPUs: qwen3
``debugmodel_moe`` (2 layers) converted and parallelized by ``parallelize_qwen3`` with
FSDP2 + EP 2 (DTensor expert weights, bf16 mixed precision), two microbatches accumulated
per step, full and selective activation checkpointing. Every parameter's gradient and the
loss must match the same model on the reference backend."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ranks import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

BATCH, SEQ, MICROBATCHES = 2, 256, 2
TOLERANCE = 1e-2
"""bf16 on both sides, different summation orders."""


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _model(backend: str, ac_mode: str, state: dict | None):
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3, qwen3_args

    from titan_megamoe.converter import MegaMoEConverter

    job = ConfigManager().parse_args([
        "--job.custom_config_module=titan_megamoe.config",
        "--model.name=qwen3", "--model.flavor=debugmodel_moe", "--model.converters", "mega_moe",
        f"--training.seq_len={SEQ}", f"--training.local_batch_size={BATCH}",
        "--training.mixed_precision_param=bfloat16",
        f"--activation_checkpoint.mode={ac_mode}", "--activation_checkpoint.selective_ac_option=op",
        "--parallelism.expert_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2",
        f"--mega_moe.backend={backend}", "--mega_moe.save_gemm1",
    ])
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, etp=1, world_size=2)
    dims.build_mesh()
    args = dataclasses.replace(qwen3_args["debugmodel_moe"], n_layers=2, max_seq_len=SEQ)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3Model(args)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cuda"))
    if state is not None:
        model.load_state_dict(state)
    converter = MegaMoEConverter(job, dims)
    assert converter.settings.backend == backend
    converter.convert(model)
    parallelize_qwen3(model, dims, job)
    return model


def _train_step(rank, model):
    losses = []
    for micro in range(MICROBATCHES):
        g = torch.Generator().manual_seed(100 * rank + micro)
        tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=g).cuda()
        labels = torch.randint(0, 2048, (BATCH, SEQ), generator=g).cuda()
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / MICROBATCHES
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def _fused_matches_reference(rank, world, ac_mode):
    from titan_megamoe.reference import relative_error

    results = {}
    state = None
    for backend in ("reference", "fused"):
        model = _model(backend, ac_mode, state)
        if state is None:
            state = {k: full(v).clone() for k, v in model.state_dict().items()}
        losses = _train_step(rank, model)
        grads = {n: full(p.grad).float() for n, p in model.named_parameters()}
        results[backend] = (losses, grads)
    (ref_losses, ref_grads), (losses, grads) = results["reference"], results["fused"]
    assert relative_error(losses, ref_losses) < TOLERANCE, (losses, ref_losses)
    worst = max((relative_error(grads[n], g), n) for n, g in ref_grads.items())
    print(f"rank {rank} AC {ac_mode}: losses {losses.tolist()} vs {ref_losses.tolist()}; "
          f"{len(grads)} gradients, worst {worst[0]:.1e} ({worst[1]})", flush=True)
    for name, expected in ref_grads.items():
        assert expected.abs().max() > 0, f"{name} got no gradient"
        assert relative_error(grads[name], expected) < TOLERANCE, name


@pytest.mark.parametrize("ac_mode", ["full", "selective"])
def test_fused_trains_like_reference_under_fsdp_ep(ac_mode):
    run_ranks(_fused_matches_reference, 2, ac_mode, backend="nccl", timeout_s=600)

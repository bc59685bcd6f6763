"""The fused backend inside TorchTitan's own parallelism on 2 GPUs: qwen3
``debugmodel_moe`` (2 layers) converted and parallelized by ``parallelize_qwen3`` with
FSDP2 + EP 2 (DTensor expert weights, bf16 mixed precision), two microbatches accumulated
per step, full and selective activation checkpointing, experts in bf16 and in fp8. The
truth is the same model in fp32 on the reference backend (unquantized); against it, the
losses and every parameter's gradient (expert weights: every expert's own) on the fused
backend must be as close as the bf16 model on the reference backend in the same precision
is, within a factor of two (bf16 rounds the whole model, not only the experts: a norm
weight's gradient, summed over every token, is off by ~2e-2 in bf16 on either backend)."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from problems import gradient_errors, qwen3_debug_model
from ranks import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

BATCH, SEQ, MICROBATCHES = 2, 256, 2
TOLERANCE = 1e-2
"""Below this, an error against fp32 passes whatever the bf16 reference's."""
RUNS = {"fp32": ("reference", "float32", "bf16"), "reference": ("reference", "bfloat16", None),
        "fused": ("fused", "bfloat16", None)}
"""Run name -> (backend, parameter dtype, experts' precision; None: the test's)."""


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _model(backend: str, dtype: str, precision: str, ac_mode: str, state: dict | None):
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3 import parallelize_qwen3

    from titan_megamoe.converter import MegaMoEConverter

    job = ConfigManager().parse_args([
        "--job.custom_config_module=titan_megamoe.config",
        "--model.name=qwen3", "--model.flavor=debugmodel_moe", "--model.converters", "mega_moe",
        f"--training.seq_len={SEQ}", f"--training.local_batch_size={BATCH}",
        f"--training.mixed_precision_param={dtype}",
        f"--activation_checkpoint.mode={ac_mode}", "--activation_checkpoint.selective_ac_option=op",
        "--parallelism.expert_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2",
        f"--mega_moe.backend={backend}", f"--mega_moe.precision={precision}", "--mega_moe.save_gemm1",
    ])
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, etp=1, world_size=2)
    dims.build_mesh()
    model = qwen3_debug_model(2, SEQ, state, "cuda")
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


def _fused_matches_reference(rank, world, ac_mode, precision):
    from titan_megamoe.reference import relative_error

    results = {}
    state = None
    for run, (backend, dtype, run_precision) in RUNS.items():
        model = _model(backend, dtype, run_precision or precision, ac_mode, state)
        if state is None:
            state = {k: full(v).clone() for k, v in model.state_dict().items()}
        losses = _train_step(rank, model)
        grads = {n: full(p.grad).float() for n, p in model.named_parameters()}
        results[run] = (losses.float(), grads)
    (true_losses, truth), (ref_losses, ref_grads), (losses, grads) = (results[r] for r in RUNS)
    for name, expected in truth.items():
        assert expected.abs().max() > 0, f"{name} got no gradient"
    ref_errors, errors = gradient_errors(ref_grads, truth), gradient_errors(grads, truth)
    worst = max((errors[n] / max(TOLERANCE, 2 * ref_errors[n]), n) for n in truth)
    print(f"rank {rank} {precision} AC {ac_mode}: losses fused {losses.tolist()}, bf16 reference {ref_losses.tolist()}, "
          f"fp32 {true_losses.tolist()}; {len(grads)} gradients, worst against its bound {worst[0]:.2f} "
          f"({worst[1]}: fused {errors[worst[1]]:.1e}, bf16 reference {ref_errors[worst[1]]:.1e})", flush=True)
    loss_bound = max(TOLERANCE, 2 * relative_error(ref_losses, true_losses))
    assert relative_error(losses, true_losses) <= loss_bound, (losses, ref_losses, true_losses)
    for name in truth:
        assert errors[name] <= max(TOLERANCE, 2 * ref_errors[name]), (name, errors[name], ref_errors[name])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("ac_mode", ["full", "selective"])
def test_fused_trains_like_reference_under_fsdp_ep(ac_mode, precision):
    run_ranks(_fused_matches_reference, 2, ac_mode, precision, backend="nccl", timeout_s=600)

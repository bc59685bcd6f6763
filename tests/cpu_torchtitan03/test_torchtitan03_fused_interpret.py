"""The fused backend behind TorchTitan 0.3.0's converter, under the Triton interpreter (one
rank, CPU): a converted qwen3 ``debugmodel_moe`` layer (8 experts of 32, top-2) computes the reference backend's
output and gradients under TorchTitan's full and selective activation checkpointing.

The interpreter must be switched on before Triton kernels are defined, so each check runs
in a fresh process (``run_ranks``) started with ``TRITON_INTERPRET=1``.
"""

import pytest
import torch

from ranks import run_ranks


def _fused_matches_reference(rank, world, policy, dump_folder):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from titan03_models import debug_moe_spec, shrink_moe, trainer_config
    from titan_megamoe.reference import relative_error
    from titan_megamoe.torchtitan03 import MegaGroupedExperts, MegaMoEConverter

    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = {}
    for backend in ("fused", "reference"):
        spec = debug_moe_spec([MegaMoEConverter.Config(backend=backend)], n_layers=1)
        shrink_moe(spec, num_experts=8, top_k=2, hidden_dim=32)
        spec.model.update_from_config(config=trainer_config(spec, ep=1, seq_len=8))
        torch.manual_seed(0)
        model = spec.model.build()
        with torch.no_grad():
            model.init_states(buffer_device=torch.device("cpu"))
        experts = [m for m in model.modules() if isinstance(m, MegaGroupedExperts)]
        assert experts and all(m.plans.settings.backend == backend for m in experts)
        {"selective": SelectiveAC, "full": FullAC}[policy].Config().build(dump_folder=dump_folder).apply(model)
        model(tokens).square().mean().backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
    for name, expected in grads["reference"].items():
        assert relative_error(grads["fused"][name], expected) < 1e-4, name


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_fused_backend_matches_reference(policy, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_fused_matches_reference, 1, policy, str(tmp_path), timeout_s=900)

"""TorchTitan 0.3.0's ``MegaMoEConverter``: its settings, conversion of every MoE model family
whose experts are SwiGLU grouped experts, the torchao recipe mapping, what it refuses,
the settings it resolves from the training job, activation checkpointing, and the stock
twin the A/B script trains."""

import dataclasses
import importlib
import logging

import pytest
import torch

import torchtitan.components.quantization.float8 as titan_float8
import torchtitan.components.quantization.mx as titan_mx
from torchtitan.components.quantization import Float8GroupedExpertsConverter, MXFP8GroupedExpertsConverter
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, TorchAOTokenDispatcher

from problems import rel_err
from titan03_models import debug_moe_spec, trainer_config
from titan_megamoe import ops
from titan_megamoe.precision import get_precision
from titan_megamoe.config import MegaMoE as MegaMoESection
from titan_megamoe.torchtitan03 import MegaGroupedExperts, MegaMoEConverter, MegaRoutedExperts
from titan_megamoe.torchtitan03 import converter as converter_module
from titan_megamoe.torchtitan03.overrides import mega_moe_layers, stock_routed_experts

FAMILIES = {"qwen3": "debugmodel_moe", "deepseek_v3": "debugmodel", "kimi_k2_7": "debugmodel"}
"""Every 0.3.0 model family with SwiGLU grouped experts that imports here -> its debug flavor
(qwen3_5's, also served, needs flash-linear-attention: ``test_qwen3_5_converts``)."""


def family(name: str):
    return importlib.import_module(f"torchtitan.models.{name}")


def converted_spec(*converters, n_layers=2, **settings):
    return debug_moe_spec([*converters, MegaMoEConverter.Config(**settings)], n_layers=n_layers)


def build_one_rank(spec, **job):
    """``spec``'s model on this process alone (EP 1), as the Trainer would build it."""
    spec.model.update_from_config(config=trainer_config(spec, ep=1, seq_len=16, **job))
    torch.manual_seed(0)
    model = spec.model.build()
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return model


@pytest.fixture
def torchao_converters_start_here(monkeypatch):
    """TorchTitan's torchao converters refuse a host without SM89 (fp8) / SM100 (MX) when
    built; the conversions below only rewrite configs."""
    monkeypatch.setattr(titan_float8, "has_cuda_capability", lambda *_: True)
    monkeypatch.setattr(titan_mx, "has_cuda_capability", lambda *_: True)


# --------------------------------------------------------------------------------------
# Settings.
# --------------------------------------------------------------------------------------


def test_config_takes_the_mega_moe_section_keys():
    section_fields = {f.name: f.default for f in dataclasses.fields(MegaMoESection)}
    config_fields = {f.name: f.default for f in dataclasses.fields(MegaMoEConverter.Config)}
    assert config_fields == section_fields
    assert isinstance(MegaMoEConverter.Config(), MegaMoESection)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("precision", "fp4", "precision = 'fp4' is not valid; allowed values: 'auto', 'bf16', 'fp8'"),
        ("backend", "cuda", "backend = 'cuda' is not valid; allowed values: 'auto', 'fused', 'stock', 'reference'"),
        ("capacity_tokens_per_rank", -1, "capacity_tokens_per_rank = -1 is not valid; expected an integer >= 0"),
        ("timeout_s", 0.0, "timeout_s = 0.0 is not valid; expected seconds > 0"),
    ],
)
def test_bad_values_name_the_config_field_and_choices(field, value, message):
    with pytest.raises(ValueError) as info:
        MegaMoEConverter.Config(**{field: value})
    assert str(info.value).startswith(f"MegaMoEConverter.Config {field}")
    assert message in str(info.value)


def test_settings_reach_the_layers(caplog):
    spec = converted_spec(backend="reference", comm_sms=24, save_gemm1=True, timeout_s=7, precision="fp8_bwd")
    with caplog.at_level(logging.INFO):
        model = build_one_rank(spec, local_batch_size=3)
    experts = [m for m in model.modules() if isinstance(m, MegaGroupedExperts)]
    assert len(experts) == 2
    settings = experts[0].plans.settings
    assert all(m.plans.settings is settings for m in experts)
    assert (settings.backend, settings.precision.name) == ("reference", "fp8_bwd")
    assert (settings.capacity_tokens_per_rank, settings.comm_sms, settings.save_gemm1, settings.timeout_s) == (
        3 * 16, 24, True, 7.0)
    (line,) = [r.message for r in caplog.records if "routed experts run" in r.message]
    assert line == ("mega_moe: routed experts run precision 'fp8_bwd' (from MegaMoEConverter.Config precision) "
                    "on backend 'reference' (asked for; experts compute in torch.float32)")
    assert any("comm_sms = 24, save_gemm1 = True, timeout_s = 7 only affect the fused backend" in r.message
               for r in caplog.records)


def test_capacity_counts_the_tokens_a_rank_passes_under_tp():
    spec = converted_spec(backend="reference")
    spec.model.update_from_config(config=trainer_config(spec, ep=2, tp=2, seq_len=16, local_batch_size=3))
    (layer, *_) = [c for _, c, _, _ in spec.model.traverse(MegaRoutedExperts.Config)]
    assert layer.resolved.settings.capacity_tokens_per_rank == 3 * 16 // 2


def test_experts_compute_in_the_mixed_precision_dtype(caplog):
    spec = converted_spec(backend="reference")
    with caplog.at_level(logging.INFO):
        spec.model.update_from_config(config=trainer_config(spec, param_dtype="bfloat16"))
    assert any("experts compute in torch.bfloat16" in r.message for r in caplog.records)


# --------------------------------------------------------------------------------------
# Conversion: every family with SwiGLU grouped experts, stock parity on one rank.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_converts_and_matches_stock(name):
    flavor, models = FAMILIES[name], []
    for converters, float32_experts in (([], True), ([MegaMoEConverter.Config(backend="reference")], False)):
        spec = debug_moe_spec(converters, float32_experts=float32_experts, flavor=flavor, family=family(name))
        models.append(build_one_rank(spec))
    stock, converted = models
    assert any(isinstance(m, MegaRoutedExperts) and not m.runs_stock for m in converted.modules())
    assert list(stock.state_dict()) == list(converted.state_dict())
    converted.load_state_dict(stock.state_dict())

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    out_stock, out_conv = stock(tokens), converted(tokens)
    assert rel_err(out_conv, out_stock) < 1e-5
    out_stock.square().mean().backward()
    out_conv.square().mean().backward()
    stock_params = dict(stock.named_parameters())
    compared = 0
    for param_name, p in converted.named_parameters():
        stock_grad = stock_params[param_name].grad
        if stock_grad is None:  # kimi_k2_7's vision encoder: text only here
            assert p.grad is None, param_name
            continue
        assert rel_err(p.grad, stock_grad) < 1e-5, param_name
        compared += "routed_experts" in param_name
    # deepseek_v3 and kimi_k2_7 begin with a dense layer.
    assert compared == 3 * sum(isinstance(m, MegaRoutedExperts) for m in converted.modules())


def test_qwen3_5_converts():
    pytest.importorskip("fla", reason="TorchTitan's qwen3_5 needs flash-linear-attention")
    spec = family("qwen3_5").model_registry("debugmodel_moe", converters=[MegaMoEConverter.Config()])
    layers = [c for _, c, _, _ in spec.model.traverse(MegaRoutedExperts.Config)]
    assert layers and all(type(c.inner_experts) is MegaGroupedExperts.Config for c in layers)


def test_stock_checkpoint_loads_into_the_converted_model():
    stock = build_one_rank(debug_moe_spec())
    converted = build_one_rank(converted_spec(backend="reference"))
    converted.load_state_dict(stock.state_dict())  # strict: same keys and shapes
    stock.load_state_dict(converted.state_dict())


def test_auto_runs_stock_on_the_cpu_exactly_as_stock(caplog):
    with caplog.at_level(logging.INFO):
        converted = build_one_rank(converted_spec())
    stock = build_one_rank(debug_moe_spec())
    layers = [m for m in converted.modules() if isinstance(m, MegaRoutedExperts)]
    assert layers and all(m.runs_stock and type(m.inner_experts) is GroupedExperts for m in layers)
    assert any("on backend 'stock' (auto; skipped fused:" in r.message for r in caplog.records)
    converted.load_state_dict(stock.state_dict())
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(converted(tokens), stock(tokens))


def test_fused_asked_for_on_the_cpu_is_refused():
    spec = converted_spec(backend="fused")
    with pytest.raises(NotImplementedError, match="backend = 'fused' cannot run here"):
        spec.model.update_from_config(config=trainer_config(spec))


# --------------------------------------------------------------------------------------
# torchao's grouped-experts converters in the same list.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "torchao, precision, source",
    [
        (Float8GroupedExpertsConverter, "fp8",
         "Float8GroupedExpertsConverter, as quantize.grouped_mm.float8 (torchao fp8 rowwise)"),
        (MXFP8GroupedExpertsConverter, "mxfp8",
         "MXFP8GroupedExpertsConverter, as quantize.grouped_mm.mx recipe 'mxfp8_rceil'"),
    ],
)
def test_torchao_converter_before_maps_to_a_precision(torchao, precision, source, torchao_converters_start_here,
                                                       caplog):
    spec = converted_spec(torchao.Config(), backend="reference")
    layers = [c for _, c, _, _ in spec.model.traverse(MegaRoutedExperts.Config)]
    assert layers and all(type(c.inner_experts) is MegaGroupedExperts.Config for c in layers)
    assert all(converter_module._torchao_converter_of(c.stock_experts.config) for c in layers)
    assert all(isinstance(c.token_dispatcher, TorchAOTokenDispatcher.Config) for c in layers)
    with caplog.at_level(logging.INFO):
        model = build_one_rank(spec)
    (line,) = [r.message for r in caplog.records if "routed experts run" in r.message]
    assert f"precision '{precision}' (from {source}) on backend 'reference'" in line
    experts = [m for m in model.modules() if isinstance(m, MegaGroupedExperts)]
    assert experts and all(m.plans.settings.precision.name == precision for m in experts)
    # torchao never wraps the weights the operator reads.
    assert all(type(p) is torch.nn.Parameter for m in experts for p in m.parameters())


def test_torchao_converter_after_is_refused(torchao_converters_start_here):
    spec = debug_moe_spec([MegaMoEConverter.Config(backend="reference"), Float8GroupedExpertsConverter.Config()])
    with pytest.raises(ValueError, match=r"converted again after MegaMoEConverter \(by Float8GroupedExpertsConverter"
                                         r"\); list Float8GroupedExpertsConverter.Config\(\) before"):
        spec.model.update_from_config(config=trainer_config(spec))


def test_stock_of_a_quantized_precision_needs_the_torchao_converter(monkeypatch):
    # As on a GPU where stock TorchTitan runs fp8.
    monkeypatch.setitem(ops.BACKENDS, "stock", ops.Backend(lambda *_: None, op=None, auto=lambda *_: None))
    spec = converted_spec(backend="stock", precision="fp8")
    with pytest.raises(ValueError, match=r"backend 'stock' runs precision 'fp8' as stock TorchTitan does, through "
                                         r"torchao's Float8GroupedExpertsConverter: list "
                                         r"Float8GroupedExpertsConverter.Config\(\) before"):
        spec.model.update_from_config(config=trainer_config(spec))


def test_stock_runs_only_what_stock_torchtitan_runs():
    reason = ops.BACKENDS["stock"].unsupported
    cpu = torch.device("cpu")
    assert reason(cpu, torch.bfloat16, get_precision("bf16"), True) is None
    assert "has no stock recipe in TorchTitan 0.3.0" in reason(cpu, torch.bfloat16, get_precision("fp8_bwd"), True)
    assert "needs CUDA; this device is cpu" in reason(cpu, torch.bfloat16, get_precision("fp8"), True)


# --------------------------------------------------------------------------------------
# What the converter refuses.
# --------------------------------------------------------------------------------------


def test_gpt_oss_experts_are_refused():
    with pytest.raises(ValueError, match=r"inner_experts are GptOssGroupedExperts: mega_moe runs SwiGLU grouped "
                                         r"experts .*leave MegaMoEConverter out"):
        family("gpt_oss").model_registry("debugmodel", converters=[MegaMoEConverter.Config()])


def test_other_token_dispatchers_are_refused():
    with pytest.raises(ValueError, match=r"token_dispatcher is DeepEPTokenDispatcher.Config: mega_moe does its own "
                                         r"dispatch and combine; .*moe_comm_backend='standard'"):
        family("qwen3").model_registry("debugmodel_moe", moe_comm_backend="deepep",
                                       converters=[MegaMoEConverter.Config()])


def test_listed_twice_is_refused():
    with pytest.raises(ValueError, match="converters lists MegaMoEConverter.Config more than once; list it once"):
        debug_moe_spec([MegaMoEConverter.Config(), MegaMoEConverter.Config()])


def test_model_without_moe_is_refused():
    with pytest.raises(ValueError, match="MegaMoEConverter found no routed experts"):
        family("qwen3").model_registry("debugmodel", converters=[MegaMoEConverter.Config()])


@pytest.mark.parametrize(
    "job, message",
    [
        ({"pp": 2}, "pipeline_parallel_degree = 2: mega_moe is not tested with pipeline schedules; set it to 1"),
        ({"tp": 2, "ep": 1}, "tensor_parallel_degree = 2 with expert_parallel_degree = 1: TorchTitan then shards "
                             "each expert over TP"),
    ],
)
def test_unservable_jobs_are_refused_before_the_build(job, message):
    spec = converted_spec(backend="reference")
    with pytest.raises(ValueError, match=message):
        spec.model.update_from_config(config=trainer_config(spec, **job))


def test_building_before_the_job_is_known_says_what_to_call():
    spec = converted_spec(backend="reference")
    with pytest.raises(RuntimeError, match=r"update_from_config\(config=<Trainer.Config>\)"):
        spec.model.build()


def test_a_config_without_training_is_refused():
    spec = converted_spec(backend="reference")
    parallelism_only = type("Job", (), {"parallelism": trainer_config(spec).parallelism})()
    with pytest.raises(TypeError, match="expected a Trainer.Config"):
        spec.model.update_from_config(config=parallelism_only)


# --------------------------------------------------------------------------------------
# Selective activation checkpointing saves the operator's output (no recomputed
# transfers); full AC recomputes it, as it does every op.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy, forward_calls", [("selective", 2), ("full", 4)])
def test_activation_checkpointing(policy, forward_calls, monkeypatch, tmp_path):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    model = build_one_rank(converted_spec(backend="reference"))
    ac = {"selective": SelectiveAC, "full": FullAC}[policy]
    ac.Config().build(dump_folder=str(tmp_path)).apply(model)
    calls = []
    reference = ops.BACKENDS["reference"]

    def counting_forward(*args):
        calls.append(1)
        return reference.op.forward(*args)

    counting = dataclasses.replace(reference, op=dataclasses.replace(reference.op, forward=counting_forward))
    monkeypatch.setitem(ops.BACKENDS, "reference", counting)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens).square().mean().backward()
    assert len(calls) == forward_calls  # 2 MoE layers
    assert all(p.grad is not None for p in model.parameters())


# --------------------------------------------------------------------------------------
# The stock twin (scripts/ab_train_torchtitan03.sh).
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop_quantize", [False, True])
def test_stock_twin_is_the_stock_routed_experts(drop_quantize, torchao_converters_start_here):
    spec = converted_spec(Float8GroupedExpertsConverter.Config(), backend="reference")
    assert mega_moe_layers(trainer_config(spec)) == 2
    spec.model.update_from_config(config=trainer_config(spec))
    (layer, *_) = [c for _, c, _, _ in spec.model.traverse(MegaRoutedExperts.Config)]
    twin = stock_routed_experts(layer, drop_quantize=drop_quantize)
    assert type(twin) is RoutedExperts.Config
    assert twin.sharding_config is layer.sharding_config
    assert twin.inner_experts.sharding_config is layer.inner_experts.sharding_config
    if drop_quantize:
        assert type(twin.inner_experts) is GroupedExperts.Config
        assert type(twin.token_dispatcher) is AllToAllTokenDispatcher.Config
    else:
        assert twin.inner_experts == dataclasses.replace(layer.stock_experts.config,
                                                         sharding_config=layer.inner_experts.sharding_config)
        assert twin.token_dispatcher is layer.token_dispatcher
    assert mega_moe_layers(trainer_config(debug_moe_spec())) == 0

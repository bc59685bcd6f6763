"""The ``[mega_moe]`` section, the converter's checks and recipe mapping, conversion of
every TorchTitan model family with MoE layers, and activation checkpointing."""

import dataclasses
import logging

import pytest
import torch

import titan_megamoe.config  # noqa: F401  (registers the converter)
from problems import rel_err
from titan_megamoe.config import MegaMoE as MegaMoESection
from titan_megamoe.converter import MegaMoEConverter
from titan_megamoe.layer import MegaMoE
from titan_megamoe.ops import BACKENDS, SAVE_LIST_OPS
from titan_megamoe.precision import precision_from_recipe


def parse(*args):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(
        ["--job.custom_config_module=titan_megamoe.config", "--model.name=qwen3",
         "--model.flavor=debugmodel_moe", *args]
    )


def build_converters(job):
    from torchtitan.protocols.model_converter import build_model_converters

    return build_model_converters(job, parallel_dims=None)


# --------------------------------------------------------------------------------------
# Config.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("precision", "fp4", "precision = 'fp4' is not valid; allowed values: 'auto', 'bf16', 'fp8', 'fp8_bwd', 'mxfp8'"),
        ("backend", "cuda", "backend = 'cuda' is not valid; allowed values: 'auto', 'fused', 'reference'"),
        ("gemm1_activations", "keep", "gemm1_activations = 'keep' is not valid; allowed values: 'recompute', 'save'"),
        ("capacity_tokens_per_rank", -1, "capacity_tokens_per_rank = -1 is not valid; expected an integer >= 0"),
        ("comm_sms", 1.5, "comm_sms = 1.5 is not valid"),
    ],
)
def test_bad_section_values_name_field_and_choices(field, value, message):
    with pytest.raises(ValueError) as info:
        MegaMoESection(**{field: value})
    assert message in str(info.value)
    assert str(info.value).startswith(f"[mega_moe] {field}")


def test_bad_value_in_toml_is_reported(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text('[job]\ncustom_config_module = "titan_megamoe.config"\n[mega_moe]\nbackend = "fast"\n')
    with pytest.raises(ValueError, match=r"\[mega_moe\] backend = 'fast' is not valid; allowed values"):
        parse(f"--job.config_file={toml}")


def test_section_defaults_and_cli_overrides():
    job = parse("--mega_moe.precision=fp8_bwd", "--mega_moe.capacity_tokens_per_rank=4096")
    assert job.mega_moe.precision == "fp8_bwd"
    assert job.mega_moe.backend == "auto"
    assert job.mega_moe.capacity_tokens_per_rank == 4096
    assert job.mega_moe.gemm1_activations == "recompute"


# --------------------------------------------------------------------------------------
# Convert-time checks and the recipe mapping.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (("--parallelism.expert_parallel_degree=2", "--parallelism.expert_tensor_parallel_degree=2"),
         "expert_tensor_parallel_degree = 2: mega_moe runs whole experts per EP rank; set it to 1"),
        (("--parallelism.expert_parallel_comm_backend=deepep",),
         "expert_parallel_comm_backend = 'deepep': mega_moe does its own dispatch and combine"),
        (("--parallelism.pipeline_parallel_degree=2",),
         "pipeline_parallel_degree = 2: mega_moe is not tested with pipeline schedules"),
        (("--mega_moe.backend=fused",), "backend = 'fused' cannot run here: it needs a CUDA GPU"),
    ],
)
def test_unservable_jobs_fail_at_convert_time(args, message):
    job = parse("--model.converters", "mega_moe", *args)
    with pytest.raises((ValueError, NotImplementedError), match=message):
        build_converters(job)


def test_fused_only_settings_are_reported_when_ignored(caplog):
    job = parse("--mega_moe.backend=reference", "--mega_moe.comm_sms=16")
    with caplog.at_level(logging.WARNING):
        MegaMoEConverter(job, None)
    assert any("comm_sms = 16 only affect the fused backend" in r.message for r in caplog.records)


def test_fused_settings_reach_the_layers():
    job = parse("--training.local_batch_size=3", "--training.seq_len=512", "--mega_moe.comm_sms=24")
    assert MegaMoEConverter(job, None).settings.capacity_tokens == 3 * 512
    job = parse("--mega_moe.capacity_tokens_per_rank=999")
    settings = MegaMoEConverter(job, None).settings
    assert (settings.capacity_tokens, settings.comm_sms) == (999, 0)


@pytest.mark.parametrize(
    "precision, capability, expected",
    [
        ("bf16", (9, 0), "fused"),
        ("fp8_bwd", (9, 0), "reference"),  # quantized backward: not fused yet
        ("fp8", (9, 0), "reference"),
        ("bf16", (8, 0), "reference"),
    ],
)
def test_auto_backend_takes_the_first_that_can_run(precision, capability, expected, monkeypatch):
    from titan_megamoe import ops

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    backend, why = ops.resolve_backend("auto", torch.device("cuda"), precision)
    assert backend == expected
    if expected == "reference":
        assert why.startswith("auto on cuda; not fused: ")


@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_ep_across_nodes_is_not_fused(backend, monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    job = parse("--parallelism.expert_parallel_degree=8", f"--mega_moe.backend={backend}")
    if backend == "fused":
        with pytest.raises(NotImplementedError, match="EP group must be GPUs of one node"):
            MegaMoEConverter(job, None)
        return
    with caplog.at_level(logging.INFO):
        assert MegaMoEConverter(job, None).settings.backend == "reference"
    assert any("not fused: its EP group must be GPUs of one node" in r.message for r in caplog.records)


def test_converter_without_section_says_what_to_add():
    from torchtitan.config import ConfigManager

    job = ConfigManager().parse_args(["--model.converters", "mega_moe"])
    with pytest.raises(ValueError, match='custom_config_module = "titan_megamoe.config"'):
        build_converters(job)


def test_model_without_moe_is_refused():
    converter = MegaMoEConverter(parse(), None)
    with pytest.raises(ValueError, match="found no torchtitan MoE layer"):
        converter.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize(
    "converters, mx_recipe, expected",
    [
        ([], "mxfp8", "bf16"),
        (["quantize.grouped_mm.float8"], "mxfp8", "fp8"),
        (["quantize.grouped_mm.mx"], "mxfp8", "mxfp8"),
        (["quantize.grouped_mm.mx"], "mxfp8_rceil", "mxfp8"),
        (["quantize.grouped_mm.mx"], "mxfp8_rceil_wgrad_with_hp", "mxfp8_wgrad_bf16"),
        (["quantize.linear.float8"], "mxfp8", "bf16"),
    ],
)
def test_recipe_table(converters, mx_recipe, expected):
    assert precision_from_recipe(converters + ["mega_moe"], mx_recipe)[0] == expected


def test_unknown_mx_recipe_is_named():
    with pytest.raises(ValueError, match="recipe_name = 'mxfp4' has no mega_moe precision"):
        precision_from_recipe(["quantize.grouped_mm.mx"], "mxfp4")


@pytest.mark.parametrize(
    "grouped_mm, expected",
    [("quantize.grouped_mm.float8", "fp8"), ("quantize.grouped_mm.mx", "mxfp8")],
)
def test_torchao_converter_defers_to_mega_moe(grouped_mm, expected, caplog):
    # On this CPU host the stock converters refuse to start (fp8 needs SM89, MX SM100):
    # with mega_moe in the list they are not built and leave the experts alone.
    job = parse("--model.converters", f"{grouped_mm},mega_moe", "--quantize.grouped_mm.float8.fqns", "experts",
                "--quantize.grouped_mm.mx.fqns", "experts")
    with caplog.at_level(logging.INFO):
        container = build_converters(job)
    mapping = [r.message for r in caplog.records if "routed experts run precision" in r.message]
    assert len(mapping) == 1 and f"precision '{expected}'" in mapping[0] and grouped_mm in mapping[0]
    model = debug_model("qwen3")
    container.convert(model)
    moe_layers = [m for m in model.modules() if isinstance(m, MegaMoE)]
    assert moe_layers and all(m.experts.settings.precision == expected for m in moe_layers)
    assert all(type(p) is torch.nn.Parameter for m in moe_layers for p in m.experts.parameters())


def test_torchao_converter_without_mega_moe_is_stock():
    job = parse("--model.converters", "quantize.grouped_mm.float8")
    with pytest.raises(ValueError, match="only supported on SM89"):
        build_converters(job)


def test_operator_joins_the_selective_ac_save_lists():
    import torchtitan.models.deepseek_v3.infra.parallelize as deepseek
    import torchtitan.models.llama4.infra.parallelize as llama4
    import torchtitan.models.qwen3.infra.parallelize as qwen3

    MegaMoEConverter(parse(), None)
    for module in (qwen3, llama4, deepseek):
        assert set(SAVE_LIST_OPS) <= module._op_sac_save_list


# --------------------------------------------------------------------------------------
# Every model family with TorchTitan MoE layers: converted == stock on one rank.
# --------------------------------------------------------------------------------------


def debug_model(family: str, n_layers: int = 2, state=None, moe=None, **sizes):
    """The family's debug flavor at ``n_layers``; ``sizes`` and ``moe`` (MoEArgs fields)
    shrink it further."""
    import importlib

    module = importlib.import_module(f"torchtitan.models.{family}")
    spec = module.get_train_spec()
    flavor = "debugmodel_moe" if family == "qwen3" else "debugmodel"
    args = spec.model_args[flavor]
    moe_args = dataclasses.replace(args.moe_args, use_grouped_mm=False, **(moe or {}))
    args = dataclasses.replace(args, n_layers=n_layers, moe_args=moe_args, **sizes)
    args.update_from_config(parse("--training.seq_len=16"))
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    if state is not None:
        model.load_state_dict(state)
    return model


@pytest.mark.parametrize("family", ["qwen3", "llama4", "deepseek_v3"])
def test_each_family_converts_and_matches_stock(family):
    stock = debug_model(family)
    converted = debug_model(family, state=stock.state_dict())
    MegaMoEConverter(parse(), None).convert(converted)
    assert any(isinstance(m, MegaMoE) for m in converted.modules())
    assert list(stock.state_dict()) == list(converted.state_dict())

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    out_stock, out_conv = stock(tokens), converted(tokens)
    assert rel_err(out_conv, out_stock) < 1e-5
    out_stock.square().mean().backward()
    out_conv.square().mean().backward()
    stock_params = dict(stock.named_parameters())
    for name, p in converted.named_parameters():
        assert rel_err(p.grad, stock_params[name].grad) < 1e-5, name


# --------------------------------------------------------------------------------------
# Activation checkpointing: selective AC saves the operator's output (no recomputed
# transfers); full AC recomputes it, as it does every op.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, forward_calls", [("selective", 2), ("full", 4)])
def test_activation_checkpointing(mode, forward_calls, monkeypatch):
    import torchtitan.models.qwen3.infra.parallelize as qwen3
    from torchtitan.distributed.activation_checkpoint import apply_ac

    job = parse(f"--activation_checkpoint.mode={mode}", "--activation_checkpoint.selective_ac_option=op")
    model = debug_model("qwen3")
    MegaMoEConverter(job, None).convert(model)
    apply_ac(model, job.activation_checkpoint, op_sac_save_list=qwen3._op_sac_save_list)

    calls = []

    reference_forward = BACKENDS["reference"].forward

    def counting_forward(*args, **options):
        calls.append(1)
        return reference_forward(*args, **options)

    monkeypatch.setitem(BACKENDS, "reference", dataclasses.replace(BACKENDS["reference"], forward=counting_forward))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens).square().mean().backward()
    assert len(calls) == forward_calls  # 2 MoE layers
    assert all(p.grad is not None for p in model.parameters())

"""The ``[mega_moe]`` section, the converter's checks and recipe mapping, conversion of
every TorchTitan model family with MoE layers, and activation checkpointing."""

import dataclasses
import logging

import pytest
import torch

import titan_megamoe.registry  # noqa: F401  (registers the converter with TorchTitan)
from problems import rel_err
from titan_megamoe import fused_support, stock
from titan_megamoe.config import MegaMoE as MegaMoESection
from titan_megamoe.converter import MegaMoEConverter
from titan_megamoe.layer import MegaMoE
from titan_megamoe.ops import BACKENDS, SAVE_LIST_OPS
from titan_megamoe.precision import precision_from_recipe
from titan_megamoe.settings import DEFAULT_TIMEOUT_S


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
        ("precision", "fp4", "precision = 'fp4' is not valid; allowed values: 'auto', 'bf16', 'fp8', 'fp8_bwd', 'fp8_wgrad_bf16', 'mxfp8', 'mxfp8_wgrad_bf16'"),
        ("backend", "cuda", "backend = 'cuda' is not valid; allowed values: 'auto', 'fused', 'stock', 'reference'"),
        ("save_gemm1", "save", "save_gemm1 = 'save' is not valid; expected true or false"),
        ("capacity_tokens_per_rank", -1, "capacity_tokens_per_rank = -1 is not valid; expected an integer >= 0"),
        ("comm_sms", 1.5, "comm_sms = 1.5 is not valid"),
        ("reserved_sms", -2, "reserved_sms = -2 is not valid; expected an integer >= 0"),
        ("timeout_s", 0.0, "timeout_s = 0.0 is not valid; expected seconds > 0"),
        ("save_gemm1_load", -1.0, "save_gemm1_load = -1.0 is not valid; expected a multiple of the mean load > 0"),
        ("receive_load", -0.5, "receive_load = -0.5 is not valid; expected a multiple of the mean load > 0, or 0"),
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
    assert (job.mega_moe.save_gemm1, job.mega_moe.timeout_s) == (False, DEFAULT_TIMEOUT_S)
    job = parse("--mega_moe.save_gemm1", "--mega_moe.timeout_s=12.5")
    assert (job.mega_moe.save_gemm1, job.mega_moe.timeout_s) == (True, 12.5)


def test_section_keys_are_the_settings_fields():
    from titan_megamoe.settings import OperatorSettings

    assert [f.name for f in dataclasses.fields(MegaMoESection)] == [
        f.name for f in dataclasses.fields(OperatorSettings)
    ]


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
        (("--mega_moe.backend=fused",), "backend = 'fused' cannot run here: "),
    ],
)
def test_unservable_jobs_fail_at_convert_time(args, message):
    job = parse("--model.converters", "mega_moe", *args)
    with pytest.raises((ValueError, NotImplementedError), match=message):
        build_converters(job)


def test_mega_moe_listed_twice_is_refused():
    job = parse("--model.converters", "mega_moe,mega_moe")
    with pytest.raises(ValueError, match="model.converters lists 'mega_moe' 2 times; list it once"):
        build_converters(job)


def test_fused_only_settings_are_reported_when_ignored(caplog):
    job = parse("--mega_moe.backend=reference", "--mega_moe.comm_sms=16", "--mega_moe.save_gemm1")
    with caplog.at_level(logging.WARNING):
        MegaMoEConverter(job, None)
    assert any("comm_sms = 16, save_gemm1 = True only affect the fused backend" in r.message
               for r in caplog.records)


def test_settings_reach_the_layers():
    job = parse("--training.local_batch_size=3", "--training.seq_len=512", "--mega_moe.comm_sms=24")
    assert MegaMoEConverter(job, None).settings.capacity_tokens_per_rank == 3 * 512
    job = parse("--mega_moe.capacity_tokens_per_rank=999", "--mega_moe.save_gemm1", "--mega_moe.timeout_s=7",
                "--mega_moe.save_gemm1_load=2", "--mega_moe.precision=fp8_bwd", "--mega_moe.backend=reference",
                "--mega_moe.reserved_sms=8", "--mega_moe.receive_load=1.5")
    converter = MegaMoEConverter(job, None)
    settings = converter.settings
    assert (settings.capacity_tokens_per_rank, settings.comm_sms, settings.reserved_sms, settings.save_gemm1,
            settings.save_gemm1_load, settings.receive_load, settings.timeout_s) == (999, 0, 8, True, 2.0, 1.5, 7.0)
    assert (settings.precision.name, settings.backend) == ("fp8_bwd", "reference")
    model = debug_model("qwen3")
    converter.convert(model)
    layers = [m for m in model.modules() if isinstance(m, MegaMoE)]
    assert layers and all(m.experts.settings is settings and not m.experts.auto_backend for m in layers)
    # The bf16-weight-gradient MX variant, which TorchTitan 0.2.2's recipe check cannot reach.
    job = parse("--mega_moe.precision=mxfp8_wgrad_bf16", "--mega_moe.backend=reference")
    precision = MegaMoEConverter(job, None).settings.precision
    assert (precision.name, precision.forward.name, precision.wgrad.name) == ("mxfp8_wgrad_bf16", "mxfp8", "native")


def _fused_runs_bf16_only(device, dtype, precision, ep_within_node):
    return None if dtype == torch.bfloat16 else f"test: no {dtype} kernels"


def _fused_checked_by(check, monkeypatch):
    """The fused backend runs where ``check`` says, as on an H100/H200."""
    monkeypatch.setattr(fused_support, "unsupported_reason", check)
    monkeypatch.setattr(fused_support, "arch", lambda device: ("sm90", "a test GPU"))


@pytest.mark.parametrize(
    "param_dtype, dp_shard, precision, expected",
    [("bfloat16", 2, "bf16", "fused"),
     ("float32", 2, "bf16", "fused (bf16 copies)"),
     ("bfloat16", 1, "bf16", "fused (bf16 copies)"),  # 1: no FSDP, AMP keeps the weights in fp32
     ("float32", 2, "fp8", "fused (bf16 token copies)"),  # the kernels quantize the fp32 weights
     ("float32", 2, "fp8_bwd", "fused (bf16 copies)"),  # its forward multiplies bf16 weights
     ("bfloat16", 2, "fp8", "fused")],
)
def test_auto_resolves_for_the_dtype_the_experts_compute_in(param_dtype, dp_shard, precision, expected, monkeypatch,
                                                           caplog):
    from torchtitan.distributed import ParallelDims

    _fused_checked_by(_fused_runs_bf16_only, monkeypatch)
    monkeypatch.setattr(stock, "unsupported_reason", lambda *_: None)
    dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=dp_shard)
    job = parse(f"--training.mixed_precision_param={param_dtype}", f"--mega_moe.precision={precision}")
    with caplog.at_level(logging.INFO):
        converter = MegaMoEConverter(job, dims)
    assert converter.settings.backend == expected.split()[0] and converter.auto_backend
    (line,) = [r.message for r in caplog.records if "routed experts run" in r.message]
    copies = "experts compute in torch.float32; the fused kernels take torch.bfloat16 copies of their tokens and weights"
    assert (copies in line) == expected.endswith("(bf16 copies)"), line
    token_copies = ("experts compute in torch.float32; the fused kernels take torch.bfloat16 copies of their tokens, "
                    "as TorchTitan's grouped-MM path does, and quantize the torch.float32 weights themselves")
    assert (token_copies in line) == expected.endswith("(bf16 token copies)"), line


@pytest.mark.parametrize("precision, weight_dtype, log, out_tolerance, grad_tolerance",
                         [("bf16", torch.bfloat16, "take torch.bfloat16 copies of their tokens and weights",
                           2e-2, 3e-2),
                          ("fp8", torch.float32, "take torch.bfloat16 copies of their tokens, as TorchTitan's "
                                                 "grouped-MM path does, and quantize the torch.float32 weights",
                           5e-2, 1.5e-1)])
def test_float32_experts_run_fused_on_bf16_copies(precision, weight_dtype, log, out_tolerance, grad_tolerance,
                                                  monkeypatch, caplog):
    """As TorchTitan's grouped-MM path, which casts tokens and weights to bf16 whatever the
    parameters' dtype: the operator gets bf16 copies of the tokens, and of the weights
    unless every GEMM reads them quantized (fp8: the kernels quantize the fp32 weights);
    gradients reach the fp32 parameters (through the casts)."""
    import titan_megamoe.expert_calls as expert_calls

    _fused_checked_by(_fused_runs_bf16_only, monkeypatch)
    seen = []
    real_mega_moe = expert_calls.mega_moe

    def mega_moe(x, topk_idx, topk_w, w1, w2, w3, group, score_before_experts, settings):
        seen.append((settings.backend, x.dtype, w1.dtype, w2.dtype, w3.dtype))
        return real_mega_moe(x, topk_idx, topk_w, w1, w2, w3, group, score_before_experts=score_before_experts,
                             settings=settings.replace(backend="reference"))

    monkeypatch.setattr(expert_calls, "mega_moe", mega_moe)
    monkeypatch.setattr(expert_calls, "_logged_casts", set())
    original = debug_model("qwen3")  # fp32
    converted = debug_model("qwen3", state=original.state_dict())
    converter = MegaMoEConverter(parse(f"--mega_moe.precision={precision}"), None)
    assert converter.settings.backend == "fused"
    converter.convert(converted)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.INFO):
        out = converted(tokens)
    out_stock = original(tokens)
    assert out.dtype == torch.float32
    assert seen == [("fused", torch.bfloat16, weight_dtype, weight_dtype, weight_dtype)] * 2  # 2 layers
    casts = [r.message for r in caplog.records if "run on the fused backend: the fused kernels " + log in r.message]
    assert len(casts) == 1 and "experts computing in torch.float32" in casts[0]
    # bf16 (or fp8) GEMMs against stock's fp32 loop on the CPU.
    assert 0 < rel_err(out, out_stock) < out_tolerance
    out.square().mean().backward()
    out_stock.square().mean().backward()
    stock_params = dict(original.named_parameters())
    for name, p in converted.named_parameters():
        if "experts.w" in name:
            assert p.grad.dtype == torch.float32 and rel_err(p.grad, stock_params[name].grad) < grad_tolerance, name


@pytest.mark.parametrize("auto", [True, False])
def test_fused_layer_runs_stock_for_a_dtype_fused_cannot_run_only_under_auto(auto, monkeypatch, caplog):
    checked, stock_calls = [], []
    real_routed_experts = stock.routed_experts

    def fused_check(device, dtype, precision, ep_within_node):
        checked.append(dtype)
        return _fused_runs_bf16_only(device, dtype, precision, ep_within_node)

    def routed_experts(*args):
        stock_calls.append(1)
        return real_routed_experts(*args)

    _fused_checked_by(fused_check, monkeypatch)
    monkeypatch.setattr(fused_support, "operand_cast", lambda *_: None)  # no bf16 copies either
    monkeypatch.setattr(stock, "routed_experts", routed_experts)
    converter = MegaMoEConverter(parse("--mega_moe.backend=reference"), None)
    # As the converter leaves it when auto chose fused for bf16 experts, or fused was asked for.
    converter.settings = converter.settings.replace(backend="fused")
    converter.auto_backend = auto
    model = debug_model("qwen3")  # fp32
    converter.convert(model)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    if not auto:
        with pytest.raises(NotImplementedError, match=r"backend = 'fused' cannot run these experts \(torch.float32 "
                                                      r"inputs\): test: no torch.float32 kernels; set .*'auto'"):
            model(tokens)
        return
    with caplog.at_level(logging.WARNING):
        model(tokens).sum().backward()
        model(tokens)
    assert len(stock_calls) == 4  # 2 layers, 2 calls
    assert checked == [torch.float32] * 2  # decided once per layer
    fallbacks = [r.message for r in caplog.records if "(torch.float32 inputs)" in r.message]
    assert len(fallbacks) == 1 and "test: no torch.float32 kernels" in fallbacks[0]


@pytest.mark.parametrize("auto", [True, False])
def test_fused_layer_refuses_an_intermediate_size_without_whole_scale_blocks(auto, monkeypatch, caplog):
    """fp8's backward stores [da | db] in blocks of 128 along the intermediate size: experts
    of size 200 run stock under auto (logged) and raise, naming the size, when fused was
    asked for."""
    _fused_checked_by(lambda *_: None, monkeypatch)
    converter = MegaMoEConverter(parse("--mega_moe.precision=fp8", "--mega_moe.backend=reference"), None)
    converter.settings = converter.settings.replace(backend="fused")
    converter.auto_backend = auto
    model = debug_model("qwen3", moe_inter_dim=200)
    converter.convert(model)
    experts = next(m for m in model.modules() if isinstance(m, MegaMoE)).experts
    x = torch.zeros(4, experts.w1.shape[2], dtype=torch.bfloat16)
    message = "intermediate size 200 is not a multiple of 128"
    if not auto:
        with pytest.raises(NotImplementedError, match=message):
            experts._settings_for(x, x.dtype)
        return
    with caplog.at_level(logging.WARNING):
        assert experts._settings_for(x, x.dtype) == (converter.settings.replace(backend="stock"), None)
    assert any(message in r.message and "run backend 'stock'" in r.message for r in caplog.records)


@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_ep_across_nodes_is_not_fused(backend, monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    job = parse("--parallelism.expert_parallel_degree=8", f"--mega_moe.backend={backend}")
    if backend == "fused":
        with pytest.raises(NotImplementedError, match="EP group must be GPUs of one node"):
            MegaMoEConverter(job, None)
        return
    with caplog.at_level(logging.INFO):
        assert MegaMoEConverter(job, None).settings.backend == "stock"
    assert any("skipped fused: its EP group must be GPUs of one node" in r.message for r in caplog.records)


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
    # with mega_moe in the list they are not built and leave the experts alone. Only the
    # reference backend runs quantized precisions on a CPU.
    job = parse("--model.converters", f"{grouped_mm},mega_moe", "--quantize.grouped_mm.float8.fqns", "experts",
                "--quantize.grouped_mm.mx.fqns", "experts", "--mega_moe.backend=reference")
    with caplog.at_level(logging.INFO):
        container = build_converters(job)
    mapping = [r.message for r in caplog.records if "routed experts run precision" in r.message]
    assert len(mapping) == 1 and f"precision '{expected}'" in mapping[0] and grouped_mm in mapping[0]
    model = debug_model("qwen3")
    container.convert(model)
    moe_layers = [m for m in model.modules() if isinstance(m, MegaMoE)]
    assert moe_layers and all(m.experts.settings.precision.name == expected for m in moe_layers)
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


@pytest.mark.parametrize("backend", ["reference", "stock"])
@pytest.mark.parametrize("family", ["qwen3", "llama4", "deepseek_v3"])
def test_each_family_converts_and_matches_stock(family, backend):
    original = debug_model(family)
    converted = debug_model(family, state=original.state_dict())
    MegaMoEConverter(parse(f"--mega_moe.backend={backend}"), None).convert(converted)
    assert any(isinstance(m, MegaMoE) for m in converted.modules())
    assert list(original.state_dict()) == list(converted.state_dict())

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    out_stock, out_conv = original(tokens), converted(tokens)
    assert rel_err(out_conv, out_stock) < 1e-5
    out_stock.square().mean().backward()
    out_conv.square().mean().backward()
    stock_params = dict(original.named_parameters())
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

    job = parse(f"--activation_checkpoint.mode={mode}", "--activation_checkpoint.selective_ac_option=op",
                "--mega_moe.backend=reference")
    model = debug_model("qwen3")
    MegaMoEConverter(job, None).convert(model)
    apply_ac(model, job.activation_checkpoint, op_sac_save_list=qwen3._op_sac_save_list)

    calls = []
    reference = BACKENDS["reference"]

    def counting_forward(*args):
        calls.append(1)
        return reference.op.forward(*args)

    counting = dataclasses.replace(reference, op=dataclasses.replace(reference.op, forward=counting_forward))
    monkeypatch.setitem(BACKENDS, "reference", counting)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens).square().mean().backward()
    assert len(calls) == forward_calls  # 2 MoE layers
    assert all(p.grad is not None for p in model.parameters())

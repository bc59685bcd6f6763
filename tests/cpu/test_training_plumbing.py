"""Training plumbing on CPU: the shipped tokenizer and dataset, the reduced flavors, the
TOMLs in train_configs/, and the A/B scripts' log parsing and TOML rewriting."""

import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import ConfigManager, JobConfig
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
from torchtitan.models.qwen3 import qwen3_args

import titan_megamoe.data as data
import titan_megamoe.models as models
from titan_megamoe.precision import PRECISION_CHOICES

from script_modules import load_script
from titan_logs import synthetic_log, titan_step_message

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "train_configs"
DEBUG_MOE_VOCAB = 2048


ab_report = load_script("ab_report")
ab_stock_toml = load_script("ab_stock_toml")


# ---------------------------------------------------------------- tokenizer and data

@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer(data.TOKENIZER_DIR)


def test_tokenizer_round_trips_with_bos_eos(tokenizer):
    assert tokenizer.get_vocab_size() <= DEBUG_MOE_VOCAB
    assert None not in (tokenizer.bos_id, tokenizer.eos_id)
    assert tokenizer.bos_id != tokenizer.eos_id
    for text in ["Once upon a time, Anna lived in a quiet village.", "3 + 4 = 7\nÜber café 😀"]:
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert tokenizer.bos_id not in ids[1:-1] and tokenizer.eos_id not in ids[1:-1]
        assert max(ids) < tokenizer.get_vocab_size()
        assert tokenizer.decode(ids) == text


def test_dataset_is_registered_idempotently_without_downloads():
    importlib.reload(data)
    config = data.DATASETS[data.DATASET_NAME]
    assert Path(config.path) == REPO / "titan_megamoe" / "assets" / "megamoe_text.jsonl"
    assert 1_000_000 <= Path(config.path).stat().st_size <= 3_000_000
    sample = next(iter(config.loader(config.path)))
    assert isinstance(config.sample_processor(sample), str)


def test_dataloader_feeds_two_dp_ranks_different_tokens(tokenizer):
    job_config = JobConfig()
    job_config.training.dataset = data.DATASET_NAME
    job_config.training.seq_len = 64
    job_config.training.local_batch_size = 2
    batches = []
    for dp_rank in range(2):
        loader = build_text_dataloader(
            dp_world_size=2, dp_rank=dp_rank, tokenizer=tokenizer, job_config=job_config
        )
        inputs, labels = next(iter(loader))
        tokens = inputs["input"]
        assert tokens.shape == labels.shape == (2, 64)
        assert tokens.dtype == torch.long
        assert torch.equal(tokens[:, 1:], labels[:, :-1])  # next-token targets
        assert tokens[0, 0] == tokenizer.bos_id  # each rank starts at a document
        assert int(tokens.max()) < DEBUG_MOE_VOCAB
        batches.append(tokens)
    assert not torch.equal(batches[0], batches[1])


# ---------------------------------------------------------------- flavors

def test_reduced_flavors_keep_layer_shapes():
    assert models.REDUCED_DEPTH_FLAVORS == {
        "30B-A3B-4L": ("30B-A3B", 4),
        "30B-A3B-12L": ("30B-A3B", 12),
        "235B-A22B-2L": ("235B-A22B", 2),
    }
    importlib.reload(models)  # registering twice is harmless
    for name, (base_name, n_layers) in models.REDUCED_DEPTH_FLAVORS.items():
        flavor, base = qwen3_args[name], qwen3_args[base_name]
        assert flavor.n_layers == n_layers < base.n_layers
        assert flavor.max_seq_len >= 16384
        unchanged = {"n_layers", "max_seq_len"}
        for field in dataclasses.fields(base):
            if field.name not in unchanged:
                assert getattr(flavor, field.name) == getattr(base, field.name), field.name
        assert flavor.moe_args is not base.moe_args


# ---------------------------------------------------------------- TOMLs

MODEL_CONFIGS = {
    # stem: (flavor, expert_parallel_degree)
    "debug_moe": ("debugmodel_moe", 2),
    "qwen3_30b_a3b": ("30B-A3B", 8),
    "qwen3_235b_a22b": ("235B-A22B", 8),
    "qwen3_30b_a3b_4l": ("30B-A3B-4L", 2),
    "qwen3_30b_a3b_12l": ("30B-A3B-12L", 2),
    "qwen3_235b_a22b_2l": ("235B-A22B-2L", 2),
}
VARIANT_CONVERTERS = {
    "stock": [],
    "mega_moe": ["mega_moe"],
    "fp8": ["quantize.grouped_mm.float8", "mega_moe"],
}
REDUCED = {"qwen3_30b_a3b_4l", "qwen3_30b_a3b_12l", "qwen3_235b_a22b_2l"}
QWEN3_TOMLS = sorted(CONFIG_DIR / f"{m}_{v}.toml" for m in MODEL_CONFIGS for v in VARIANT_CONVERTERS)
FAMILY_TOMLS = {"llama4_debug_mega_moe.toml", "deepseek_v3_debug_mega_moe.toml"}
"""The other families' debug TOMLs (tests/cpu/test_model_tomls.py)."""


def parse_toml(path: Path, *overrides: str):
    return ConfigManager().parse_args(["--job.config_file", str(path), *overrides])


def test_train_configs_are_exactly_the_expected_set():
    expected = {p.name for p in QWEN3_TOMLS} | FAMILY_TOMLS
    assert {p.name for p in CONFIG_DIR.glob("*.toml")} == expected


@pytest.mark.parametrize("path", QWEN3_TOMLS, ids=lambda p: p.stem)
def test_train_config_parses(path: Path):
    model_stem, variant = next(
        (m, v) for m in MODEL_CONFIGS for v in VARIANT_CONVERTERS if path.stem == f"{m}_{v}"
    )
    config = parse_toml(path)
    flavor, ep = MODEL_CONFIGS[model_stem]
    assert config.job.custom_config_module == "titan_megamoe.config"
    assert config.model.name == "qwen3" and config.model.flavor == flavor
    assert flavor in qwen3_args
    assert config.model.converters == VARIANT_CONVERTERS[variant]
    if variant == "fp8":
        assert config.quantize.grouped_mm.float8.fqns == ["experts"]
    assert (config.mega_moe.precision, config.mega_moe.backend) == ("auto", "auto")
    # Only the reduced 30B-A3B A/Bs keep GEMM1's pre-activations, bf16 and fp8 (full AC holds one layer's).
    reduced = {f"qwen3_30b_a3b_{layers}_{variant}" for layers in ("4l", "12l") for variant in ("mega_moe", "fp8")}
    assert config.mega_moe.save_gemm1 is (path.stem in reduced)
    assert config.training.dataset == data.DATASET_NAME
    assert (REPO / config.model.hf_assets_path).resolve() == Path(data.TOKENIZER_DIR)
    assert config.metrics.log_freq == 1
    assert config.debug.seed is not None
    assert config.parallelism.expert_parallel_degree == ep
    if model_stem != "qwen3_235b_a22b":  # TorchTitan lists 4,096 for it, only a warning past that
        assert config.training.seq_len <= qwen3_args[flavor].max_seq_len
    if model_stem == "debug_moe":
        assert config.training.seq_len <= 2048 and 20 <= config.training.steps <= 50
    if model_stem in REDUCED:
        assert config.parallelism.data_parallel_shard_degree == -1
        assert config.training.seq_len == 16384
        assert config.training.local_batch_size == 1
        assert config.activation_checkpoint.mode == "full"
        assert config.training.steps == 20


def test_converters_override_from_the_command_line():
    # TorchTitan's list[str] rule: one comma-separated argument.
    path = CONFIG_DIR / "debug_moe_fp8.toml"
    assert parse_toml(path, "--model.converters=quantize.grouped_mm.float8").model.converters == [
        "quantize.grouped_mm.float8"
    ]
    # An empty value gives [""], not [], which is why ab_train.sh writes a stock TOML instead.
    assert parse_toml(path, "--model.converters=").model.converters == [""]


def test_bad_mega_moe_precision_names_field_and_choices(tmp_path: Path):
    text = (CONFIG_DIR / "debug_moe_mega_moe.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('precision = "auto"', 'precision = "fp16"'))
    with pytest.raises(ValueError) as error:
        parse_toml(bad)
    message = str(error.value)
    assert "precision" in message and "fp16" in message
    for choice in PRECISION_CHOICES:
        assert repr(choice) in message


# ---------------------------------------------------------------- A/B scripts

@pytest.mark.parametrize(
    "path", sorted(CONFIG_DIR.glob("*_mega_moe.toml")) + sorted(CONFIG_DIR.glob("*_fp8.toml")),
    ids=lambda p: p.stem,
)
def test_stock_toml_drops_only_mega_moe(path: Path, tmp_path: Path):
    stock = tmp_path / "stock.toml"
    stock.write_text(ab_stock_toml.stock_toml(path.read_text()))
    original, rewritten = parse_toml(path), parse_toml(stock)
    assert rewritten.model.converters == [c for c in original.model.converters if c != "mega_moe"]
    rewritten.model.converters = original.model.converters
    rewritten.job.config_file = original.job.config_file
    # Each parse builds its own merged JobConfig class, so compare values, not instances.
    assert dataclasses.asdict(rewritten) == dataclasses.asdict(original)


def test_stock_toml_refuses_a_toml_without_mega_moe():
    with pytest.raises(ValueError, match="does not contain"):
        ab_stock_toml.stock_toml((CONFIG_DIR / "debug_moe_stock.toml").read_text())


def test_step_line_matches_torchtitan(monkeypatch):
    message = titan_step_message(monkeypatch, 7, 5.12345, 40.5, 7886)
    assert "\x1b[" in message  # colours on, as TorchTitan prints by default
    run = ab_report.parse_log("[titan] 2025-03-01 10:00:00,000 - root - INFO - " + message, "x")
    step = run.steps[7]
    assert (step.loss, step.grad_norm, step.memory_gib, step.tps) == (5.12345, 1.25, 40.5, 7886)


def test_ab_report_numbers(monkeypatch, tmp_path: Path):
    n = 20
    stock_loss = [8.0 - 0.2 * i for i in range(n)]
    mega_loss = [value + (0.01 if i != 11 else -0.05) for i, value in enumerate(stock_loss)]
    stock_tps = [4000.0 + (500 if i % 2 else 0) for i in range(n)]
    stock_log = synthetic_log(monkeypatch, 1.5, stock_loss, [30.0] * 4 + [32.5] + [31.0] * 15, stock_tps)
    mega_log = synthetic_log(monkeypatch, 0.75, mega_loss, [28.0] * n, [8000.0] * n)

    result = ab_report.compare(
        ab_report.parse_log(stock_log, "stock"), ab_report.parse_log(mega_log, "mega_moe"), (6, 20)
    )
    stock, mega = result["runs"]["stock"], result["runs"]["mega_moe"]
    assert stock["step_time_s"] == pytest.approx(1.5) and mega["step_time_s"] == pytest.approx(0.75)
    window_tps = stock_tps[5:20]
    assert stock["tokens_per_s_per_gpu"] == pytest.approx(len(window_tps) / sum(1 / t for t in window_tps))
    assert mega["tokens_per_s_per_gpu"] == pytest.approx(8000.0)
    assert (stock["peak_memory_gib"], mega["peak_memory_gib"]) == (32.5, 28.0)
    assert (stock["final_loss"], mega["final_loss"]) == (pytest.approx(stock_loss[-1], abs=1e-5),
                                                        pytest.approx(mega_loss[-1], abs=1e-5))
    assert result["speedup"] == pytest.approx(2.0)
    assert result["max_abs_loss_diff"] == pytest.approx(0.05, abs=1e-5)
    assert result["max_abs_loss_diff_step"] == 12

    (tmp_path / "stock.log").write_text(stock_log)
    (tmp_path / "mega_moe.log").write_text(mega_log)
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "ab_report.py"), "--stock", str(tmp_path / "stock.log"),
         "--mega-moe", str(tmp_path / "mega_moe.log"), "--out", str(tmp_path / "report")],
        capture_output=True, text=True, check=True,
    )
    assert "2.000x" in done.stdout and "| stock | 1500.0 |" in done.stdout
    assert {"ab.json", "ab.md"} <= {p.name for p in (tmp_path / "report").iterdir()}
    assert (tmp_path / "report" / "loss.png").exists() or "loss.png skipped" in done.stdout


def test_ab_report_rejects_a_too_short_run(monkeypatch, tmp_path: Path):
    short = synthetic_log(monkeypatch, 1.0, [5.0] * 12, [1.0] * 12, [100.0] * 12)
    full = synthetic_log(monkeypatch, 1.0, [5.0] * 20, [1.0] * 20, [100.0] * 20)
    with pytest.raises(ab_report.LogError, match=r"training.steps = 12"):
        ab_report.compare(ab_report.parse_log(full, "stock"), ab_report.parse_log(short, "mega_moe"), (6, 20))
    crashed = synthetic_log(monkeypatch, 1.0, [5.0] * 12, [1.0] * 12, [100.0] * 12, total_steps=20)
    with pytest.raises(ab_report.LogError, match=r"stopped after step 12"):
        ab_report.compare(ab_report.parse_log(full, "stock"), ab_report.parse_log(crashed, "mega_moe"), (6, 20))
    # A smaller window fits the short run.
    ab_report.compare(ab_report.parse_log(full, "stock"), ab_report.parse_log(short, "mega_moe"), (6, 12))

    (tmp_path / "stock.log").write_text(full)
    (tmp_path / "mega_moe.log").write_text(short)
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "ab_report.py"), "--stock", str(tmp_path / "stock.log"),
         "--mega-moe", str(tmp_path / "mega_moe.log")],
        capture_output=True, text=True,
    )
    assert done.returncode != 0
    assert "mega_moe" in done.stderr and "window 6-20" in done.stderr

"""TorchTitan 0.3.0 plumbing on CPU: the shipped config module, the reduced-depth flavors,
the adapter's version check, the A/B report on 0.3.0's step line, and what the 0.3.0
A/B script refuses before it writes anything."""

import functools
import importlib
import inspect
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import torchtitan.components.metrics as titan_metrics
import torchtitan.components.quantization.float8 as titan_float8
from torchtitan.config import ConfigManager
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.models.qwen3 import model_registry, qwen3_configs
from torchtitan.tools.utils import Color

from script_modules import load_script
from titan_logs import synthetic_log
from titan_megamoe import data, titan_version
from titan_megamoe.torchtitan03 import config_registry, flavors, MegaRoutedExperts

REPO = Path(__file__).resolve().parents[2]
CONFIG_MODULE = "titan_megamoe.torchtitan03.config_registry"

ab_report = load_script("ab_report")


# ---------------------------------------------------------------- config module

EXPECTED_MODELS = {
    # name: (flavor, expert_parallel_degree)
    "debug_moe": ("debugmodel_moe", 2),
    "qwen3_30b_a3b": ("30B-A3B", 8),
    "qwen3_235b_a22b": ("235B-A22B", 8),
    "qwen3_30b_a3b_4l": ("30B-A3B-4L", 2),
    "qwen3_30b_a3b_12l": ("30B-A3B-12L", 2),
    "qwen3_235b_a22b_2l": ("235B-A22B-2L", 2),
}
REDUCED = {"qwen3_30b_a3b_4l", "qwen3_30b_a3b_12l", "qwen3_235b_a22b_2l"}


def test_config_module_has_a_function_per_model_and_variant():
    functions = {name for name, f in inspect.getmembers(config_registry, inspect.isfunction)
                 if f.__module__ == CONFIG_MODULE and name != "trainer_config"}
    assert set(config_registry.MODELS) == set(EXPECTED_MODELS)
    assert functions == {f"{m}_{v}" for m in EXPECTED_MODELS for v in config_registry.VARIANTS}


@pytest.mark.parametrize("model", sorted(EXPECTED_MODELS))
@pytest.mark.parametrize("variant", config_registry.VARIANTS)
def test_config_parses_as_torchtitan_loads_it(model, variant, monkeypatch):
    # Float8GroupedExpertsConverter refuses a host without SM89 when built.
    monkeypatch.setattr(titan_float8, "has_cuda_capability", lambda *_: True)
    config = ConfigManager().parse_args(["--module", CONFIG_MODULE, "--config", f"{model}_{variant}",
                                         "--training.steps", "7"])
    flavor, ep = EXPECTED_MODELS[model]
    assert config.training.steps == 7  # the command line still overrides
    assert config.model_spec.name == "qwen3" and config.model_spec.flavor == flavor
    layers = [c for _, c, _, _ in config.model_spec.model.traverse(RoutedExperts.Config)]
    assert layers
    mega_moe = [c for c in layers if isinstance(c, MegaRoutedExperts.Config)]
    assert len(mega_moe) == (0 if variant == "stock" else len(layers))
    for layer in mega_moe:
        assert (layer.section.precision, layer.section.backend) == ("auto", "auto")
        assert layer.section.save_gemm1 is (variant != "stock" and model in {"qwen3_30b_a3b_4l", "qwen3_30b_a3b_12l"})
        assert layer.auto_precision[0] == ("fp8" if variant == "fp8" else "bf16")
    assert config.dataloader.dataset == data.DATASET_NAME
    assert config.hf_assets_path == data.TOKENIZER_DIR
    assert config.metrics.log_freq == 1
    assert config.debug.seed is not None
    assert config.training.disable_cuda_graphs
    assert config.parallelism.expert_parallel_degree == ep
    assert config.training.seq_len <= config.model_spec.model.max_seq_len
    if model == "debug_moe":
        assert config.training.seq_len <= 2048
        assert isinstance(config.activation_checkpoint, SelectiveAC.Config)
    if model in REDUCED:
        assert config.parallelism.data_parallel_shard_degree == -1
        assert (config.training.seq_len, config.training.local_batch_size) == (16384, 1)
        assert isinstance(config.activation_checkpoint, FullAC.Config)


# ---------------------------------------------------------------- flavors

def same_config(a, b) -> bool:
    def printed(configs) -> str:
        return re.sub(r" at 0x[0-9a-f]+", "", str([c.to_dict() for c in configs]))

    return printed(a) == printed(b)


def test_reduced_flavors_keep_the_base_layers():
    assert flavors.REDUCED_DEPTH_FLAVORS == {
        "30B-A3B-4L": ("30B-A3B", 4),
        "30B-A3B-12L": ("30B-A3B", 12),
        "235B-A22B-2L": ("235B-A22B", 2),
    }
    importlib.reload(flavors)  # registering twice is harmless
    for name, (base_name, n_layers) in flavors.REDUCED_DEPTH_FLAVORS.items():
        assert name in qwen3_configs
        reduced, base = model_registry(name).model, model_registry(base_name).model
        assert len(reduced.layers) == n_layers < len(base.layers)
        # Layer configs hold initializers (closures), equal only in what they print.
        assert same_config(reduced.layers, base.layers[:n_layers])
        assert reduced.max_seq_len >= 16384
        for field in ("dim", "vocab_size", "norm", "tok_embeddings", "lm_head"):
            assert getattr(reduced, field) == getattr(base, field), field


# ---------------------------------------------------------------- version check

def test_adapters_name_what_to_install(monkeypatch):
    monkeypatch.setattr(titan_version, "installed", lambda: None)
    with pytest.raises(ImportError, match=r"titan_megamoe.torchtitan03 serves TorchTitan 0.3.0, which is not "
                                          r"installed: pip install 'titan-megamoe\[torchtitan030\]'"):
        titan_version.require("0.3", "titan_megamoe.torchtitan03")
    with pytest.raises(ImportError, match=r"install one of 0.2.2 \(torchtitan022\), 0.3.0 \(torchtitan030\)"):
        titan_version.installed_series()
    monkeypatch.setattr(titan_version, "installed", lambda: "0.3.0")
    with pytest.raises(ImportError, match=r"titan_megamoe.registry serves TorchTitan 0.2.2, but TorchTitan 0.3.0 is "
                                          r"installed: use titan_megamoe.torchtitan03 with it, or pip install "
                                          r"'titan-megamoe\[torchtitan022\]'"):
        titan_version.require("0.2", "titan_megamoe.registry")
    monkeypatch.setattr(titan_version, "installed", lambda: "0.4.0")
    with pytest.raises(ImportError, match="has no adapter for TorchTitan 0.4.0"):
        titan_version.installed_series()


def test_importing_a_0_2_2_adapter_module_says_what_to_use():
    done = subprocess.run([sys.executable, "-c", "import titan_megamoe.converter"], capture_output=True, text=True,
                          cwd=REPO)
    assert done.returncode != 0
    assert ("ImportError: titan_megamoe.converter serves TorchTitan 0.2.2, but TorchTitan 0.3.0 is installed: use "
            "titan_megamoe.torchtitan03 with it") in done.stderr


# ---------------------------------------------------------------- A/B report

def titan03_step_message(monkeypatch, step, loss, memory_gib, tps, quantized):
    """The line TorchTitan 0.3.0's own MetricsProcessor.log prints, from stubbed inputs."""
    monkeypatch.setattr(titan_metrics.time, "perf_counter", lambda: 2.0)
    processor = titan_metrics.MetricsProcessor.__new__(titan_metrics.MetricsProcessor)
    processor.config = SimpleNamespace(log_freq=1)
    processor.num_flops_per_token = 6e9
    processor.gpu_peak_flops = 989e12
    processor.has_quantization = quantized
    processor.parallel_dims = SimpleNamespace(non_data_parallel_size=1)
    processor.time_last_log = 0.0
    processor.ntokens_since_last_log = int(tps * 2.0)
    processor.data_loading_times = [0.01]
    stats = titan_metrics.DeviceMemStats(memory_gib, 10.0, memory_gib, 25.0, 0, 0)
    processor.device_memory_monitor = SimpleNamespace(get_peak_stats=lambda: stats, reset_peak_stats=lambda: None)
    processor.logger = SimpleNamespace(log=lambda metrics, step: None)
    processor.color = Color()
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        processor.log(step, loss, loss, 1.25)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    (message,) = records
    return message


@pytest.mark.parametrize("quantized", [False, True])
def test_ab_report_reads_the_0_3_0_step_line(quantized, monkeypatch):
    message = titan03_step_message(monkeypatch, 7, 5.12345, 40.5, 7886, quantized)
    assert ("mfu: N/A" in message) is quantized
    run = ab_report.parse_log("[rank0]:[titan] 2026-09-01 10:00:00,000 - root - INFO - " + message, "x")
    step = run.steps[7]
    assert (step.loss, step.grad_norm, step.memory_gib, step.tps) == (5.12345, 1.25, 40.5, 7886)


# ---------------------------------------------------------------- A/B script

STOCK_TWIN = "--override.imports titan_megamoe.torchtitan03.overrides.stock_routed_experts"


def _fake_gpu_repo(tmp_path: Path, logs: Path) -> Path:
    """A copy of the 0.3.0 A/B scripts whose run_train.sh passes the GPU check and whose
    launcher records what it was asked to run and prints the log in ``logs`` of that run
    (mega_moe.log, stock.log or stock_bf16.log)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("ab_train_torchtitan03.sh", "ab_runs.sh", "ab_report.py"):
        shutil.copy(REPO / "scripts" / name, repo / "scripts" / name)
    (repo / "scripts" / "run_train.sh").write_text("#!/usr/bin/env bash\nexit 0\n")
    (repo / "scripts" / "run_train_torchtitan03.sh").write_text(f"""#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$(dirname "$0")/launches"
case "$*" in
    *drop_quantize*) cat {logs}/stock_bf16.log ;;
    *stock_routed_experts*) cat {logs}/stock.log ;;
    *) cat {logs}/mega_moe.log ;;
esac
""")
    for script in (repo / "scripts").glob("*.sh"):
        script.chmod(0o755)
    return repo


def _env(**extra) -> dict:
    # The scripts run `python`: this interpreter.
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **extra}


def test_ab_script_refuses_a_config_without_mega_moe_before_writing(tmp_path):
    repo = _fake_gpu_repo(tmp_path, tmp_path)
    done = subprocess.run([str(repo / "scripts" / "ab_train_torchtitan03.sh")], capture_output=True, text=True,
                          env=_env(CONFIG="debug_moe_stock", AB_OUT=str(tmp_path / "ab")), timeout=300)
    assert done.returncode != 0
    assert f"{CONFIG_MODULE}.debug_moe_stock: its model lists no MegaMoEConverter" in done.stderr
    assert not (tmp_path / "ab").exists() and not (repo / "scripts" / "launches").exists()


def test_ab_script_trains_mega_moe_then_its_stock_twins(monkeypatch, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for name, step_time_s in (("mega_moe", 0.5), ("stock", 1.0), ("stock_bf16", 0.75)):
        log = synthetic_log(monkeypatch, step_time_s, [5.0 - 0.1 * i for i in range(20)], [1.0] * 20, [100.0] * 20,
                            step_message=functools.partial(titan03_step_message, quantized=False))
        (logs / f"{name}.log").write_text(log)
    repo = _fake_gpu_repo(tmp_path, logs)
    out = tmp_path / "ab"
    done = subprocess.run([str(repo / "scripts" / "ab_train_torchtitan03.sh"), "--training.steps", "20"],
                          capture_output=True, text=True, timeout=300,
                          env=_env(CONFIG="debug_moe_mega_moe", AB_OUT=str(out), AB_STOCK_BF16="1"))
    assert done.returncode == 0, done.stderr
    launches = (repo / "scripts" / "launches").read_text().splitlines()
    assert launches == [
        f"--dump_folder {out / 'mega_moe'} --training.steps 20",
        f"--dump_folder {out / 'stock'} {STOCK_TWIN} --training.steps 20",
        f'--dump_folder {out / "stock_bf16"} {STOCK_TWIN}={{"drop_quantize": true}} --training.steps 20',
    ]
    args = (out / "mega_moe.args").read_text()
    assert f"MODULE={CONFIG_MODULE}" in args and "CONFIG=debug_moe_mega_moe" in args
    assert {"ab.json", "ab.md", "mega_moe.log", "stock.log", "stock_bf16.log"} <= {p.name for p in out.iterdir()}
    assert "2.000x" in done.stdout  # mega_moe against stock


def test_ab_script_rejects_a_bad_ab_stock_bf16(tmp_path):
    done = subprocess.run([str(REPO / "scripts" / "ab_train_torchtitan03.sh")], capture_output=True, text=True,
                          env=_env(CONFIG="debug_moe_mega_moe", AB_STOCK_BF16="yes"), timeout=60)
    assert done.returncode != 0 and "AB_STOCK_BF16=yes is not valid" in done.stderr


def test_run_script_needs_gpus():
    done = subprocess.run([str(REPO / "scripts" / "run_train_torchtitan03.sh")], capture_output=True, text=True,
                          env=_env(CUDA_VISIBLE_DEVICES="", NGPU="2"), timeout=120)
    assert done.returncode != 0 and "training needs NVIDIA GPUs" in done.stderr

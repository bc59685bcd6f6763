"""The README's commands on a machine without a GPU: bench_layer's argument checks, the
variants that need a GPU left out there with a line saying which, its CPU A/B (first
line at once, progress, a table without empty columns; no speedup, rate or plot, and a
header and summary saying its timings say nothing about GPU speed; each run's files in a
new folder; a GPU run's titled plot),
the training scripts refusing at once, the training A/B's stock TOMLs, its report of
two or three runs and its optional stock_bf16 run, and every SM90 kernel compiled here
fitting the GPU's shared memory."""

import json
import os
import re
import selectors
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from titan_megamoe.precision import PRECISION_CHOICES

from script_modules import load_script
from titan_logs import synthetic_log

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
# Every subprocess sees no GPU, so these tests take the CPU paths on any machine.
NO_GPU_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


ab_report = load_script("ab_report")
ab_stock_toml = load_script("ab_stock_toml")
bench_layer = load_script("bench_layer")
profile_layer = load_script("profile_layer")
sm_sharing = load_script("sm_sharing")


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--tokens", "-5"], ["--tokens", "'-5'"]),
        (["--tokens", "4096,lots"], ["--tokens", "'lots'"]),
        (["--tokens", "0"], ["--tokens", "'0'"]),
        (["--iters", "0"], ["--iters", "'0'"]),
        (["--warmup", "-1"], ["--warmup", "'-1'"]),
        (["--comm-sms", "-3"], ["--comm-sms", "'-3'"]),
        (["--reserved-sms", "many"], ["--reserved-sms", "'many'"]),
        (["--save-gemm1-load", "0"], ["--save-gemm1-load", "'0'"]),
        (["--shapes", "debug,30B"], ["--shapes", "'30B'"]),
        (["--shapes", "debug,debug"], ["--shapes", "'debug' is given twice"]),
        (["--variants", "stock,mega"], ["--variants", "'mega'"]),
        (["--precision", "fp4"], ["--precision", "'fp4'"]),
        (["--backend", "magic"], ["--backend", "'magic'"]),
        (["--capacity-factor", "0"], ["--capacity-factor", "'0'"]),
        (["--receive-load", "-1"], ["--receive-load", "'-1' is not a number >= 0"]),
        # The fused backend cannot run on the CPU: refused with the reason, before any rank starts.
        (["--backend", "fused"], ["--backend fused", "cannot run here"]),
        # Variants that need a GPU are left out on the CPU (below): refused only where none is left.
        (["--variants", "stock_compiled,stock_fp8"],
         ["--variants: none of them runs without a GPU", "stock_compiled needs a GPU",
          "stock_fp8 needs an NVIDIA GPU of compute capability >= 8.9", "none is visible here"]),
        (["--variants", "mega_moe_bf16,mega_moe"],
         ["--variants: mega_moe_bf16 sets a quantized --precision against bf16", "--precision bf16"]),
    ],
)
def test_bench_layer_bad_arguments_name_the_value(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_layer.parse_args(CPU, argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert "error: " in error
    for text in named:
        assert text in error, error


def test_bench_layer_refuses_stock_fp8_below_sm89(monkeypatch, capsys):
    """TorchTitan's float8 grouped-MM converter refuses below compute capability 8.9: so
    does the launcher, before any rank starts (the GPU is faked; nothing touches CUDA)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SystemExit) as exit_info:
        bench_layer.parse_args(torch.device("cuda", 0), ["--variants", "stock,stock_fp8"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert "--variants: stock_fp8 needs an NVIDIA GPU of compute capability >= 8.9" in error, error
    assert "NVIDIA A100-SXM4-80GB is 8.0" in error, error


def test_bench_layer_precision_choices_are_the_configs(capsys):
    with pytest.raises(SystemExit):
        bench_layer.parse_args(CPU, ["--precision", "fp4"])
    offered = capsys.readouterr().err.splitlines()[-1].partition("choose from")[2]
    assert [name.strip(" '()") for name in offered.split(",")] == list(PRECISION_CHOICES)
    for name in PRECISION_CHOICES:
        args, _ = bench_layer.parse_args(CPU, ["--precision", name, "--backend", "reference"])
        assert args.precision_name == ("bf16" if name == "auto" else name)


def test_bench_layer_cpu_defaults_and_backend_resolution():
    args, note = bench_layer.parse_args(CPU, ["--variants", "stock,mega_moe"])
    assert (args.shapes, args.tokens, args.resolved_backend) == (["debug"], [256], "reference")
    assert note.startswith("[bench_layer] no NVIDIA GPU visible: running a small CPU A/B instead")
    assert "(mega_moe backend reference, chosen for the CPU). CPU timings say nothing about GPU speed" in note
    assert "./scripts/bench_layer.sh --variants stock,mega_moe" in note
    # The reference backend is the CPU's choice, unless asked for.
    assert args.backend_reason.startswith("chosen for the CPU: the fused kernels need an NVIDIA GPU")
    args, note = bench_layer.parse_args(CPU, ["--backend", "reference"])
    assert args.backend_reason == "asked for" and "(mega_moe backend reference)" in note
    # Explicit rows run as asked, without the note.
    args, note = bench_layer.parse_args(CPU, ["--shapes", "debug", "--tokens", "64"])
    assert note is None
    # auto never picks the reference backend; as if the EP group spanned nodes it says why not fused.
    args, _ = bench_layer.parse_args(CPU, ["--backend", "auto", "--ep-spans-nodes"])
    assert args.resolved_backend == "stock"
    assert "fused" in args.backend_reason and "spans nodes" in args.backend_reason


@pytest.mark.parametrize(
    "argv, runs",
    [(["--variants", "stock,stock_fp8,mega_moe_bf16,mega_moe", "--precision", "fp8"],
      ["stock", "mega_moe_bf16", "mega_moe"]),
     (["--variants", "stock,stock_compiled,stock_fp8,mega_moe", "--shapes", "debug", "--tokens", "64"],
      ["stock", "mega_moe"])],
)
def test_bench_layer_leaves_out_gpu_only_variants_on_the_cpu_and_says_which(argv, runs):
    """A command written for GPUs runs on the CPU: the variants that need a GPU are left
    out, and a line names each and why, whether or not the CPU defaults replace the rows."""
    args, note = bench_layer.parse_args(CPU, argv)
    assert args.variants == runs
    assert len(note.splitlines()) == (2 if "--shapes" not in argv else 1), note
    left_out = note.splitlines()[-1]
    assert left_out.startswith(f"[bench_layer] no NVIDIA GPU visible: running {', '.join(runs)}, leaving out "), note
    assert "stock_fp8 needs an NVIDIA GPU of compute capability >= 8.9 (fp8 grouped GEMMs); none is visible here." \
        in left_out
    assert ("stock_compiled needs a GPU" in left_out) is ("stock_compiled" in argv[1])
    # The ranks get the variants that run, and say nothing more of those left out.
    again, note = bench_layer.parse_args(CPU, bench_layer.worker_argv(args))
    assert again.variants == runs and note is None


def test_bench_layer_readme_commands_run_on_the_cpu():
    """Every ./scripts/bench_layer.sh command of the README's shell blocks is accepted as
    written on a machine without a GPU."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    commands = [line for block in blocks for line in block.splitlines() if line.startswith("./scripts/bench_layer.sh")]
    assert commands
    for command in commands:
        args, note = bench_layer.parse_args(CPU, shlex.split(command.partition("#")[0])[1:])
        assert args.variants and "stock_fp8" not in args.variants, command
        assert note.startswith("[bench_layer] no NVIDIA GPU visible: running a small CPU A/B instead"), note


def test_each_bench_run_writes_a_new_folder(monkeypatch, tmp_path):
    """Two runs, even in the same second, never write into one folder."""
    monkeypatch.setattr(bench_layer.time, "strftime", lambda fmt: "20260101-120000")
    first, second = (bench_layer.new_run_folder(tmp_path / "bench") for _ in range(2))
    assert (first.name, second.name) == ("20260101-120000", "20260101-120000-2")
    assert first.is_dir() and second.is_dir()


@pytest.mark.parametrize("backend", [[], ["--backend", "reference"]])
def test_bench_layer_launcher_passes_what_it_resolved(backend):
    args, _ = bench_layer.parse_args(CPU, ["--tokens", "64", "--forward-only", "--ep-spans-nodes",
                                           "--save-gemm1", "--save-gemm1-load", "0.5", "--memory",
                                           "--reserved-sms", "8", "--capacity-factor", "3", "--receive-load", "0",
                                           *backend])
    again, note = bench_layer.parse_args(CPU, bench_layer.worker_argv(args))
    assert note is None  # the ranks do not repeat the launcher's first line
    assert vars(again) == vars(args)  # the reason for the backend included


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--tokens", "0"], "'0'"),
        (["--iters", "-1"], "'-1'"),
        (["--comm-sms", "8,x"], "'x'"),
        (["--tiles", "", "gemm2_n=128,stages=3"], "'stages'"),
        (["--tiles", "gemm2_n=big"], "'gemm2_n=big'"),
        (["--save-gemm1-load", "many"], "'many'"),
        (["--capacity-factor", "0"], "'0'"),
        (["--receive-load", "-1"], "'-1'"),
    ],
)
def test_profile_layer_bad_arguments_name_the_value(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        profile_layer.parse_args(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert f"argument {argv[0]}" in error and named in error, error


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--reserved-sms", "0,x"], "'x' is not a number of SMs"),
        (["--reserved-sms", "-1"], "'-1' is not a number of SMs"),
        (["--stand-in-us", "0"], "'0'"),
        (["--gather-mib", "-4"], "'-4'"),
    ],
)
def test_sm_sharing_bad_arguments_name_the_value(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sm_sharing.parse_args(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert f"argument {argv[0]}" in error and named in error, error


def test_profile_layer_says_it_needs_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["profile_layer.py", "--tokens", "64"])
    with pytest.raises(SystemExit) as exit_info:
        profile_layer.main()
    assert "need NVIDIA GPUs" in str(exit_info.value.code)


def test_profile_layer_counts_each_stage_against_the_peak():
    """30B-A3B at 16,384 tokens x top-8: 9.44 MFLOP per routed row forward (DESIGN), each
    fused kernel's share as its mainloops compute it, and rates against the peak."""
    rows, hidden, inter = 131072, 2048, 768
    unit = 2 * rows * hidden * inter
    forward = profile_layer.stage_flops(rows, hidden, inter, backward=False, save_gemm1=True)
    assert forward == {"dispatch_gemm1_kernel": 2 * unit, "rows_gemm_combine_kernel": unit}
    assert sum(forward.values()) / rows == pytest.approx(9.437e6, rel=1e-3)
    saved = profile_layer.stage_flops(rows, hidden, inter, backward=True, save_gemm1=True)
    recomputed = profile_layer.stage_flops(rows, hidden, inter, backward=True, save_gemm1=False)
    assert saved["rows_gemm_combine_kernel"] == 3 * unit and saved["wgrad_kernel"] == 3 * unit
    assert (saved["dispatch_grad_gemm1_kernel"], recomputed["dispatch_grad_gemm1_kernel"]) == (unit, 3 * unit)
    # GEMM2 on the Gluon core, dgrad on the tl kernel (bf16's row), then both on the core.
    split = profile_layer.stage_flops(rows, hidden, inter, True, True, rows_kernels=("gluon", "tl"))
    assert (split["grouped_gemm_kernel"], split["rows_gemm_combine_kernel"]) == (unit, 2 * unit)
    both = profile_layer.stage_flops(rows, hidden, inter, True, True, rows_kernels=("gluon", "gluon"))
    assert both["grouped_gemm_kernel"] == 3 * unit and "rows_gemm_combine_kernel" not in both
    # The weight gradients on the Gluon core grouped along the tokens (fp8's row).
    gluon_wgrad = profile_layer.stage_flops(rows, hidden, inter, True, True, wgrad_kernel="gluon")
    assert gluon_wgrad["token_grouped_gemm_kernel"] == 3 * unit and "wgrad_kernel" not in gluon_wgrad
    # GEMM1 and the backward's first kernel on the core; the latter only where GEMM1 was saved.
    cores = [profile_layer.stage_flops(rows, hidden, inter, True, save, gemm1_kernel="gluon", grad1_kernel="gluon")
             for save in (True, False)]
    assert cores[0]["gate_up_gemm_kernel"] == 2 * unit and "dispatch_gemm1_kernel" not in cores[0]
    assert cores[0]["swiglu_grad_gemm_kernel"] == unit and "dispatch_grad_gemm1_kernel" not in cores[0]
    assert cores[1]["dispatch_grad_gemm1_kernel"] == 3 * unit and "swiglu_grad_gemm_kernel" not in cores[1]
    # 1.24 TFLOP forward at 792 TFLOP/s: 1.56 ms; fwd+bwd three times that.
    assert profile_layer.roofline_ms(rows, hidden, inter, False, 792.0) == pytest.approx(1.563, rel=1e-3)
    assert profile_layer.roofline_ms(rows, hidden, inter, True, 792.0) == pytest.approx(3 * 1.563, rel=1e-3)
    lines = profile_layer.kernel_lines({"dispatch_gemm1_kernel": 2.0, "combine_reduce_kernel": 0.5}, forward, 1000.0)
    assert lines[0].split() == ["2.000", "ms", "dispatch_gemm1_kernel", "(412", "TFLOP/s,", "41%", "of", "peak)"]
    assert lines[1].split() == ["0.500", "ms", "combine_reduce_kernel"]
    assert "% of peak" not in profile_layer.kernel_lines({"dispatch_gemm1_kernel": 2.0}, forward, None)[0]


def test_memory_at_peak_finds_the_blocks_live_then():
    """An allocator trace: the peak is the largest sum of live blocks over time (from
    the bytes allocated before), the blocks live then are the ones listed, a block freed
    before the peak is not, and each is named by this project's innermost frame."""
    ours = {"filename": str(REPO / "titan_megamoe" / "kernels" / "backward.py"), "line": 7, "name": "fused_backward"}
    torch_frame = {"filename": "/usr/lib/python3/site-packages/torch/functional.py", "line": 3, "name": "empty"}
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [torch_frame, ours]},
        {"action": "alloc", "addr": 2, "size": 200, "frames": [torch_frame]},
        {"action": "free_requested", "addr": 2, "size": 200},
        {"action": "free_completed", "addr": 2, "size": 200},
        {"action": "alloc", "addr": 3, "size": 250, "frames": []},
        {"action": "alloc", "addr": 4, "size": 10, "frames": [ours]},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 5, "size": 50, "frames": []},
    ]
    peak, live = bench_layer.live_at_peak(trace, baseline=1000)
    assert peak == 1000 + 100 + 250 + 10
    assert sorted(b["addr"] for b in live) == [1, 3, 4]
    assert bench_layer.allocation_site([torch_frame, ours]) == "backward.py:7 fused_backward"
    assert bench_layer.allocation_site([torch_frame]) == "functional.py:3 empty"
    assert bench_layer.allocation_site([]) == "(no Python frame)"


# ---------------------------------------------------------------- table and plot


def _result(forward_only: bool, ms: float) -> dict:
    result = {"forward_ms": ms, "forward_tflops": 0.01}
    if not forward_only:
        result.update(backward_ms=2 * ms, fwd_bwd_ms=3 * ms)
    return result


def _cpu_rows(forward_only: bool, variants) -> list[dict]:
    rows = []
    for tokens in (64, 128):
        row = {"shape": "debug", "tokens_per_rank": tokens, "ep": 2}
        row.update({v: _result(forward_only, 10.0 + i) for i, v in enumerate(variants)})
        # As bench_row measures them: every variant after stock against stock.
        keys = ("y",) if forward_only else ("y", "dx", "dgate", "dw1", "dw2", "dw3")
        for v in variants:
            if "stock" in row and v != "stock":
                row[v]["rel_err_vs_stock"] = dict.fromkeys(keys, 1e-7)
        row["speedup"] = bench_layer.speedups(row)
        rows.append(row)
    return rows


def _meta(forward_only: bool, variants, gpu: bool = False) -> dict:
    """What ``run`` records: on the CPU as the main job runs it, or on a GPU."""
    if gpu:
        where = {"device": "NVIDIA H200", "gpu_timings": True, "dist_backend": "nccl", "dtype": "bfloat16",
                 "backend": "fused", "backend_reason": "auto", "matmul_peak_tflops": 790.0}
    else:
        where = {"device": "cpu", "gpu_timings": False, "dist_backend": "gloo", "dtype": "float32",
                 "backend": "reference", "backend_reason": bench_layer.CPU_BACKEND_REASON, "matmul_peak_tflops": None}
    return {
        **where, "ep": 2, "shapes": ["debug"], "tokens": [64, 128], "variants": list(variants),
        "precision": "bf16", "precision_requested": "bf16", "ep_spans_nodes": False, "comm_sms": 0,
        "reserved_sms": 0, "capacity_factor": 1, "receive_load": 2.0, "save_gemm1": False, "save_gemm1_load": 1.25,
        "forward_only": forward_only, "iters": 3, "warmup": 1,
    }


def table_cells(markdown: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return split[0], split[2:]


def assert_no_empty_column(markdown: str) -> list[str]:
    header, rows = table_cells(markdown)
    assert rows and all(len(r) == len(header) for r in rows)
    for i, name in enumerate(header):
        assert any(r[i] not in ("", "-") for r in rows), f"column {name!r} is empty:\n{markdown}"
    return header


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize(
    "variants",
    [("stock", "mega_moe"), ("stock",), ("mega_moe",), ("stock", "stock_fp8"), ("stock", "stock_fp8", "mega_moe"),
     ("stock", "mega_moe_bf16", "mega_moe")],
)
def test_markdown_has_no_empty_columns(forward_only, variants):
    markdown = bench_layer.markdown(_cpu_rows(forward_only, variants), _meta(forward_only, variants, gpu=True))
    header = assert_no_empty_column(markdown)
    assert not any("compiled" in h or "peak GiB" in h for h in header)
    assert any("bwd" in h for h in header) is not forward_only
    assert any("fp8" in h for h in header) is ("stock_fp8" in variants)
    assert any("speedup vs stock fp8" in h for h in header) is ("stock_fp8" in variants and "mega_moe" in variants)
    assert any("speedup vs mega bf16" in h for h in header) is ("mega_moe_bf16" in variants)


@pytest.mark.parametrize("forward_only", [False, True])
def test_cpu_table_states_no_speed(forward_only):
    """A CPU run's table, even with speedups in its rows: times and errors, no speedup or
    rate, under a line saying its timings say nothing about GPU speed; what ran names the
    backend as chosen for the CPU and says that precision bf16 computes in float32."""
    variants = ("stock", "mega_moe")
    markdown = bench_layer.markdown(_cpu_rows(forward_only, variants), _meta(forward_only, variants))
    header = assert_no_empty_column(markdown)
    assert "stock fwd ms" in header and any("max rel err vs stock" in h for h in header)
    assert not any("speedup" in h or "TFLOP/s" in h for h in header), header
    assert "x |" not in markdown
    title, _, caveat = markdown.splitlines()[:3]
    assert caveat.startswith("CPU timings say nothing about GPU speed")
    assert ("cpu x2 (gloo, EP=2); weights and activations float32 in every variant; mega_moe backend reference "
            "(chosen for the CPU: ") in title
    assert "precision bf16: GEMMs unquantized, in float32" in title


def test_table_states_mega_over_stock_fp8_and_its_error():
    """A 2-GPU fp8 row as bench_row leaves it: mega_moe's speedups over stock and over
    stock_fp8 for each pass, and stock_fp8's error against stock next to mega's."""
    keys = ("y", "dx", "dgate", "dw1", "dw2", "dw3")
    row = {
        "shape": "30B-A3B", "tokens_per_rank": 4096, "ep": 2,
        "stock": {"forward_ms": 4.0, "backward_ms": 8.0, "fwd_bwd_ms": 12.0},
        "stock_fp8": {"forward_ms": 3.0, "backward_ms": 9.0, "fwd_bwd_ms": 12.0,
                      "rel_err_vs_stock": dict.fromkeys(keys, 0.03)},
        "mega_moe": {"forward_ms": 1.5, "backward_ms": 6.0, "fwd_bwd_ms": 7.5, "forward_tflops": 500.0,
                     "rel_err_vs_stock": dict.fromkeys(keys, 0.02)},
    }
    row["speedup"] = bench_layer.speedups(row)
    assert row["speedup"] == pytest.approx({
        "forward_vs_stock": 4 / 1.5, "backward_vs_stock": 8 / 6, "fwd_bwd_vs_stock": 12 / 7.5,
        "forward_vs_stock_fp8": 2.0, "backward_vs_stock_fp8": 1.5, "fwd_bwd_vs_stock_fp8": 1.6,
    })
    meta = {**_meta(False, ("stock", "stock_fp8", "mega_moe"), gpu=True), "precision": "fp8",
            "backend": "stock", "shapes": ["30B-A3B"], "tokens": [4096]}
    markdown = bench_layer.markdown([row], meta)
    header = assert_no_empty_column(markdown)
    cells = dict(zip(header, table_cells(markdown)[1][0]))
    # pass, stock fp8 ms, speedup vs stock, speedup vs stock fp8
    expected = [("fwd", "3.00", "2.67x", "2.00x"), ("bwd", "9.00", "1.33x", "1.50x"),
                ("fwd+bwd", "12.00", "1.60x", "1.60x")]
    for short, fp8_ms, vs_stock, vs_fp8 in expected:
        assert cells[f"stock fp8 {short} ms"] == fp8_ms
        assert cells[f"{short} speedup vs stock"] == vs_stock
        assert cells[f"{short} speedup vs stock fp8"] == vs_fp8
        # Next to the speedup over stock.
        assert header.index(f"{short} speedup vs stock fp8") == header.index(f"{short} speedup vs stock") + 1
    errors = "(y, dx, dgate, dw1, dw2, dw3)"
    assert cells[f"stock fp8 max rel err vs stock {errors}"] == ", ".join(["3.0e-02"] * 6)
    assert cells[f"mega max rel err vs stock {errors}"] == ", ".join(["2.0e-02"] * 6)
    assert not any("compiled" in h for h in header)


@pytest.mark.parametrize("variants", [("stock", "mega_moe"), ("stock", "stock_fp8", "mega_moe")])
def test_plot_title_names_device_ep_shapes_and_precision(variants, tmp_path):
    meta = _meta(False, variants, gpu=True)
    title = bench_layer.plot_title(meta)
    for text in ("NVIDIA H200", "EP=2", "debug", "bf16", "fused"):
        assert text in title
    pytest.importorskip("matplotlib")
    from PIL import Image

    path = tmp_path / "bench_layer.png"
    assert bench_layer.plot(_cpu_rows(False, meta["variants"]), meta, path) == f"wrote {path}"
    with Image.open(path) as image:
        assert image.text["Title"] == title


def test_cpu_run_draws_no_plot(tmp_path):
    """Bars of CPU timings would read as a speed result: a CPU run draws none."""
    meta = _meta(False, ("stock", "mega_moe"))
    path = tmp_path / "bench_layer.png"
    assert bench_layer.plot(_cpu_rows(False, meta["variants"]), meta, path) == (
        "no plot: CPU timings say nothing about GPU speed")
    assert not path.exists()


# ---------------------------------------------------------------- the commands


def test_cpu_main_job_prints_at_once_and_runs_a_small_ab(tmp_path):
    """The README's main job on a machine without a GPU, with a smaller row than its CPU
    default (what the launcher prints first does not depend on it)."""
    command = [str(REPO / "scripts" / "bench_layer.sh"), "--variants", "stock,mega_moe", "--save-gemm1",
               "--tokens", "64", "--iters", "1", "--warmup", "0", "--out", str(tmp_path)]
    start = time.monotonic()
    process = subprocess.Popen(command, env=NO_GPU_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            assert selector.select(timeout=10), "nothing printed within 10 s"
        first = process.stdout.readline()
        first_after = time.monotonic() - start
        assert first.startswith("[bench_layer] no NVIDIA GPU visible: running a small CPU A/B instead"), first
        assert "./scripts/bench_layer.sh --variants stock,mega_moe --save-gemm1" in first
        assert first_after < 10, f"first line after {first_after:.1f} s"
        rest = process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            process.terminate()  # the process is torchrun by now: SIGTERM ends its ranks too
            process.wait(timeout=60)
    assert process.returncode == 0, first + rest
    assert "CPU timings say nothing about GPU speed" in first
    lines = rest.splitlines()
    (folder,) = [line.removeprefix("[bench_layer] this run writes its files to ") for line in lines
                 if line.startswith("[bench_layer] this run writes its files to ")]
    folder = Path(folder)
    assert folder.parent == tmp_path and folder.is_dir()
    assert f"wrote {folder / 'bench_layer.json'} and {folder / 'bench_layer.md'}" in lines
    at = next(i for i, line in enumerate(lines) if line.startswith("[bench_layer] cpu x2"))
    header, caveat = lines[at:at + 2]
    assert "weights and activations float32 in every variant; mega_moe backend reference (chosen for the CPU: " in header
    assert "precision bf16: GEMMs unquantized, in float32" in header
    assert caveat.startswith("[bench_layer] CPU timings say nothing about GPU speed")
    for variant in ("stock", "mega_moe"):
        assert f"[bench_layer] debug 64 tokens/rank: {variant} started" in rest
        assert any(line.startswith(f"[bench_layer] debug 64 tokens/rank: {variant} done in ") for line in lines)
    table = (folder / "bench_layer.md").read_text()
    header = assert_no_empty_column(table)
    assert "stock fwd+bwd ms" in header and "mega fwd+bwd ms" in header
    assert not any("speedup" in h or "TFLOP/s" in h for h in header), header
    assert json.loads((folder / "bench_layer.json").read_text())["rows"][0]["speedup"] == {}
    assert not (folder / "bench_layer.png").exists()
    summary = next(line for line in lines if line.startswith("[bench_layer] summary: "))
    assert summary.startswith("[bench_layer] summary: mega_moe's largest relative error against stock: "), summary
    assert "CPU timings say nothing about GPU speed" in summary


@pytest.mark.parametrize("script", ["run_train.sh", "ab_train.sh"])
def test_training_scripts_refuse_without_gpus(script, tmp_path):
    env = {**NO_GPU_ENV, "NGPU": "2", "CONFIG_FILE": "train_configs/debug_moe_mega_moe.toml",
           "AB_OUT": str(tmp_path / "ab")}
    done = subprocess.run([str(REPO / "scripts" / script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "training needs NVIDIA GPUs: NGPU=2 asks for 2" in done.stderr and "sees none" in done.stderr, done.stderr
    assert "torchrun" not in done.stdout + done.stderr  # refused before launching
    assert not (tmp_path / "ab").exists()  # ab_train.sh wrote nothing


def test_run_train_rejects_a_bad_ngpu():
    done = subprocess.run([str(REPO / "scripts" / "run_train.sh")], env={**NO_GPU_ENV, "NGPU": "two"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "NGPU=two is not valid" in done.stderr, done.stderr


def test_wgrad_source_error_tells_the_two_sources_apart():
    """fp8 (fp32 scales): requantizing the arrived rows costs accuracy against fp32;
    mxfp8 (power-of-two scales): it changes nothing measurable."""
    wgrad_source_error = load_script("wgrad_source_error")
    fp8 = wgrad_source_error.errors(256, 256, 256, "fp8", seed=0)
    mxfp8 = wgrad_source_error.errors(256, 256, 256, "mxfp8", seed=0)
    for name in ("dw1", "dw2", "dw3"):
        assert 0.02 < fp8["from bf16"][name] < fp8["requantized"][name] < 0.08, (name, fp8)
        assert abs(mxfp8["requantized"][name] - mxfp8["from bf16"][name]) < 1e-3, (name, mxfp8)


# ---------------------------------------------------------------- training A/B


def _fp8_ab_logs(monkeypatch) -> dict[str, str]:
    """Synthetic logs of an FP8 A/B's three runs over 20 steps: step time 1.25 s (stock_bf16),
    1.5 s (stock), 0.75 s (mega_moe); stock's loss is 0.07 off stock_bf16's at step 8,
    mega_moe's 0.04 at step 15 (elsewhere 0.01 and 0.02)."""
    n = 20
    bf16 = [8.0 - 0.2 * i for i in range(n)]
    losses = {
        "stock_bf16": bf16,
        "stock": [v + (0.07 if i == 7 else 0.01) for i, v in enumerate(bf16)],
        "mega_moe": [v + (0.04 if i == 14 else -0.02) for i, v in enumerate(bf16)],
    }
    timing = {"stock_bf16": (1.25, 5000.0, 30.0), "stock": (1.5, 4000.0, 28.0), "mega_moe": (0.75, 8000.0, 25.0)}
    return {
        name: synthetic_log(monkeypatch, step_time, losses[name], [memory] * n, [tps] * n)
        for name, (step_time, tps, memory) in timing.items()
    }


def _write_logs(logs: dict[str, str], folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name: folder / f"{name}.log" for name in logs}
    for name, path in paths.items():
        path.write_text(logs[name])
    return paths


def _converters(path: Path) -> list[str]:
    return ab_stock_toml.tomllib.loads(path.read_text())["model"]["converters"]


@pytest.mark.parametrize("drop_quantize", [False, True])
def test_ab_stock_toml_drop_quantize(drop_quantize, tmp_path):
    source = REPO / "train_configs" / "qwen3_30b_a3b_12l_fp8.toml"
    out = tmp_path / "twin.toml"
    flag = ["--drop-quantize"] if drop_quantize else []
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "ab_stock_toml.py"), *flag, str(source), str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert _converters(out) == ([] if drop_quantize else ["quantize.grouped_mm.float8"])
    line = done.stdout.strip()
    assert line.startswith(f"ab_stock_toml: wrote {out}: removed ") and "mega_moe" in line, line
    assert ("quantize.grouped_mm.float8" in line) is drop_quantize, line
    # Every other line is the source's, its [quantize...] table included.
    differing = [(a, b) for a, b in zip(source.read_text().splitlines(), out.read_text().splitlines()) if a != b]
    assert len(source.read_text().splitlines()) == len(out.read_text().splitlines())
    assert [a for a, _ in differing] == ['converters = ["quantize.grouped_mm.float8", "mega_moe"]']


def test_ab_stock_toml_drops_every_quantize_converter_and_says_when_there_is_none(tmp_path):
    text = '[model]\nconverters = ["quantize.linear.float8", "mega_moe", "quantize.grouped_mm.mx", "quantized"]\n'
    assert ab_stock_toml.stock_toml(text) == text.replace('"mega_moe", ', "")
    assert ab_stock_toml.stock_toml(text, drop_quantize=True) == '[model]\nconverters = ["quantized"]\n'
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "ab_stock_toml.py"), "--drop-quantize",
         str(REPO / "train_configs" / "debug_moe_mega_moe.toml"), str(tmp_path / "twin.toml")],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert 'removed mega_moe from [model] converters (no "quantize.*" converter to remove)' in done.stdout
    assert _converters(tmp_path / "twin.toml") == []


@pytest.mark.parametrize("baseline", ["stock_bf16", "stock"])
def test_ab_report_three_runs(baseline, monkeypatch, tmp_path):
    logs = _fp8_ab_logs(monkeypatch)
    runs = {name: ab_report.parse_log(text, name) for name, text in logs.items()}
    result = ab_report.compare(runs["stock"], runs["mega_moe"], (6, 20), [runs["stock_bf16"]], baseline)
    step_time = {"stock_bf16": 1.25, "stock": 1.5, "mega_moe": 0.75}
    # (largest |loss - baseline loss|, its step) per run
    loss_diff = {
        "stock_bf16": {"stock": (0.07, 8), "mega_moe": (0.04, 15)},
        "stock": {"stock_bf16": (0.07, 8), "mega_moe": (0.09, 8)},
    }[baseline]
    assert list(result["runs"]) == ["stock", "mega_moe", "stock_bf16"]
    assert result["baseline"] == baseline and set(result["vs_baseline"]) == set(loss_diff)
    for name, (diff, step) in loss_diff.items():
        vs = result["vs_baseline"][name]
        assert vs["speedup"] == pytest.approx(step_time[baseline] / step_time[name]), name
        assert vs["max_abs_loss_diff"] == pytest.approx(diff, abs=1e-4), name
        assert vs["max_abs_loss_diff_step"] == step, name
    # mega_moe against stock, whatever the baseline.
    assert result["speedup"] == pytest.approx(2.0)
    assert (result["max_abs_loss_diff"], result["max_abs_loss_diff_step"]) == (pytest.approx(0.09, abs=1e-4), 8)

    paths = _write_logs(logs, tmp_path / "logs")
    argv = [sys.executable, str(REPO / "scripts" / "ab_report.py"), "--stock", str(paths["stock"]),
            "--mega-moe", str(paths["mega_moe"]), "--also", f"stock_bf16={paths['stock_bf16']}",
            "--out", str(tmp_path / "report")]
    if baseline != "stock":
        argv += ["--baseline", baseline]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    header, rows = table_cells(done.stdout)
    assert header[-2:] == [f"speedup vs {baseline}", f"max abs loss diff vs {baseline} (step)"]
    cells = {row[0]: row for row in rows}
    assert list(cells) == ["stock", "mega_moe", "stock_bf16"]
    assert cells[baseline][-2:] == ["baseline", "baseline"]
    for name, (diff, step) in loss_diff.items():
        assert cells[name][1] == f"{1000 * step_time[name]:.1f}"
        assert cells[name][-2:] == [f"{step_time[baseline] / step_time[name]:.3f}x", f"{diff:.4g} (step {step})"]
    assert "Speedup (stock step time / mega_moe step time): **2.000x**" in done.stdout
    assert done.stdout.startswith((tmp_path / "report" / "ab.md").read_text())
    written = json.loads((tmp_path / "report" / "ab.json").read_text())
    assert set(written["runs"]) == set(written["loss"]) == {"stock", "mega_moe", "stock_bf16"}
    assert written["vs_baseline"] == json.loads(json.dumps(result["vs_baseline"]))
    assert (tmp_path / "report" / "loss.png").exists() or "loss.png skipped" in done.stdout


@pytest.mark.parametrize(
    "also, named",
    [
        (["stock_bf16"], "'stock_bf16': expected NAME=LOG"),
        (["={log}"], "'={log}': the run name before '=' must be"),
        (["a b={log}"], "'a b={log}': the run name before '=' must be"),
        (["stock={log}"], "'stock={log}': the run name 'stock' is given twice"),
        (["x={log}", "x={log}"], "'x={log}': the run name 'x' is given twice"),
        (["x={missing}"], "'x={missing}': no such log file '{missing}'"),
    ],
)
def test_ab_report_bad_also_names_the_value(also, named, monkeypatch, tmp_path, capsys):
    logs = _write_logs({"stock": "", "mega_moe": "", "x": ""}, tmp_path)
    where = {"log": logs["x"], "missing": tmp_path / "missing.log"}
    argv = ["ab_report.py", "--stock", str(logs["stock"]), "--mega-moe", str(logs["mega_moe"])]
    for value in also:
        argv += ["--also", value.format(**where)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        ab_report.main()
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert f"argument --also: {named.format(**where)}" in error, error


def test_ab_report_bad_baseline_names_the_runs(monkeypatch, tmp_path, capsys):
    logs = _write_logs({"stock": "", "mega_moe": "", "x": ""}, tmp_path)
    monkeypatch.setattr(sys, "argv", ["ab_report.py", "--stock", str(logs["stock"]), "--mega-moe",
                                      str(logs["mega_moe"]), "--also", f"x={logs['x']}", "--baseline", "bf16"])
    with pytest.raises(SystemExit) as exit_info:
        ab_report.main()
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert "argument --baseline: 'bf16' is not a run (choose from stock, mega_moe, x)" in error, error


@pytest.mark.parametrize("option", ["--stock", "--mega-moe"])
def test_ab_report_missing_log_names_the_file(option, monkeypatch, tmp_path, capsys):
    logs = _write_logs({"stock": "", "mega_moe": ""}, tmp_path)
    paths = {"--stock": str(logs["stock"]), "--mega-moe": str(logs["mega_moe"])}
    paths[option] = str(tmp_path / "missing.log")
    monkeypatch.setattr(sys, "argv", ["ab_report.py", *(x for pair in paths.items() for x in pair)])
    with pytest.raises(SystemExit) as exit_info:
        ab_report.main()
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert f"argument {option}: no such log file {paths[option]!r}" in error, error


def _fake_repo(tmp_path: Path, logs: dict[str, str]) -> Path:
    """A copy of the A/B scripts whose run_train.sh passes the GPU check and, for a run,
    records the run's TOML and arguments and prints that run's synthetic log."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("ab_train.sh", "ab_runs.sh", "ab_stock_toml.py", "ab_report.py"):
        shutil.copy2(REPO / "scripts" / name, repo / "scripts" / name)
    _write_logs(logs, tmp_path / "logs")
    fake = repo / "scripts" / "run_train.sh"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        "[[ ${1:-} == --check-gpus ]] && exit 0\n"
        'name=$(basename "$CONFIG_FILE" .toml)\n'
        f'echo "$name $*" >> {tmp_path / "calls"}\n'
        f'cat {tmp_path / "logs"}/"$name".log\n'
    )
    fake.chmod(0o755)
    return repo


@pytest.mark.parametrize("stock_bf16", [None, "0", "1"])
def test_ab_train_adds_the_stock_bf16_run(stock_bf16, monkeypatch, tmp_path):
    repo = _fake_repo(tmp_path, _fp8_ab_logs(monkeypatch))
    out = tmp_path / "ab"
    env = {**NO_GPU_ENV, "CONFIG_FILE": str(REPO / "train_configs" / "qwen3_30b_a3b_12l_fp8.toml"),
           "AB_OUT": str(out), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    if stock_bf16 is not None:
        env["AB_STOCK_BF16"] = stock_bf16
    done = subprocess.run([str(repo / "scripts" / "ab_train.sh"), "--training.steps", "20"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    names = ["mega_moe", "stock", "stock_bf16"] if stock_bf16 == "1" else ["mega_moe", "stock"]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == [f"{name} --job.dump_folder {out / name} --training.steps 20" for name in names]
    assert {p.name for p in out.glob("*.toml")} == {f"{name}.toml" for name in names}
    assert _converters(out / "stock.toml") == ["quantize.grouped_mm.float8"]
    header, rows = table_cells((out / "ab.md").read_text())
    assert [row[0] for row in rows] == ["stock", "mega_moe", *names[2:]]
    if stock_bf16 == "1":
        assert _converters(out / "stock_bf16.toml") == []
        assert header[-2] == "speedup vs stock_bf16"
        assert rows[1][-2] == "1.667x"  # mega_moe: 1.25 s / 0.75 s
    else:
        assert header[-2] == "speedup vs stock" and rows[1][-2] == "2.000x"


def test_ab_train_rejects_a_bad_ab_stock_bf16(tmp_path):
    env = {**NO_GPU_ENV, "CONFIG_FILE": "train_configs/qwen3_30b_a3b_12l_fp8.toml", "AB_STOCK_BF16": "yes",
           "AB_OUT": str(tmp_path / "ab")}
    done = subprocess.run([str(REPO / "scripts" / "ab_train.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "AB_STOCK_BF16=yes is not valid" in done.stderr, done.stderr
    assert not (tmp_path / "ab").exists()


# ---------------------------------------------------------------- kernel resources


GEMM_KERNELS = {"dispatch_gemm1_kernel", "dispatch_grad_gemm1_kernel"}
ROWS_GEMM_KERNELS = {"rows_gemm_combine_kernel", "grouped_gemm_kernel"}
"""The rows GEMMs' implementations (``TileConfig.gemm2_kernel``): the Gluon core's kernel
with ``combine_release_kernel`` after it."""


def _kernel_resources(tmp_path, *runs: tuple[str, ...]) -> dict:
    """``kernel_resources.py`` once per argument tuple in ``runs``, side by side (each
    compiles for minutes, on one core), and their reports' precisions in one dict."""
    env = {k: v for k, v in NO_GPU_ENV.items() if k != "TRITON_INTERPRET"}
    started = []
    for i, args in enumerate(runs):
        out = tmp_path / str(i)
        command = [sys.executable, str(REPO / "scripts" / "kernel_resources.py"), "--out", str(out), *args]
        started.append((out, subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True)))
    precisions = {}
    for out, process in started:
        output, _ = process.communicate(timeout=900)
        assert process.returncode == 0, output
        precisions.update(json.loads((out / "kernel_resources.json").read_text())["precisions"])
    return {"precisions": precisions}


def test_every_sm90_kernel_fits_an_h100(tmp_path):
    """Compiled for sm_90a on this host (no GPU), every fused kernel of the bf16, fp8,
    fp8_bwd and mxfp8 tile rows fits in an H100/H200 thread block's shared memory (a row
    that does not fails on the GPU only at its first launch), calls no subroutine and
    stores no row a byte or two at a time.
    mxfp8's GEMMs run bf16 MMAs there (Hopper has no MX MMA: its operands are held in bf16),
    and its weight gradients take bf16 copies rounded along the tokens instead of
    ``wgrad_kernel``."""
    report = _kernel_resources(tmp_path, ("--precisions", "bf16,fp8_bwd"), ("--precisions", "fp8,mxfp8"))
    for name in ("bf16", "fp8", "fp8_bwd", "mxfp8"):
        kernels = {r["kernel"] for r in report["precisions"][name]}
        assert GEMM_KERNELS <= kernels, (name, kernels)
        # The table runs GEMM2 on the Gluon core in every sm90 row, the release after it.
        assert {"grouped_gemm_kernel", "combine_release_kernel"} <= kernels, (name, kernels)
    # fp8's weight gradients on the Gluon core grouped along the tokens, from token-major copies.
    fp8_kernels = {r["kernel"] for r in report["precisions"]["fp8"]}
    assert {"token_major_kernel", "token_grouped_gemm_kernel"} <= fp8_kernels and "wgrad_kernel" not in fp8_kernels
    mx_kernels = {r["kernel"] for r in report["precisions"]["mxfp8"]}
    assert "dequantized_rows_kernel" in mx_kernels and "wgrad_kernel" not in mx_kernels, mx_kernels
    mma = {r["mma"] for r in report["precisions"]["mxfp8"] if r["kernel"] in GEMM_KERNELS | ROWS_GEMM_KERNELS}
    assert mma and all(m.endswith(".f32.bf16.bf16") for m in mma), mma
    # No subroutine calls (a correctly rounded division calls its slow path, and the call
    # spills the registers live across it): the quantizers compute scales without one.
    calls = [(name, r["kernel"]) for name, records in report["precisions"].items() for r in records if r["calls"]]
    assert not calls, calls
    # Every row and tile store 16 bytes wide: a one- or two-byte store means the compiler
    # lost an alignment (e4m3 dispatch copies, combine stores after an N-major B tile).
    narrow = [(name, r["kernel"]) for name, records in report["precisions"].items() for r in records
              if r["narrow_stores"]]
    assert not narrow, narrow


def test_sm100_mxfp8_kernels_compile_to_native_mx_mma(tmp_path):
    """The Blackwell row, compiled for sm_100a (no Blackwell GPU runs it here): every GEMM
    issues the block-scaled MX MMA, and every kernel fits in shared memory."""
    report = _kernel_resources(tmp_path, ("--arch", "sm100", "--precisions", "mxfp8"))
    records = report["precisions"]["mxfp8"]
    assert GEMM_KERNELS | {"rows_gemm_combine_kernel", "wgrad_kernel"} <= {r["kernel"] for r in records}
    for r in records:
        if r["kernel"] in GEMM_KERNELS | {"rows_gemm_combine_kernel", "wgrad_kernel"}:
            assert "block_scale.block32" in r["mma"], r


def test_kernel_resources_flags_a_row_over_the_limit(tmp_path):
    """fp8_bwd's backward recomputes GEMM1 in bf16 on the fp8 row's 128-deep K steps: in 3
    stages that takes 240 KB, which the script reports and fails on."""
    code = (
        "import dataclasses, sys\n"
        f"sys.path.insert(0, {str(REPO / 'scripts')!r})\n"
        "import kernel_resources\n"
        "from titan_megamoe.kernels import configs\n"
        "row = configs.TILE_CONFIGS['sm90', 'fp8_block']\n"
        "configs.TILE_CONFIGS['sm90', 'fp8_block'] = dataclasses.replace(row, grad1_stages=3)\n"
        f"sys.exit(kernel_resources.main(['--precisions', 'fp8_bwd', '--out', {str(tmp_path)!r}]))\n"
    )
    env = {k: v for k, v in NO_GPU_ENV.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "> limit" in done.stdout


def test_gpu_test_groups_take_every_gpu_test_once():
    """``gpu_tests.py``'s groups against the suite as collected: every test of ``tests/gpu``
    runs in exactly one group, every group entry names a test, and a function a group
    names leaves its module's group."""
    gpu_tests = load_script("gpu_tests")
    test_ids = gpu_tests.collect()
    chosen = gpu_tests.assign(test_ids)
    assert set(chosen) == set(gpu_tests.GROUPS) and all(chosen.values()), chosen
    args = [a for group in chosen.values() for a in group]
    assert len(args) == len(set(args))
    assert {f"{gpu_tests.SUITE}/{t.split('[', 1)[0]}" for t in test_ids} == set(args)
    assert "tests/gpu/test_fused_gpu.py::test_one_gpu" in chosen["fused_one"]
    assert "tests/gpu/test_fused_gpu.py::test_one_gpu" not in chosen["fused_rest"]
    assert "tests/gpu/test_fused_gpu.py::test_one_gpu_other_mx_form" in chosen["fused_rest"]


def test_gpu_test_groups_refuse_an_ungrouped_test_and_a_stale_entry():
    gpu_tests = load_script("gpu_tests")
    groups = {"a": ["test_x.py"], "b": ["test_y.py::test_two"]}
    assert gpu_tests.assign(["test_x.py::test_one[p]", "test_y.py::test_two[q]"], groups) == {
        "a": ["tests/gpu/test_x.py::test_one"], "b": ["tests/gpu/test_y.py::test_two"]}
    with pytest.raises(ValueError, match="test_z.py::test_three.* is in no group"):
        gpu_tests.assign(["test_x.py::test_one", "test_y.py::test_two", "test_z.py::test_three"], groups)
    with pytest.raises(ValueError, match="match no test of tests/gpu: test_y.py::test_two"):
        gpu_tests.assign(["test_x.py::test_one"], groups)
    with pytest.raises(ValueError, match="in groups a and b"):
        gpu_tests.assign(["test_x.py::test_one"], {"a": ["test_x.py"], "b": ["test_x.py"]})


def test_gpu_tests_bad_arguments_name_the_value(capsys):
    gpu_tests = load_script("gpu_tests")
    with pytest.raises(SystemExit):
        gpu_tests.main(["--groups", "kernels,nope"])
    assert "unknown groups nope" in capsys.readouterr().err


def test_gpu_tests_refuse_to_run_without_a_gpu(monkeypatch, capsys):
    """Without a GPU every test of the suite would skip and the run look green."""
    gpu_tests = load_script("gpu_tests")
    monkeypatch.setattr(gpu_tests.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        gpu_tests.main(["--groups", "fused_one"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert gpu_tests.main(["--groups", "fused_one", "--list"]) == 0
    assert "fused_one: tests/gpu/test_fused_gpu.py::test_one_gpu" in capsys.readouterr().out


def test_gpu_test_group_counts_and_limit(tmp_path):
    """A group's counts come from pytest's summary line; a group past its limit is stopped
    (with what it spawned) and reported so."""
    gpu_tests = load_script("gpu_tests")
    quick = tmp_path / "test_quick.py"
    quick.write_text("import pytest\n\ndef test_a():\n    pass\n\n@pytest.mark.skip\ndef test_b():\n    pass\n")
    slow = tmp_path / "test_slow.py"
    slow.write_text("import time\n\ndef test_c():\n    time.sleep(60)\n")
    done = gpu_tests.run_group("quick", [str(quick)], 60, tmp_path)
    assert (done["rc"], done["passed"], done["skipped"], done["stopped_by_limit"]) == (0, 1, 1, False), done
    start = time.monotonic()
    stopped = gpu_tests.run_group("slow", [str(slow)], 3, tmp_path)
    assert stopped["stopped_by_limit"] and stopped["rc"] is None and time.monotonic() - start < 30, stopped
    assert (tmp_path / "slow.log").exists()


def test_launch_overhead_prints_and_writes_both_rows(tmp_path, capsys):
    """The launch microbenchmark runs on a CPU host, prints its table and writes its JSON
    (in process here: the launch module's switches it sets for itself are put back)."""
    from titan_megamoe.kernels import launch as launching

    launch_overhead = load_script("launch_overhead")
    interpret, device = launching.INTERPRET, launching._current_device
    try:
        launch_overhead.main(["--iters", "20", "--out", str(tmp_path)])
    finally:
        launching.INTERPRET, launching._current_device = interpret, device
    rows = json.loads((tmp_path / "launch_overhead.json").read_text())["us_per_launch"]
    assert len(rows) == 2 and all(us > 0 for us in rows.values()), rows
    assert "| launch |" in capsys.readouterr().out

"""Compare TorchTitan training logs of the same config: stock MoE against mega_moe, and more runs.

    python scripts/ab_report.py --stock stock.log --mega-moe mega_moe.log [--window 6-20] [--out DIR]
        [--also NAME=LOG ...] [--baseline NAME]

Reads the per-step line of TorchTitan 0.2.2 and 0.3.0 (colour codes and torchrun's
``[rankN]:`` prefix allowed; log_freq must be 1 over the window)

    [titan] 2025-01-01 12:00:00,123 - root - INFO - step:  7  loss:  5.12345  grad_norm:  1.2345
    memory: 40.12GiB(29.50%)  tps: 7,886  tflops: 123.45  mfu: 12.34%

(0.3.0 prints ``mfu: N/A`` when torchao quantizes: its MFU counts bf16 peak FLOPS.)

and prints a markdown table, one row per run: mean step time (the gap between consecutive
step lines' timestamps) and tokens/s/GPU (TorchTitan's tps) over the window, peak reserved
memory, final loss, and the speedup and largest per-step loss difference against the
baseline run (--baseline, default stock); below it mega_moe's speedup and largest loss
difference against stock. Writes ab.json, ab.md and loss.png (when matplotlib is
installed) to the output folder.
"""

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RANK = re.compile(r"\[rank(\d+)\]:")
_TIMESTAMP = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
# "validate step:" lines have no grad_norm, so they never match.
_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<memory_gib>[\d.]+)GiB\([\d.]+%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?:(?P<mfu>[\d.]+)%|N/A)"
)
_TOTAL_STEPS = re.compile(r"total steps (\d+)")
_RUN_NAME = re.compile(r"[\w.+-]+")


class LogError(ValueError):
    """A log that cannot be compared (missing steps, no step lines)."""


@dataclass
class Step:
    step: int
    time: float  # seconds since the epoch, from the log line's timestamp
    loss: float
    grad_norm: float
    memory_gib: float  # TorchTitan's peak reserved memory since the previous log line
    tps: float  # tokens per second per GPU, as TorchTitan computes it


@dataclass
class Run:
    name: str
    steps: dict[int, Step]
    configured_steps: int | None  # training.steps, from the "Trainer is initialized" line


def parse_log(text: str, name: str) -> Run:
    """Collect the per-step lines of the lowest rank that logged any."""
    by_rank: dict[int, dict[int, Step]] = {}
    configured_steps = None
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        if configured_steps is None and (total := _TOTAL_STEPS.search(line)):
            configured_steps = int(total.group(1))
        match = _STEP.search(line)
        if not match:
            continue
        stamp = _TIMESTAMP.search(line)
        if not stamp:
            raise LogError(f"{name}: step line without a [titan] timestamp: {line.strip()!r}")
        rank = _RANK.search(line)
        steps = by_rank.setdefault(int(rank.group(1)) if rank else 0, {})
        step = int(match["step"])
        steps.setdefault(step, Step(
            step=step,
            time=datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(),
            loss=float(match["loss"]),
            grad_norm=float(match["grad_norm"]),
            memory_gib=float(match["memory_gib"]),
            tps=float(match["tps"].replace(",", "")),
        ))
    if not by_rank:
        raise LogError(f"{name}: no training step lines found (did the run start?)")
    return Run(name, by_rank[min(by_rank)], configured_steps)


def parse_window(text: str) -> tuple[int, int]:
    first, sep, last = text.partition("-")
    if not sep or not first.isdigit() or not last.isdigit() or not 2 <= int(first) <= int(last):
        raise argparse.ArgumentTypeError(
            f"window {text!r}: expected FIRST-LAST with 2 <= FIRST <= LAST, e.g. 6-20 "
            "(step FIRST-1 is needed to time step FIRST)"
        )
    return int(first), int(last)


def parse_also(values: list[str]) -> dict[str, Path]:
    """``--also NAME=LOG`` values as {NAME: LOG}; ValueError naming the bad value."""
    also: dict[str, Path] = {}
    for value in values:
        name, sep, log = value.partition("=")
        if not sep:
            raise ValueError(f"{value!r}: expected NAME=LOG, e.g. stock_bf16=outputs/ab/x/stock_bf16.log")
        if not _RUN_NAME.fullmatch(name):
            raise ValueError(f"{value!r}: the run name before '=' must be letters, digits, '_', '.', '+' or '-', "
                             "and not empty")
        taken = ["stock", "mega_moe", *also]
        if name in taken:
            raise ValueError(f"{value!r}: the run name {name!r} is given twice (runs so far: {', '.join(taken)})")
        if not Path(log).is_file():
            raise ValueError(f"{value!r}: no such log file {log!r}")
        also[name] = Path(log)
    return also


def summarize(run: Run, window: tuple[int, int]) -> dict:
    first, last = window
    needed = range(first - 1, last + 1)
    missing = [s for s in needed if s not in run.steps]
    if missing:
        logged = f"steps {min(run.steps)}-{max(run.steps)}"
        if run.configured_steps is not None and run.configured_steps < last:
            why = f"it was configured with training.steps = {run.configured_steps}"
        elif max(run.steps) < last:
            why = f"it stopped after step {max(run.steps)}"
        else:
            why = "steps are missing (metrics.log_freq must be 1)"
        raise LogError(
            f"{run.name}: the window {first}-{last} needs steps {first - 1}-{last}, but the log "
            f"has {logged}: {why}. Train at least {last} steps or pass a smaller window."
        )
    step_times = [run.steps[s].time - run.steps[s - 1].time for s in range(first, last + 1)]
    final = run.steps[max(run.steps)]
    return {
        "step_time_s": sum(step_times) / len(step_times),
        # Every step has the same token count, so the window's throughput is the harmonic mean.
        "tokens_per_s_per_gpu": len(step_times) / sum(1 / run.steps[s].tps for s in range(first, last + 1)),
        "peak_memory_gib": max(s.memory_gib for s in run.steps.values()),
        "final_step": final.step,
        "final_loss": final.loss,
    }


def versus(run: Run, baseline: Run, summaries: dict) -> dict:
    """``run`` against ``baseline``: the speedup (baseline step time / run step time) and
    the largest |loss difference| over the steps both logged, with its step."""
    common = sorted(set(run.steps) & set(baseline.steps))
    differences = {s: abs(run.steps[s].loss - baseline.steps[s].loss) for s in common}
    # A NaN difference (a diverged run) counts as the worst.
    worst = max(differences, key=lambda s: (math.isnan(differences[s]), differences[s]))
    return {
        "speedup": summaries[baseline.name]["step_time_s"] / summaries[run.name]["step_time_s"],
        "max_abs_loss_diff": differences[worst],
        "max_abs_loss_diff_step": worst,
    }


def compare(stock: Run, mega: Run, window: tuple[int, int], also: Sequence[Run] = (),
            baseline: str = "stock") -> dict:
    """Every run summarized over ``window``, every run but ``baseline`` against it
    (``vs_baseline``), and mega_moe against stock (the top-level speedup and loss difference)."""
    runs = {run.name: run for run in (stock, mega, *also)}
    summaries = {name: summarize(run, window) for name, run in runs.items()}
    return {
        "window": list(window),
        "runs": summaries,
        **versus(mega, stock, summaries),
        "baseline": baseline,
        "vs_baseline": {name: versus(run, runs[baseline], summaries)
                        for name, run in runs.items() if name != baseline},
        "loss": {name: {s: st.loss for s, st in sorted(run.steps.items())} for name, run in runs.items()},
    }


def markdown(result: dict) -> str:
    first, last = result["window"]
    baseline = result["baseline"]
    rows = [
        f"| run | step time (ms), steps {first}-{last} | tokens/s/GPU | peak reserved memory (GiB) | final loss "
        f"| speedup vs {baseline} | max abs loss diff vs {baseline} (step) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in result["runs"].items():
        if name == baseline:
            against = "baseline | baseline"
        else:
            vs = result["vs_baseline"][name]
            against = f"{vs['speedup']:.3f}x | {vs['max_abs_loss_diff']:.4g} (step {vs['max_abs_loss_diff_step']})"
        rows.append(
            f"| {name} | {1000 * s['step_time_s']:.1f} | {s['tokens_per_s_per_gpu']:,.0f} | "
            f"{s['peak_memory_gib']:.2f} | {s['final_loss']:.4f} (step {s['final_step']}) | {against} |"
        )
    rows += [
        "",
        f"Speedup (stock step time / mega_moe step time): **{result['speedup']:.3f}x**  ",
        f"Max |loss difference| per step (mega_moe vs stock): {result['max_abs_loss_diff']:.4g} "
        f"(step {result['max_abs_loss_diff_step']})",
    ]
    return "\n".join(rows) + "\n"


def plot_loss(result: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("loss.png skipped: matplotlib is not installed (pip install matplotlib)")
        return
    matplotlib.use("Agg")  # no display on training hosts
    import matplotlib.pyplot as plt

    fig, (ax, diff_ax) = plt.subplots(
        2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    losses = result["loss"]
    baseline = result["baseline"]
    colors = {}
    for name, curve in losses.items():
        (line,) = ax.plot(list(curve), list(curve.values()), label=name, marker=".")
        colors[name] = line.get_color()
    ax.set_ylabel("loss")
    ax.set_title("\n".join(
        f"{name} vs {baseline}: speedup {vs['speedup']:.2f}x, max |loss diff| {vs['max_abs_loss_diff']:.3g}"
        for name, vs in result["vs_baseline"].items()
    ), fontsize="medium")
    ax.legend()
    ax.grid(alpha=0.3)
    # The curves usually overlap; their differences show what the top panel hides.
    base, compared = losses[baseline], list(result["vs_baseline"])
    for name in compared:
        curve = losses[name]
        common = sorted(set(curve) & set(base))
        diff_ax.plot(common, [curve[s] - base[s] for s in common], color=colors[name], marker=".")
    diff_ax.axhline(0.0, color="gray", linewidth=0.8)
    diff_ax.set_xlabel("step")
    diff_ax.set_ylabel(f"{compared[0] if len(compared) == 1 else 'run'} - {baseline}")
    diff_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stock", type=Path, required=True, help="log of the stock run")
    parser.add_argument("--mega-moe", type=Path, required=True, help="log of the mega_moe run")
    parser.add_argument("--window", type=parse_window, default=(6, 20),
                        help="steps FIRST-LAST to average step time and throughput over (default 6-20)")
    parser.add_argument("--out", type=Path, help="output folder (default: the mega_moe log's folder)")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=LOG",
                        help="log of a further run, shown as NAME (repeatable)")
    parser.add_argument("--baseline", default="stock", metavar="NAME",
                        help="run the table's speedups and loss differences are taken against (default stock)")
    args = parser.parse_args()
    out = args.out or args.mega_moe.parent
    for option, log in (("--stock", args.stock), ("--mega-moe", args.mega_moe)):
        if not log.is_file():
            parser.error(f"argument {option}: no such log file {str(log)!r}")
    try:
        also = parse_also(args.also)
    except ValueError as error:
        parser.error(f"argument --also: {error}")
    names = ["stock", "mega_moe", *also]
    if args.baseline not in names:
        parser.error(f"argument --baseline: {args.baseline!r} is not a run (choose from {', '.join(names)})")

    try:
        stock = parse_log(args.stock.read_text(errors="replace"), "stock")
        mega = parse_log(args.mega_moe.read_text(errors="replace"), "mega_moe")
        others = [parse_log(log.read_text(errors="replace"), name) for name, log in also.items()]
        result = compare(stock, mega, args.window, others, args.baseline)
    except LogError as error:
        sys.exit(f"ab_report: {error}")

    out.mkdir(parents=True, exist_ok=True)
    table = markdown(result)
    print(table, end="")
    (out / "ab.md").write_text(table)
    (out / "ab.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_loss(result, out / "loss.png")
    print(f"wrote {out / 'ab.md'}, {out / 'ab.json'}")


if __name__ == "__main__":
    main()

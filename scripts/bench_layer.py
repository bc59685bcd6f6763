"""Layer A/B: stock TorchTitan MoE (ExpertParallel all-to-all), eager and compiled, vs
MegaMoE, one process group, same weights, same inputs, random routing, EP = every rank.

    torchrun --nproc_per_node=N scripts/bench_layer.py [--shapes 30B-A3B,235B-A22B]
        [--tokens 4096,16384] [--variants stock,stock_compiled,mega_moe] [--forward-only]

Uses NCCL and the GPUs when CUDA is available, gloo and the CPU otherwise (there the
compiled stock variant is skipped). Every rank runs the same fixed number of iterations
(a self-tuning timer would run a different count per rank and deadlock the collectives
inside). ``--forward-only`` times the forward alone, under ``torch.no_grad()``. Prints a
table on rank 0 and writes ``bench_layer.json``, ``bench_layer.md`` and, with
matplotlib, ``bench_layer.png``.
"""

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.models.moe import MoE, MoEArgs
from torchtitan.models.moe import moe as moe_module

from titan_megamoe import cpu_compat, fused
from titan_megamoe.layer import MegaMoE, OperatorSettings
from titan_megamoe.ops import resolve_backend
from titan_megamoe.parallel import MegaExpertParallel
from titan_megamoe.reference import relative_error


@dataclasses.dataclass(frozen=True)
class LayerShape:
    hidden: int
    inter: int
    experts: int
    top_k: int


SHAPES = {
    "debug": LayerShape(hidden=256, inter=768, experts=64, top_k=8),  # qwen3 debugmodel_moe
    "30B-A3B": LayerShape(hidden=2048, inter=768, experts=128, top_k=8),
    "235B-A22B": LayerShape(hidden=4096, inter=1536, experts=128, top_k=8),
}

VARIANTS = ("stock", "stock_compiled", "mega_moe")
"""Stock TorchTitan eager (the reference every error is measured against), the same
layer compiled as TorchTitan compiles MoE blocks, and MegaMoE."""

EAGER_GROUPED_MM = moe_module._run_experts_grouped_mm


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="30B-A3B,235B-A22B", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--tokens", default="4096,16384", help="comma-separated tokens per rank")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--forward-only", action="store_true", help="time the forward alone, under torch.no_grad()")
    p.add_argument("--precision", default="bf16", help="mega_moe precision")
    p.add_argument("--backend", default="auto", help="mega_moe backend: auto | fused | reference")
    p.add_argument("--comm-sms", type=int, default=0, help="mega_moe fused: dispatching programs (0: default)")
    p.add_argument("--save-gemm1", action="store_true",
                   help="mega_moe fused: the forward keeps GEMM1's pre-activations for the backward")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="outputs/bench_layer")
    args = p.parse_args()
    for name in args.shapes.split(","):
        if name not in SHAPES:
            p.error(f"--shapes: unknown shape {name!r}; known: {', '.join(SHAPES)}")
    args.variants = args.variants.split(",")
    for name in args.variants:
        if name not in VARIANTS:
            p.error(f"--variants: unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    return args


class Timer:
    """Per-iteration region times in ms: CUDA events on GPUs, perf_counter on CPUs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3


def build_layers(shape: LayerShape, variants, device, dtype, ep_mesh, settings) -> dict:
    """The asked-for variants, each its own layer with the same weights: stock MoE under
    ExpertParallel (compiled for ``stock_compiled``), MegaMoE under MegaExpertParallel."""
    moe_args = MoEArgs(
        num_experts=shape.experts, num_shared_experts=0, top_k=shape.top_k,
        score_func="softmax", route_norm=True, score_before_experts=False,
        # The stock grouped-MM path needs CUDA; on CPU its for-loop path runs instead.
        use_grouped_mm=device.type == "cuda", load_balance_coeff=None,
    )
    layers = {}
    for name in variants:
        layer = _seeded_stock_layer(shape, moe_args, device, dtype)
        if name == "mega_moe":
            layer = MegaMoE(layer, settings)
        if ep_mesh is not None:
            plan = MegaExpertParallel() if name == "mega_moe" else ExpertParallel()
            parallelize_module(layer.experts, ep_mesh, plan)
        if name == "stock_compiled":
            compile_like_torchtitan(layer, ep=ep_mesh is not None)
        layers[name] = layer
    return layers


def _seeded_stock_layer(shape: LayerShape, moe_args: MoEArgs, device, dtype) -> MoE:
    torch.manual_seed(0)
    layer = MoE(moe_args, dim=shape.hidden, hidden_dim=shape.inter).to(device)
    with torch.no_grad():
        layer.init_weights(init_std=0.02, buffer_device=device)
    # Weights in the compute dtype; the load-balance counters stay fp32.
    layer.experts.to(dtype)
    layer.router.to(dtype)
    return layer


def compile_like_torchtitan(layer: MoE, ep: bool) -> None:
    """Compile ``layer`` as TorchTitan 0.2.2's ``apply_compile`` (llama4, used by qwen3)
    compiles an MoE block: every child but ``experts`` (router, reorderer) fullgraph, the
    token dispatch/combine hooks on ``experts`` eager, and the module-level grouped-GEMM
    function fullgraph, with a dynamic token dimension under EP.

    ``apply_compile`` swaps that module-level function for the whole process; here the
    compiled one is swapped in only around this layer's forward, so the eager stock layer
    stays eager. The backward of the compiled function is already in its autograd graph.
    """
    torch._dynamo.config.capture_scalar_outputs = True
    for name, child in list(layer.named_children()):
        if name != "experts":
            setattr(layer, name, torch.compile(child, fullgraph=True))
    compiled = torch.compile(EAGER_GROUPED_MM, fullgraph=True)

    def dynamic(w1, w2, w3, x, num_tokens_per_expert):
        torch._dynamo.mark_dynamic(x, 0)  # the routed row count varies under EP
        return compiled(w1, w2, w3, x, num_tokens_per_expert)

    grouped_mm = dynamic if ep else compiled
    layer.register_forward_pre_hook(lambda *_: setattr(moe_module, "_run_experts_grouped_mm", grouped_mm))
    layer.register_forward_hook(lambda *_: setattr(moe_module, "_run_experts_grouped_mm", EAGER_GROUPED_MM))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run_variant(layer, x, dy, timer, warmup, iters, forward_only):
    """Median forward (and backward, fwd+bwd) ms; output and gradients (None when
    forward-only) of the last run, moved to the CPU so that the next variant's peak
    memory holds only the resident weights and its own work."""
    marks = []
    for i in range(warmup + iters):
        if i == warmup:
            # One barrier, then back-to-back iterations read only at the end: the host
            # may run ahead of the GPU, as in training, so launch overhead is hidden
            # wherever the layer itself does not synchronise.
            dist.barrier()
        for p in layer.parameters():
            p.grad = None
        xi = x.detach().requires_grad_(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            t0 = timer.mark()
            y = layer(xi)
            t1 = timer.mark()
        t2 = None
        if not forward_only:
            y.backward(dy)
            t2 = timer.mark()
        if i >= warmup:
            marks.append((t0, t1, t2))
    fwd = [timer.elapsed_ms(t0, t1) for t0, t1, _ in marks]
    bwd = [] if forward_only else [timer.elapsed_ms(t1, t2) for _, t1, t2 in marks]
    times = {"forward_ms": statistics.median(fwd)}
    grads = None
    if not forward_only:
        times["backward_ms"] = statistics.median(bwd)
        times["fwd_bwd_ms"] = statistics.median([f + b for f, b in zip(fwd, bwd)])
        grads = {"x": xi.grad, "gate": layer.router.gate.weight.grad}
        grads.update({w: local(getattr(layer.experts, w).grad) for w in ("w1", "w2", "w3")})
        grads = {k: g.cpu() for k, g in grads.items()}
    for p in layer.parameters():
        p.grad = None
    return times, y.detach().cpu(), grads


def matmul_peak_tflops(device) -> float | None:
    """bf16 matmul rate measured here, the ceiling the layer's TFLOP/s is set against."""
    if device.type != "cuda":
        return None
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * 10 / (start.elapsed_time(end) * 1e-3) / 1e12


def measure(layer, x, dy, args, device, timer):
    """One variant's times and peak memory; its output and gradients."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    result, y, grads = run_variant(layer, x, dy, timer, args.warmup, args.iters, args.forward_only)
    if cuda:
        result["resident_memory_gib"] = resident / 2**30
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result, y, grads


def add_rates(result, fwd_flops, peak):
    """TFLOP/s and, with a measured peak, % of it; backward counted as twice the forward."""
    rates = [("forward", fwd_flops)]
    if "fwd_bwd_ms" in result:
        rates += [("backward", 2 * fwd_flops), ("fwd_bwd", 3 * fwd_flops)]
    for key, flops in rates:
        result[f"{key}_tflops"] = flops / (result[f"{key}_ms"] * 1e-3) / 1e12
        if peak:
            result[f"{key}_pct_of_peak"] = 100 * result[f"{key}_tflops"] / peak


def errors_vs_stock(y, grads, reference, device) -> dict:
    """Relative error of the output (and gradients) against stock eager, worst rank."""
    y_ref, grads_ref = reference
    errors = {"y": relative_error(y, y_ref)}
    if grads is not None:
        errors.update({f"d{k}": relative_error(grads[k], grads_ref[k]) for k in grads_ref})
    # The worst rank's figures, so a bad rank cannot hide.
    worst = torch.tensor(list(errors.values()), dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(errors, worst.tolist()))


def speedups(row) -> dict:
    """mega_moe over stock and over stock_compiled, for every time both measured."""
    out = {}
    if "mega_moe" not in row:
        return out
    for base in ("stock", "stock_compiled"):
        for key in ("forward", "backward", "fwd_bwd"):
            if base in row and f"{key}_ms" in row[base]:
                out[f"{key}_vs_{base}"] = row[base][f"{key}_ms"] / row["mega_moe"][f"{key}_ms"]
    return out


def bench_row(layers, shape_name, tokens, args, device, dtype, settings, timer, peak):
    """One (shape, tokens) row: every variant on the same inputs."""
    shape = SHAPES[shape_name]
    if "mega_moe" in layers:
        # The fused backend sizes its buffers for the row's tokens per rank.
        layers["mega_moe"].experts.settings = dataclasses.replace(settings, capacity_tokens=tokens)
    g = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    x = torch.randn(1, tokens, shape.hidden, device=device, dtype=dtype, generator=g)
    dy = torch.randn(1, tokens, shape.hidden, device=device, dtype=dtype, generator=g)
    row = {"shape": shape_name, "tokens_per_rank": tokens, "ep": dist.get_world_size()}
    # Routed-expert GEMM work: 3 GEMMs of 2*H*I flops per routed row forward, twice that backward.
    fwd_flops = 2 * 3 * tokens * shape.top_k * shape.hidden * shape.inter
    reference = None
    for name, layer in layers.items():
        result, y, grads = measure(layer, x, dy, args, device, timer)
        if name == "mega_moe" and "peak_memory_gib" in result:
            # The fused backend's symmetric buffers live outside PyTorch's caching
            # allocator, so max_memory_allocated does not see them: add them.
            held = fused.symmetric_bytes(capacity_tokens=tokens, hidden=shape.hidden)
            result["symmetric_memory_gib"] = held / 2**30
            result["peak_memory_gib"] += result["symmetric_memory_gib"]
        add_rates(result, fwd_flops, peak)
        if name == "stock":
            reference = (y, grads)
        elif reference is not None:
            result["rel_err_vs_stock"] = errors_vs_stock(y, grads, reference, device)
        row[name] = result
    row["speedup"] = speedups(row)
    return row


def progress(row, forward_only) -> str:
    """One line per finished row."""
    parts = []
    for name in VARIANTS:
        if name in row:
            r = row[name]
            parts.append(f"{name} {r['forward_ms']:.2f}" + ("" if forward_only else f" / {r['fwd_bwd_ms']:.2f}"))
    kind = "fwd" if forward_only else "fwd / fwd+bwd"
    return f"[bench_layer] {row['shape']} {row['tokens_per_rank']} tokens/rank ({kind} ms): " + ", ".join(parts)


def _get(row, variant, key):
    """``row[variant][key]``, or None where that variant or figure was not measured."""
    return row.get(variant, {}).get(key)


def _cell(value, fmt="{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def markdown(rows, meta) -> str:
    backward = not meta["forward_only"]
    peak = meta["matmul_peak_tflops"]
    lines = [
        f"Layer A/B on {meta['device']} x{meta['ep']} (EP={meta['ep']}), {meta['dtype']}, "
        f"mega_moe precision {meta['precision']} backend {meta['backend']}, comm_sms {meta['comm_sms']}, "
        f"{'GEMM1 saved' if meta['save_gemm1'] else 'GEMM1 recomputed'} in the backward; "
        f"{'forward only (no_grad)' if meta['forward_only'] else 'forward + backward'}; "
        f"median of {meta['iters']} iterations after {meta['warmup']} warmup"
        + (f"; bf16 matmul peak measured {peak:.0f} TFLOP/s" if peak else ""),
        "",
    ]
    header = [
        "shape", "tokens/rank", "stock fwd ms", "stock compiled fwd ms", "mega fwd ms",
        "fwd speedup vs stock", "fwd speedup vs compiled", "mega fwd TFLOP/s (% peak)",
    ]
    if backward:
        header += [
            "stock bwd ms", "mega bwd ms", "bwd speedup vs stock",
            "stock fwd+bwd ms", "stock compiled fwd+bwd ms", "mega fwd+bwd ms",
            "fwd+bwd speedup vs stock", "fwd+bwd speedup vs compiled",
        ]
    header += [
        "peak GiB stock / mega",
        "mega max rel err vs stock (y, dx, dgate, dw1, dw2, dw3)" if backward else "mega max rel err vs stock (y)",
    ]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in rows:
        speedup = r["speedup"]
        mega_rate = _cell(_get(r, "mega_moe", "forward_tflops"))
        pct = _get(r, "mega_moe", "forward_pct_of_peak")
        if pct is not None:
            mega_rate += f" ({pct:.0f}%)"
        cells = [
            r["shape"], f"{r['tokens_per_rank']:,}",
            *(_cell(_get(r, v, "forward_ms")) for v in VARIANTS),
            _cell(speedup.get("forward_vs_stock"), "{:.2f}x"),
            _cell(speedup.get("forward_vs_stock_compiled"), "{:.2f}x"),
            mega_rate,
        ]
        if backward:
            cells += [
                _cell(_get(r, "stock", "backward_ms")), _cell(_get(r, "mega_moe", "backward_ms")),
                _cell(speedup.get("backward_vs_stock"), "{:.2f}x"),
                *(_cell(_get(r, v, "fwd_bwd_ms")) for v in VARIANTS),
                _cell(speedup.get("fwd_bwd_vs_stock"), "{:.2f}x"),
                _cell(speedup.get("fwd_bwd_vs_stock_compiled"), "{:.2f}x"),
            ]
        errors = _get(r, "mega_moe", "rel_err_vs_stock") or {}
        keys = ("y", "dx", "dgate", "dw1", "dw2", "dw3") if backward else ("y",)
        cells += [
            f"{_cell(_get(r, 'stock', 'peak_memory_gib'))} / {_cell(_get(r, 'mega_moe', 'peak_memory_gib'))}",
            ", ".join(_cell(errors.get(k), "{:.1e}") for k in keys),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, variants, forward_only, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'titan-megamoe[plot]')"
    labels = [f"{r['shape']}\n{r['tokens_per_rank']:,} tok" for r in rows]
    panels = [("forward_ms", "forward")]
    if not forward_only:
        panels += [("backward_ms", "backward"), ("fwd_bwd_ms", "forward + backward")]
    panel_width = max(5, 0.8 * len(rows) * len(variants))
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_width * len(panels), 4), squeeze=False)
    width = 0.8 / len(variants)
    for ax, (key, title) in zip(axes[0], panels):
        xs = range(len(rows))
        for j, name in enumerate(variants):
            offset = (j - (len(variants) - 1) / 2) * width
            ax.bar([i + offset for i in xs], [r[name][key] for r in rows], width, label=name)
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("ms (median)")
        ax.set_title(title)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def free(layers) -> None:
    """Give a shape's layers and compiled code back before the next shape."""
    layers.clear()
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        cpu_compat.apply()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    world = dist.get_world_size()
    rank0 = dist.get_rank() == 0
    if not cuda and "stock_compiled" in args.variants:
        args.variants.remove("stock_compiled")
        if rank0:
            print("[bench_layer] no CUDA: skipping stock_compiled (compiled as on GPUs only)", flush=True)
    ep_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",)) if world > 1 else None
    backend, why = resolve_backend(args.backend, device, args.precision)
    settings = OperatorSettings(precision=args.precision, backend=backend, comm_sms=args.comm_sms,
                                save_gemm1=args.save_gemm1)
    timer = Timer(device)
    peak = matmul_peak_tflops(device)

    rows = []
    for shape_name in args.shapes.split(","):
        layers = build_layers(SHAPES[shape_name], args.variants, device, dtype, ep_mesh, settings)
        for tokens in (int(t) for t in args.tokens.split(",")):
            row = bench_row(layers, shape_name, tokens, args, device, dtype, settings, timer, peak)
            rows.append(row)
            if rank0:
                print(progress(row, args.forward_only), flush=True)
        free(layers)

    if rank0:
        meta = {
            "device": torch.cuda.get_device_name() if cuda else "cpu", "ep": world,
            "dtype": str(dtype).removeprefix("torch."), "precision": args.precision,
            "backend": f"{backend} ({why})", "comm_sms": args.comm_sms, "save_gemm1": args.save_gemm1,
            "variants": args.variants,
            "forward_only": args.forward_only, "iters": args.iters, "warmup": args.warmup,
            "matmul_peak_tflops": peak,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table = markdown(rows, meta)
        (out / "bench_layer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (out / "bench_layer.md").write_text(table)
        print(table)
        print(plot(rows, args.variants, args.forward_only, out / "bench_layer.png"))
        print(f"wrote {out / 'bench_layer.json'} and {out / 'bench_layer.md'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

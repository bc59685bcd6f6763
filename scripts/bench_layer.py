"""Layer A/B: stock TorchTitan MoE (ExpertParallel all-to-all) vs MegaMoE, one process
group, same weights, same inputs, random routing, EP = every rank.

    torchrun --nproc_per_node=N scripts/bench_layer.py [--shapes debug,30B-A3B] [--tokens 4096]

Uses NCCL and the GPUs when CUDA is available, gloo and the CPU otherwise. Every rank
runs the same fixed number of iterations (a self-tuning timer would run a different
count per rank and deadlock the collectives inside). Prints a table on rank 0 and writes
``bench_layer.json``, ``bench_layer.md`` and, with matplotlib, ``bench_layer.png``.
"""

import argparse
import dataclasses
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

from titan_megamoe import cpu_compat
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


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="debug", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--tokens", default="512", help="comma-separated tokens per rank")
    p.add_argument("--precision", default="bf16", help="mega_moe precision")
    p.add_argument("--backend", default="auto", help="mega_moe backend: auto | fused | reference")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default="outputs/bench_layer")
    args = p.parse_args()
    for name in args.shapes.split(","):
        if name not in SHAPES:
            p.error(f"--shapes: unknown shape {name!r}; known: {', '.join(SHAPES)}")
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


def build_layers(shape: LayerShape, device, dtype, ep_mesh, settings):
    """Stock MoE under ExpertParallel and MegaMoE under MegaExpertParallel, same weights."""
    moe_args = MoEArgs(
        num_experts=shape.experts, num_shared_experts=0, top_k=shape.top_k,
        score_func="softmax", route_norm=True, score_before_experts=False,
        # The stock grouped-MM path needs CUDA; on CPU its for-loop path runs instead.
        use_grouped_mm=device.type == "cuda", load_balance_coeff=None,
    )
    stock = _seeded_stock_layer(shape, moe_args, device, dtype)
    mega = MegaMoE(_seeded_stock_layer(shape, moe_args, device, dtype), settings)
    if ep_mesh is not None:
        parallelize_module(stock.experts, ep_mesh, ExpertParallel())
        parallelize_module(mega.experts, ep_mesh, MegaExpertParallel())
    return stock, mega


def _seeded_stock_layer(shape: LayerShape, moe_args: MoEArgs, device, dtype) -> MoE:
    torch.manual_seed(0)
    layer = MoE(moe_args, dim=shape.hidden, hidden_dim=shape.inter).to(device)
    with torch.no_grad():
        layer.init_weights(init_std=0.02, buffer_device=device)
    # Weights in the compute dtype; the load-balance counters stay fp32.
    layer.experts.to(dtype)
    layer.router.to(dtype)
    return layer


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run_variant(layer, x, dy, timer, warmup, iters):
    """Median forward, backward and fwd+bwd ms; output and gradients of the last run."""
    fwd, bwd = [], []
    for i in range(warmup + iters):
        for p in layer.parameters():
            p.grad = None
        xi = x.detach().requires_grad_(True)
        dist.barrier()
        t0 = timer.mark()
        y = layer(xi)
        t1 = timer.mark()
        y.backward(dy)
        t2 = timer.mark()
        if i >= warmup:
            fwd.append(timer.elapsed_ms(t0, t1))
            bwd.append(timer.elapsed_ms(t1, t2))
    total = [f + b for f, b in zip(fwd, bwd)]
    grads = {"x": xi.grad, "w1": local(layer.experts.w1.grad), "gate": layer.router.gate.weight.grad}
    return (
        {"forward_ms": statistics.median(fwd), "backward_ms": statistics.median(bwd),
         "fwd_bwd_ms": statistics.median(total)},
        y.detach(),
        grads,
    )


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


def bench_one(shape_name, tokens, args, device, dtype, ep_mesh, settings, timer, peak):
    shape = SHAPES[shape_name]
    stock, mega = build_layers(shape, device, dtype, ep_mesh, settings)
    g = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    x = torch.randn(1, tokens, shape.hidden, device=device, dtype=dtype, generator=g)
    dy = torch.randn(1, tokens, shape.hidden, device=device, dtype=dtype, generator=g)
    row = {"shape": shape_name, "tokens_per_rank": tokens, "ep": dist.get_world_size()}
    outputs = {}
    for name, layer in (("stock", stock), ("mega_moe", mega)):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, y, grads = run_variant(layer, x, dy, timer, args.warmup, args.iters)
        row[name] = times
        if device.type == "cuda":
            row[name]["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        outputs[name] = (y, grads)
    # Routed-expert GEMM work: 3 GEMMs of 2*H*I flops per routed row forward, twice that backward.
    fwd_flops = 2 * 3 * tokens * shape.top_k * shape.hidden * shape.inter
    for name in ("stock", "mega_moe"):
        t = row[name]
        t["forward_tflops"] = fwd_flops / (t["forward_ms"] * 1e-3) / 1e12
        t["fwd_bwd_tflops"] = 3 * fwd_flops / (t["fwd_bwd_ms"] * 1e-3) / 1e12
        if peak:
            t["fwd_bwd_pct_of_peak"] = 100 * t["fwd_bwd_tflops"] / peak
    row["speedup_forward"] = row["stock"]["forward_ms"] / row["mega_moe"]["forward_ms"]
    row["speedup_fwd_bwd"] = row["stock"]["fwd_bwd_ms"] / row["mega_moe"]["fwd_bwd_ms"]
    (y_s, g_s), (y_m, g_m) = outputs["stock"], outputs["mega_moe"]
    row["rel_err_vs_stock"] = {"y": relative_error(y_m, y_s), **{f"d{k}": relative_error(g_m[k], g_s[k]) for k in g_s}}
    # The worst rank's figures, so a bad rank cannot hide.
    errors = torch.tensor(list(row["rel_err_vs_stock"].values()), dtype=torch.float64, device=device)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    row["rel_err_vs_stock"] = dict(zip(row["rel_err_vs_stock"], errors.tolist()))
    return row


def markdown(rows, meta) -> str:
    lines = [
        f"Layer A/B on {meta['device']} x{meta['ep']} (EP={meta['ep']}), {meta['dtype']}, "
        f"mega_moe precision {meta['precision']} backend {meta['backend']}; "
        f"median of {meta['iters']} iterations"
        + (f"; bf16 matmul peak measured {meta['matmul_peak_tflops']:.0f} TFLOP/s" if meta["matmul_peak_tflops"] else ""),
        "",
        "| shape | tokens/rank | stock fwd ms | mega fwd ms | fwd speedup | stock fwd+bwd ms | mega fwd+bwd ms "
        "| fwd+bwd speedup | mega TFLOP/s (fwd+bwd) | max rel err vs stock (y, dx, dw1) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        s, m, e = r["stock"], r["mega_moe"], r["rel_err_vs_stock"]
        lines.append(
            f"| {r['shape']} | {r['tokens_per_rank']:,} | {s['forward_ms']:.2f} | {m['forward_ms']:.2f} "
            f"| {r['speedup_forward']:.2f}x | {s['fwd_bwd_ms']:.2f} | {m['fwd_bwd_ms']:.2f} "
            f"| {r['speedup_fwd_bwd']:.2f}x | {m['fwd_bwd_tflops']:.2f} "
            f"| {e['y']:.1e}, {e['dx']:.1e}, {e['dw1']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'titan-megamoe[plot]')"
    labels = [f"{r['shape']}\n{r['tokens_per_rank']:,} tok" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(6, 2.5 * len(rows)), 4))
    for ax, key, title in ((axes[0], "forward_ms", "forward"), (axes[1], "fwd_bwd_ms", "forward + backward")):
        xs = range(len(rows))
        ax.bar([i - 0.2 for i in xs], [r["stock"][key] for r in rows], 0.4, label="stock TorchTitan")
        ax.bar([i + 0.2 for i in xs], [r["mega_moe"][key] for r in rows], 0.4, label="mega_moe")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("ms (median)")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


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
    ep_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",)) if world > 1 else None
    backend, why = resolve_backend(args.backend, device)
    settings = OperatorSettings(precision=args.precision, backend=backend)
    timer = Timer(device)
    peak = matmul_peak_tflops(device)
    rank0 = dist.get_rank() == 0

    rows = []
    for shape_name in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            row = bench_one(shape_name, tokens, args, device, dtype, ep_mesh, settings, timer, peak)
            rows.append(row)
            if rank0:
                print(f"[bench_layer] {shape_name} {tokens} tokens/rank: stock {row['stock']['fwd_bwd_ms']:.2f} ms, "
                      f"mega_moe {row['mega_moe']['fwd_bwd_ms']:.2f} ms fwd+bwd", flush=True)

    if rank0:
        meta = {
            "device": torch.cuda.get_device_name() if cuda else "cpu", "ep": world,
            "dtype": str(dtype).removeprefix("torch."), "precision": args.precision,
            "backend": f"{backend} ({why})", "iters": args.iters, "warmup": args.warmup,
            "matmul_peak_tflops": peak,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table = markdown(rows, meta)
        (out / "bench_layer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (out / "bench_layer.md").write_text(table)
        print(table)
        print(plot(rows, out / "bench_layer.png"))
        print(f"wrote {out / 'bench_layer.json'} and {out / 'bench_layer.md'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

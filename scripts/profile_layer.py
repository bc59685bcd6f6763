"""Where the fused operator's time goes: per-kernel GPU time from the PyTorch profiler.

    torchrun --nproc_per_node=N scripts/profile_layer.py --shape 30B-A3B --tokens 16384 [--backward]

Random routing (softmax of random logits, top-k), EP = every rank, `--precision`. Prints, on rank
0, each kernel's mean time per call, the wall time per call, and how long the host took
to issue a call (calls are issued back to back: a host time near the wall time means the
GPU waits for the host), for every ``--comm-sms``
value and every ``--tiles`` variant of the SM90 tile table (e.g.
``--tiles "" "gemm2_n=128,gemm2_stages=4"``: the table as is, then with those fields
changed). ``--backward`` times forward + backward (the kernels of both passes; the
backward's own are ``dispatch_grad_gemm1``, the second ``rows_gemm_combine`` and the
grouped weight-gradient GEMMs). Next to each fused GEMM kernel it prints the rate of its
expert-GEMM work and that rate's share of the matmul peak of the precision, measured in
the same run; for the call, the expert-GEMM roofline (forward GEMMs, and twice as much
again for the backward, at that peak) over the wall time. Writes ``profile_layer.json``.

``--host`` also times each variant without the profiler (which slows the host): the wall
time per call, and the host's time to issue one with the GPU held busy beforehand (so the
host is never held up by it; the times it waited for the device anyway are counted), and
writes Python's profile of those calls (the functions that take the host's time, backward
included) to ``host_profile.txt``.

``--memory`` records the caching allocator's history over one call and prints the peak,
what was allocated before the call began (inputs, weights, the operator's local buffers),
the operator's symmetric buffers (outside the allocator over several ranks) and the
blocks live at the peak, summed by the line of this project that allocated them.
"""

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from titan_megamoe import fused
from titan_megamoe.fused_support import describe_mma, runs_fp8_mma
from titan_megamoe.kernels import configs
from titan_megamoe.ops import mega_moe
from titan_megamoe.precision import PRECISION_CHOICES, get_precision
from titan_megamoe.settings import DEFAULT_SAVE_GEMM1_LOAD, OperatorSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Measured as the bench does, with its buffer options.
from bench_layer import (  # noqa: E402
    SHAPES, add_buffer_arguments, matmul_peak_tflops, memory_at_peak, positive_float,
)

TILE_FIELDS = {f.name: f.type for f in dataclasses.fields(configs.TileConfig)}


ROWS_GEMM_KERNEL_NAMES = {"tl": "rows_gemm_combine_kernel", "gluon": "grouped_gemm_kernel"}
"""The kernel each implementation of a rows GEMM (``TileConfig.gemm2_kernel``) launches."""
WGRAD_KERNEL_NAMES = {"tl": "wgrad_kernel", "gluon": "token_grouped_gemm_kernel"}
"""The same for the quantized weight gradients (``TileConfig.wgrad_kernel``)."""
GEMM1_KERNEL_NAMES = {"tl": "dispatch_gemm1_kernel", "gluon": "gate_up_gemm_kernel"}
"""The same for GEMM1 (``TileConfig.gemm1_kernel``)."""
GRAD1_KERNEL_NAMES = {"tl": "dispatch_grad_gemm1_kernel", "gluon": "swiglu_grad_gemm_kernel"}
"""The same for the backward's first kernel where GEMM1 was saved (``TileConfig.grad1_kernel``)."""


def stage_flops(rows: int, hidden: int, inter: int, backward: bool, save_gemm1: bool,
                rows_kernels: tuple[str, str] = ("tl", "tl"), wgrad_kernel: str = "tl",
                gemm1_kernel: str = "tl", grad1_kernel: str = "tl") -> dict[str, int]:
    """Expert-GEMM FLOPs per call of each fused GEMM kernel for ``rows`` received rows
    (what its mainloops compute; a recomputed GEMM1 counts); bf16's weight gradients run
    in torch's grouped GEMMs, which the table does not name. ``rows_kernels``: the
    implementations of GEMM2 and dgrad (``TileConfig.gemm2_kernel``, ``.dgrad_kernel``),
    ``wgrad_kernel`` the weight gradients' (``TileConfig.wgrad_kernel``), ``gemm1_kernel``
    and ``grad1_kernel`` GEMM1's and the backward's first kernel's (which runs the Gluon
    core only where GEMM1 was saved; rows past the saved ones are not counted apart)."""
    unit = 2 * rows * hidden * inter  # one [rows, H] x [H, I] product
    gemm2, dgrad = (ROWS_GEMM_KERNEL_NAMES[k] for k in rows_kernels)
    flops = {GEMM1_KERNEL_NAMES[gemm1_kernel]: 2 * unit, gemm2: unit}
    if backward:
        flops[dgrad] = flops.get(dgrad, 0) + 2 * unit  # dgrad: [da | db] [W1 | W3]^T
        grad1 = GRAD1_KERNEL_NAMES[grad1_kernel if save_gemm1 else "tl"]
        flops[grad1] = unit + (0 if save_gemm1 else 2 * unit)
        flops[WGRAD_KERNEL_NAMES[wgrad_kernel]] = 3 * unit
    return flops


def roofline_ms(rows: int, hidden: int, inter: int, backward: bool, peak_tflops: float) -> float:
    """The call's expert GEMMs at the peak: the forward's, and twice as much for the backward."""
    forward = sum(stage_flops(rows, hidden, inter, backward=False, save_gemm1=True).values())
    return (3 if backward else 1) * forward / (peak_tflops * 1e9)


def kernel_lines(kernels_ms: dict[str, float], flops: dict[str, int], peak_tflops: float | None) -> list[str]:
    """One line per kernel, slowest first; a GEMM kernel's with its rate and share of the peak."""
    lines = []
    for name, ms in sorted(kernels_ms.items(), key=lambda kv: -kv[1]):
        line = f"    {ms:8.3f} ms  {name}"
        if name in flops and ms > 0:
            rate = flops[name] / (ms * 1e9)
            line += f"  ({rate:.0f} TFLOP/s" + (f", {100 * rate / peak_tflops:.0f}% of peak)" if peak_tflops else ")")
        lines.append(line)
    return lines


GPU_HOLD_CYCLES = 2_000_000_000
"""GPU clock cycles (about a second) the host-time measurement keeps the GPU busy before
it issues its calls."""


HOST_STAGES = {
    "operator (autograd, custom ops, settings)": ("titan_megamoe.ops", "mega_moe"),
    "fused forward": ("titan_megamoe.kernels.forward", "fused_forward"),
    "fused backward": ("titan_megamoe.kernels.backward", "fused_backward"),
    "routing sort": ("titan_megamoe.kernels.forward", "sort_rows"),
    "weights quantized / transposed": ("titan_megamoe.kernels.quantize", "quantize_weights"),
    "weights quantized transposed": ("titan_megamoe.kernels.transpose", "quantize_transposed"),
    "weights transposed": ("titan_megamoe.kernels.transpose", "transposed_side_by_side"),
    "rows quantized": ("titan_megamoe.kernels.quantize", "quantize_rows"),
    "Gluon GEMM1": ("titan_megamoe.kernels.gluon.sm90.gate_up_gemm", "gate_up_gemm"),
    "Gluon rows GEMMs": ("titan_megamoe.kernels.gluon.sm90.grouped_gemm", "grouped_gemm"),
    "Gluon backward first GEMM": ("titan_megamoe.kernels.gluon.sm90.swiglu_grad_gemm", "swiglu_grad_gemm"),
    "Gluon weight gradients": ("titan_megamoe.kernels.gluon.sm90.token_grouped_gemm", "token_grouped_gemm"),
    "token-major copies": ("titan_megamoe.kernels.backward", "_token_major"),
    "round 0 weight gradients": ("titan_megamoe.kernels.backward", "_first_round_wgrad"),
    "Triton launches": ("titan_megamoe.kernels.launch", "launch"),
}
"""What ``--host`` times apart, inclusive of what each calls (a launch inside a Gluon
wrapper counts in both): a stage name -> (module, function), wrapped wherever the package
refers to it."""


@contextmanager
def timed_stages(stages: dict[str, tuple[str, str]]):
    """Inside, every reference the package's modules hold to each stage's function calls a
    wrapper that adds its wall time (outermost calls only) into the yielded dict (seconds)."""
    import importlib

    totals = {name: 0.0 for name in stages}
    patched = []
    for name, (module_name, attr) in stages.items():
        original = getattr(importlib.import_module(module_name), attr)
        depth = [0]

        def timed(*args, _original=original, _name=name, _depth=depth, **kwargs):
            _depth[0] += 1
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _depth[0] -= 1
                if _depth[0] == 0:
                    totals[_name] += time.perf_counter() - start

        for module in [m for key, m in list(sys.modules.items()) if key.startswith("titan_megamoe") and m]:
            for key, value in list(vars(module).items()):
                if value is original:
                    setattr(module, key, timed)
                    patched.append((module, key, original))
    try:
        yield totals
    finally:
        for module, key, original in patched:
            setattr(module, key, original)


def host_times(call, iters: int) -> tuple[float, float, int, str]:
    """``(wall ms per call, host ms to issue one, the host's waits for the device, the host
    profile's top lines)`` without the PyTorch profiler. The host is timed while the GPU
    sleeps through work issued first (so it never waits for the GPU unless a call makes
    it: ``fused.record_waits``, counted); the backward runs on the calling thread, so that
    Python's profiler sees it."""

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end) / iters
    text = io.StringIO()
    with torch.autograd.set_multithreading_enabled(False):
        torch.cuda._sleep(GPU_HOLD_CYCLES)
        with timed_stages(HOST_STAGES) as stages:
            for _ in range(iters):
                call()
        torch.cuda.synchronize()
        text.write("host time by stage, inclusive, ms per call (timers add a few us per wrapped call):")
        for name, seconds in stages.items():
            if seconds:
                text.write(f"\n  {seconds * 1e3 / iters:8.3f}  {name}")
        text.write("\n\n")
        torch.cuda._sleep(GPU_HOLD_CYCLES)
        waits = fused.record_waits()[0]
        issued = time.perf_counter()
        for _ in range(iters):
            call()
        issued = time.perf_counter() - issued
        waits = fused.record_waits()[0] - waits
        host_ms = issued * 1e3 / iters
        torch.cuda.synchronize()
        torch.cuda._sleep(GPU_HOLD_CYCLES)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(iters):
            call()
        profiler.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    return wall_ms, host_ms, waits, text.getvalue()


def memory_lines(memory: dict) -> list[str]:
    gib = 2**30
    symmetric = memory["symmetric_bytes"] / gib
    if memory["symmetric_in_allocator"]:
        total = f"{memory['peak_bytes'] / gib:.2f} GiB, the {symmetric:.2f} GiB of symmetric buffers among them"
    else:
        total = (f"{memory['peak_bytes'] / gib:.2f} GiB in the allocator + {symmetric:.2f} GiB symmetric = "
                 f"{memory['peak_bytes'] / gib + symmetric:.2f} GiB")
    lines = [f"    memory: peak {total}; before the call {memory['baseline_bytes'] / gib:.2f} GiB (the operator's "
             f"local buffers {memory['local_bytes'] / gib:.2f} among them); live at the peak:"]
    lines += [f"    {size / 2**20:10.1f} MiB  x{count:<3} {site}" for site, size, count in memory["sites"]]
    return lines


def inputs(shape: str, tokens: int, rank: int, world: int):
    layer = SHAPES[shape]
    hidden, inter, experts, top_k = layer.hidden, layer.inter, layer.experts, layer.top_k
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    scores = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=g), dim=1)
    topk_w, topk_idx = scores.topk(top_k, dim=1)
    local = experts // world
    w1, w3 = ((torch.randn(local, inter, hidden, device="cuda", generator=g) * 0.02).bfloat16() for _ in range(2))
    w2 = (torch.randn(local, hidden, inter, device="cuda", generator=g) * 0.02).bfloat16()
    return x, topk_idx, topk_w, w1, w2, w3


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer > 0")
    return int(text)


def comm_sms_list(text: str) -> list[int]:
    values = text.split(",")
    for value in values:
        if not value.isdigit():
            raise argparse.ArgumentTypeError(f"{value!r} is not a number of programs (an integer >= 0)")
    return [int(v) for v in values]


def tile_changes(text: str) -> dict[str, int | str]:
    """``field=value,...`` over the tile table's fields ("" keeps the table as is): integers,
    or names for the fields that name an implementation (``gemm2_kernel=tl``)."""
    changes = {}
    for item in filter(None, text.split(",")):
        field, sep, value = item.partition("=")
        if field not in TILE_FIELDS:
            raise argparse.ArgumentTypeError(f"unknown tile field {field!r}; fields: {', '.join(TILE_FIELDS)}")
        if TILE_FIELDS[field] is str:
            if value not in configs.ROWS_GEMM_KERNELS:
                raise argparse.ArgumentTypeError(f"{item!r}: expected {field}=<{' or '.join(configs.ROWS_GEMM_KERNELS)}>")
            changes[field] = value
            continue
        if not sep or not value.isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: expected {field}=<integer >= 0>")
        changes[field] = int(value)
    return changes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="30B-A3B", choices=list(SHAPES))
    p.add_argument("--tokens", type=positive_int, default=16384, help="tokens per rank")
    p.add_argument("--comm-sms", type=comm_sms_list, default=[0],
                   help="comma-separated values to compare (0: the operator's default, as the bench runs it)")
    p.add_argument("--tiles", type=tile_changes, nargs="*", default=[{}],
                   help='tile-table variants: field=value,... ("" for the table as is)')
    p.add_argument("--precision", default="bf16", choices=[c for c in PRECISION_CHOICES if c != "auto"],
                   help="the operator's precision; --tiles edit the rows of its forward and backward formats")
    p.add_argument("--backward", action="store_true", help="forward + backward per call")
    p.add_argument("--save-gemm1", action="store_true", help="the forward saves GEMM1's pre-activations")
    p.add_argument("--save-gemm1-load", type=positive_float, default=DEFAULT_SAVE_GEMM1_LOAD,
                   help="with --save-gemm1: rows saved, as a multiple of the mean a rank receives (the "
                        "backward recomputes the others)")
    add_buffer_arguments(p)
    p.add_argument("--iters", type=positive_int, default=10)
    p.add_argument("--host", action="store_true",
                   help="also time the host per call without the profiler, and profile its Python")
    p.add_argument("--memory", action="store_true",
                   help="also record one call's allocations and print what is live at its peak")
    p.add_argument("--out", default="outputs/profile_layer")
    return p.parse_args(argv)


def start_rank(script: str, shape: str, tokens: int):
    """``(rank, world, EP group or None, inputs)`` of a torchrun rank of ``script``, which
    runs the fused kernels: refuses a host without GPUs, then joins the NCCL group."""
    if not torch.cuda.is_available():
        sys.exit(f"{script}: the fused kernels need NVIDIA GPUs; torch {torch.__version__} sees none")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD if world > 1 else None
    return rank, world, group, inputs(shape, tokens, rank, world)


def main():
    args = parse_args()
    rank, world, group, (x, *rest) = start_rank("profile_layer", args.shape, args.tokens)
    x = x.requires_grad_(args.backward)
    dy = torch.randn_like(x)
    results = {}
    precision = get_precision(args.precision)
    arch = configs.arch_of(torch.cuda.get_device_capability())
    if arch is None:
        sys.exit(f"profile_layer: the tile table has no row for GPU {torch.cuda.get_device_name()}")
    fp8_mma = runs_fp8_mma(arch, precision)  # the ceiling is the MMA the kernels issue
    try:
        peak = matmul_peak_tflops(torch.device("cuda"), fp8=fp8_mma)
    except RuntimeError as error:  # the table then goes without shares, and says why
        peak = None
        print(f"profile_layer: the {args.precision} matmul peak could not be measured: {error}", file=sys.stderr)
    rows = 0
    # The rows the precision's kernels read: the forward format's, and the backward's
    # (which also tiles the weight gradients) where it differs (fp8_bwd).
    tables = {(arch, f.name): configs.TILE_CONFIGS[arch, f.name] for f in (precision.forward, precision.dgrad)}
    variants = [(comm, changes) for changes in args.tiles for comm in args.comm_sms]
    host_profiles = {}
    for comm_sms, changes in variants:
        # Each variant's tiles key buffers of their own in the fused backend.
        for row, table in tables.items():
            configs.TILE_CONFIGS[row] = dataclasses.replace(table, **changes)
        tiles = ",".join(f"{k}={v}" for k, v in changes.items()) or "table"
        label = f"comm_sms={comm_sms} tiles={tiles}"
        settings = OperatorSettings(precision=args.precision, backend="fused",
                                    capacity_tokens_per_rank=args.tokens * args.capacity_factor,
                                    comm_sms=comm_sms, save_gemm1=args.save_gemm1,
                                    save_gemm1_load=args.save_gemm1_load, receive_load=args.receive_load)

        def call():
            y, received = mega_moe(x, *rest, group, score_before_experts=False, settings=settings)
            if args.backward:
                y.backward(dy)
            return received

        received = call()  # this rank's received rows per local expert (same inputs every variant)
        rows = int(received.sum())
        hidden, inter = SHAPES[args.shape].hidden, SHAPES[args.shape].inter
        grad_tiles = configs.TILE_CONFIGS[arch, precision.dgrad.name]

        for _ in range(2):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            waited = fused.record_waits()[1]
            issued = time.perf_counter()
            for _ in range(args.iters):
                call()
            issued = time.perf_counter() - issued - (fused.record_waits()[1] - waited)
            end.record()
            torch.cuda.synchronize()
        kernels = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name[:60]] += e.device_time / args.iters / 1e3
        results[label] = {"wall_ms": start.elapsed_time(end) / args.iters, "host_ms": issued * 1e3 / args.iters,
                          "kernels_ms": dict(kernels),
                          "rows_kernels": (configs.TILE_CONFIGS[arch, precision.forward.name].gemm2_kernel,
                                           grad_tiles.dgrad_kernel), "wgrad_kernel": grad_tiles.wgrad_kernel,
                          "gemm1_kernel": configs.TILE_CONFIGS[arch, precision.forward.name].gemm1_kernel,
                          "grad1_kernel": grad_tiles.grad1_kernel}
        if args.host:
            wall_ms, host_ms, waits, host_profiles[label] = host_times(call, args.iters)
            results[label].update(unprofiled_wall_ms=wall_ms, unprofiled_host_ms=host_ms, host_waits=waits)
        if args.memory:
            _, memory = memory_at_peak(call)
            memory.update(fused.held_bytes(x, rest[0], rest[2], group, settings))
            results[label]["memory"] = memory
    configs.TILE_CONFIGS.update(tables)  # the log line below describes the table as it is
    if rank == 0:
        for r in results.values():
            r["stage_flops"] = stage_flops(rows, hidden, inter, args.backward, args.save_gemm1, r["rows_kernels"],
                                           r["wgrad_kernel"], r["gemm1_kernel"], r["grad1_kernel"])
        roofline = roofline_ms(rows, hidden, inter, args.backward, peak) if peak else None
        print(f"{args.precision} on {arch}: {describe_mma(arch, precision)}")
        print(f"{rows} rows received on rank 0; {'fp8' if fp8_mma else 'bf16'} matmul peak "
              + (f"{peak:.0f} TFLOP/s, expert-GEMM roofline {roofline:.3f} ms per call" if peak else "not measured"))
        print(f"buffers sized for {args.tokens * args.capacity_factor} tokens/rank, receive_load {args.receive_load}")
        for label, r in results.items():
            what = "forward + backward" if args.backward else "forward"
            share = f" ({100 * roofline / r['wall_ms']:.0f}% of the roofline)" if roofline else ""
            print(f"{args.shape} {args.tokens} tokens/rank EP={world} {args.precision} {what} {label}: {r['wall_ms']:.3f} ms per call"
                  f"{share}, {sum(r['kernels_ms'].values()):.3f} ms of kernels, the host issued a call in {r['host_ms']:.3f} ms")
            if "unprofiled_wall_ms" in r:
                print(f"    without the profiler: {r['unprofiled_wall_ms']:.3f} ms per call, the host issued "
                      f"one in {r['unprofiled_host_ms']:.3f} ms (GPU held busy), waiting for the device "
                      f"{r['host_waits']} times")
                print("    " + host_profiles[label].split("\n\n", 1)[0].replace("\n", "\n    "))
            print("\n".join(kernel_lines(r["kernels_ms"], r["stage_flops"], peak)))
            if "memory" in r:
                print("\n".join(memory_lines(r["memory"])))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        summary = {"args": vars(args), "ep": world, "rows_rank0": rows, "peak_tflops": peak,
                   "roofline_ms": roofline, "results": results}
        (out / "profile_layer.json").write_text(json.dumps(summary, indent=2))
        if host_profiles:
            (out / "host_profile.txt").write_text(
                "".join(f"==== {label}\n{text}\n" for label, text in host_profiles.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

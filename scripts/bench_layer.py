"""Layer A/B: stock TorchTitan MoE (ExpertParallel all-to-all), eager and compiled, vs
MegaMoE, one process group, same weights, same inputs, random routing, EP = every rank.

    ./scripts/bench_layer.sh [--shapes 30B-A3B,235B-A22B] [--tokens 4096,16384]
        [--variants stock,stock_compiled,stock_fp8,mega_moe_bf16,mega_moe] [--forward-only]
        [--backend auto] [--precision bf16]

``stock_fp8``, run only when asked for, is the stock layer as a TorchTitan job with the
``quantize.grouped_mm.float8`` converter and compile runs it (torchao fp8 rowwise grouped
GEMMs), the baseline of ``mega_moe --precision fp8``; it needs a GPU of compute
capability 8.9 or more. ``mega_moe_bf16``, also only when asked for, is MegaMoE in bf16
beside a quantized ``--precision``: the bar a quantized mega_moe is held to, in the same
run.

Started without torchrun (``bench_layer.sh``, or ``python scripts/bench_layer.py``), it
checks its arguments, says what it will run and starts itself under torchrun: one rank
per visible GPU with NCCL or, with no GPU, 2 gloo ranks on the CPU. On the CPU every
argument left out takes a small default (shape ``debug``, 256 tokens/rank, 3 iterations,
mega_moe on its ``reference`` backend, no ``stock_compiled``) instead of the GPU shapes,
and the first line printed says so; the variants that need a GPU (``stock_compiled``,
``stock_fp8``) are left out, and a line names each and why, so that a command written for
GPUs runs the rest (none left: an error). A CPU run checks that mega_moe computes what stock
computes; its timings say nothing about GPU speed, so it states no speedup, rate or
plot, and its header and summary say why.

Every rank runs the same fixed number of iterations (a self-tuning timer would run a
different count per rank and deadlock the collectives inside). ``--forward-only`` times
the forward alone, under ``torch.no_grad()``. Prints a line as each variant of each row
starts and ends, a table on rank 0, and writes ``bench_layer.json``, ``bench_layer.md``
and, with matplotlib, ``bench_layer.png`` into a new folder of ``--out`` named by the run's
start time (printed at the start and the end), so that a run never overwrites another's.
"""

import argparse
import dataclasses
import functools
import gc
import importlib.util
import itertools
import json
import os
import shlex
import statistics
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import titan_megamoe
from titan_megamoe.ops import BACKENDS, resolve_backend
from titan_megamoe.precision import GROUPED_MM_FLOAT8, PRECISION_CHOICES, get_precision
from titan_megamoe.reference import relative_error
from titan_megamoe.settings import DEFAULT_RECEIVE_LOAD, DEFAULT_SAVE_GEMM1_LOAD, OperatorSettings

# TorchTitan (and the modules of this package that build on it) take seconds to import;
# the functions that build layers import them, so that the launcher answers at once.


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
RANK_SHARES = (2, 8)
"""``<shape>@ep<N>``: one rank's share of the expert work at EP = N, for a single GPU: E / N
experts, each receiving N times the rows (the same tokens per rank and top-k), the
transfers local. The GEMMs' shapes per rank are EP = N's; the link is not."""
SHAPES.update({f"{name}@ep{ep}": dataclasses.replace(shape, experts=shape.experts // ep)
               for name, shape in list(SHAPES.items()) if name != "debug" for ep in RANK_SHARES})

VARIANTS = ("stock", "stock_compiled", "stock_fp8", "mega_moe_bf16", "mega_moe")
"""Stock TorchTitan eager (the reference every error is measured against), the same
layer compiled as TorchTitan compiles MoE blocks, that compiled layer with TorchTitan's
float8 grouped-MM converter on its routed experts, MegaMoE in bf16, and MegaMoE in
``--precision``."""

MEGA_VARIANTS = ("mega_moe_bf16", "mega_moe")

LABELS = {"stock": "stock", "stock_compiled": "stock compiled", "stock_fp8": "stock fp8",
          "mega_moe_bf16": "mega bf16", "mega_moe": "mega"}

BASELINES = ("stock", "stock_compiled", "stock_fp8", "mega_moe_bf16")
"""The variants mega_moe's speedups are stated over."""

FP8_CAPABILITY = (8, 9)
"""The compute capability below which TorchTitan's float8 grouped-MM converter refuses."""

BACKEND_CHOICES = ("auto", *BACKENDS)

DEFAULTS = {
    # What runs on GPUs: the shapes of the published results.
    # stock_fp8 only when asked for: it needs an fp8-capable GPU.
    "cuda": dict(shapes=["30B-A3B", "235B-A22B"], tokens=[4096, 16384],
                 variants=["stock", "stock_compiled", "mega_moe"], backend="auto", warmup=3, iters=20),
    # A small row that runs in seconds on two CPU cores. Stock compiled is left out (it
    # compiles the grouped GEMM as on GPUs), and the fused backend needs a GPU, so auto
    # would run mega_moe as stock: the reference backend gives a real A/B.
    "cpu": dict(shapes=["debug"], tokens=[256], variants=["stock", "mega_moe"],
                backend="reference", warmup=1, iters=3),
}

MEMORY_SITES_PRINTED = 12
"""Allocation sites printed per variant with ``--memory`` (the JSON holds them all)."""

CPU_RANKS = 2
CPU_BACKEND_REASON = ("chosen for the CPU: the fused kernels need an NVIDIA GPU, and auto would run mega_moe as "
                      "stock, the path the stock variant runs")
"""Why a CPU run's mega_moe runs the reference backend when ``--backend`` is left out."""
CPU_CAVEAT = ("CPU timings say nothing about GPU speed: no GPU path runs here (the fused kernels need an NVIDIA "
              "GPU; stock's grouped GEMMs run as a for-loop on the CPU). This A/B checks that mega_moe computes "
              "what stock computes (its errors against stock), not which is faster")
"""What a CPU run's header and summary say of its timings."""
COMPUTE_DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}
"""Weights and activations of every variant, by device type."""
MULTICAST_OFF = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off: the EP transport uses peer memory only."""


def _int(text: str, least: int, what: str) -> int:
    try:
        if int(text) >= least:
            return int(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not {what}")


def positive_int(text: str) -> int:
    return _int(text, 1, "an integer > 0")


def nonnegative_int(text: str) -> int:
    return _int(text, 0, "an integer >= 0")


def _float(text: str, positive: bool) -> float:
    try:
        if float(text) > 0 or (not positive and float(text) == 0):
            return float(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not a number {'>' if positive else '>='} 0")


def positive_float(text: str) -> float:
    return _float(text, positive=True)


def nonnegative_float(text: str) -> float:
    return _float(text, positive=False)


def token_counts(text: str) -> list[int]:
    return [_int(t, 1, "a token count (an integer > 0)") for t in text.split(",")]


def names_from(known):
    """An argparse type: comma-separated names, each from ``known``, none twice."""

    def parse(text: str) -> list[str]:
        names = text.split(",")
        for name in names:
            if name not in known:
                raise argparse.ArgumentTypeError(f"unknown name {name!r}; known: {', '.join(known)}")
            if names.count(name) > 1:
                raise argparse.ArgumentTypeError(f"{name!r} is given twice")
        return names

    return parse


def add_buffer_arguments(p: argparse.ArgumentParser) -> None:
    """The options that size the fused backend's buffers (``--capacity-factor``,
    ``--receive-load``), shared with ``profile_layer``."""
    p.add_argument("--capacity-factor", type=positive_int, default=1,
                   help="mega_moe fused: capacity_tokens_per_rank as this multiple of --tokens (default 1); its "
                        "buffers then hold what a routing over that many times the ranks can bring, so one GPU "
                        "measures the memory that EP = this factor sizes for")
    p.add_argument("--receive-load", type=nonnegative_float, default=DEFAULT_RECEIVE_LOAD,
                   help="mega_moe fused: buffers per received row sized for this multiple of the mean a rank "
                        "receives, grown when a call brings more; 0: for every row any routing can bring "
                        f"(default {DEFAULT_RECEIVE_LOAD})")


def parse_args(device: torch.device, argv=None) -> tuple[argparse.Namespace, str | None]:
    """Checked arguments, with the defaults of ``device``'s type filled in, the variants
    that need a GPU left out on the CPU, and the backend resolved
    (``args.resolved_backend``, ``args.backend_reason``); and the lines (one string, or
    None) that say what a CPU run does instead of what was asked: the CPU defaults in place
    of the GPU shapes, the variants left out and why."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=names_from(SHAPES),
                   help=f"comma-separated, from {', '.join(SHAPES)} (default: 30B-A3B,235B-A22B; CPU: debug)")
    p.add_argument("--tokens", type=token_counts, help="comma-separated tokens per rank (default: 4096,16384; CPU: 256)")
    p.add_argument("--variants", type=names_from(VARIANTS),
                   help=f"comma-separated, from {', '.join(VARIANTS)} "
                        "(default: stock,stock_compiled,mega_moe; CPU: stock,mega_moe)")
    p.add_argument("--forward-only", action="store_true", help="time the forward alone, under torch.no_grad()")
    p.add_argument("--precision", default="bf16", choices=PRECISION_CHOICES,
                   help="mega_moe precision (auto: bf16, as with no torchao converter)")
    p.add_argument("--backend", choices=BACKEND_CHOICES,
                   help="mega_moe backend (default: auto; CPU: reference)")
    p.add_argument("--ep-spans-nodes", action="store_true",
                   help="resolve the backend as if the EP group spanned nodes (auto then runs stock)")
    p.add_argument("--comm-sms", type=nonnegative_int, default=0,
                   help="mega_moe fused: dispatching programs (0: default)")
    p.add_argument("--reserved-sms", type=nonnegative_int, default=0,
                   help="mega_moe fused: SMs its persistent kernels leave free (default 0)")
    p.add_argument("--save-gemm1", action="store_true",
                   help="mega_moe fused: the forward keeps GEMM1's pre-activations for the backward")
    p.add_argument("--save-gemm1-load", type=positive_float, default=DEFAULT_SAVE_GEMM1_LOAD,
                   help="mega_moe fused, with --save-gemm1: rows saved, as a multiple of the mean a rank "
                        f"receives; the backward recomputes the others (default {DEFAULT_SAVE_GEMM1_LOAD})")
    add_buffer_arguments(p)
    p.add_argument("--warmup", type=nonnegative_int, help="untimed iterations first (default: 3; CPU: 1)")
    p.add_argument("--iters", type=positive_int, help="timed iterations (default: 20; CPU: 3)")
    p.add_argument("--memory", action="store_true",
                   help="record the allocator's history and print the blocks live at each variant's peak "
                        "(GPUs; the host then records every allocation, which slows host-bound rows)")
    p.add_argument("--out", default="outputs/bench_layer",
                   help="each run writes its files into a new folder in this one, named by its start time "
                        "(default outputs/bench_layer)")
    args = p.parse_args(argv)

    defaults = DEFAULTS[device.type]
    left_out = [name for name in defaults if getattr(args, name) is None]
    for name in left_out:
        setattr(args, name, defaults[name])
    dropped = {}
    if device.type == "cpu":
        args.variants, dropped = without_gpu_only(args.variants)
        if not args.variants:
            p.error(f"--variants: none of them runs without a GPU: {gpu_only_reasons(dropped)}")
    if "stock_fp8" in args.variants:
        refusal = stock_fp8_refusal(device)
        if refusal:
            p.error(f"--variants: stock_fp8 {refusal}")
    if "mega_moe_bf16" in args.variants and args.precision in ("auto", "bf16"):
        p.error(f"--variants: mega_moe_bf16 sets a quantized --precision against bf16; with --precision "
                f"{args.precision} mega_moe itself runs bf16")
    args.backend_left_out = "backend" in left_out
    lines = []
    if device.type == "cpu":
        if "shapes" in left_out or "tokens" in left_out:
            gpu = DEFAULTS["cuda"]
            backend = f"mega_moe backend {args.backend}" + (", chosen for the CPU" if args.backend_left_out else "")
            lines.append(
                f"[bench_layer] no NVIDIA GPU visible: running a small CPU A/B instead: shape "
                f"{','.join(args.shapes)} at {','.join(map(str, args.tokens))} tokens/rank, "
                f"{CPU_RANKS} gloo ranks, {args.iters} iterations after {args.warmup} warmup, "
                f"{' vs '.join(args.variants)} ({backend}). {CPU_CAVEAT}. The "
                f"{' and '.join(gpu['shapes'])} shapes at {' and '.join(f'{t:,}' for t in gpu['tokens'])} "
                f"tokens/rank need NVIDIA GPUs: run ./scripts/bench_layer.sh "
                f"{shlex.join(sys.argv[1:] if argv is None else argv)} on a machine with them"
            )
        if dropped:
            lines.append(f"[bench_layer] no NVIDIA GPU visible: running {', '.join(args.variants)}, leaving out "
                         f"{', '.join(dropped)}. {gpu_only_reasons(dropped)}")
    note = "\n".join(lines) or None

    args.precision_name = "bf16" if args.precision == "auto" else args.precision
    try:
        args.resolved_backend, args.backend_reason = resolve_backend(
            args.backend, device, COMPUTE_DTYPE[device.type], get_precision(args.precision_name),
            ep_within_node=not args.ep_spans_nodes,
        )
        # mega_moe_bf16's own backend: what the same request resolves to in bf16.
        args.bf16_backend, _ = resolve_backend(args.backend, device, COMPUTE_DTYPE[device.type],
                                               get_precision("bf16"), ep_within_node=not args.ep_spans_nodes)
    except NotImplementedError as error:
        p.error(f"--backend {args.backend}: {error}")
    if device.type == "cpu" and args.backend_left_out:
        args.backend_reason = CPU_BACKEND_REASON
    return args, note


def cpu_shims():
    """The tests' CPU shims (``tests/cpu/cpu_compat.py``), which let stock TorchTitan's MoE
    layers run on gloo ranks: support code of this repository, not of the package."""
    path = Path(__file__).resolve().parents[1] / "tests" / "cpu" / "cpu_compat.py"
    spec = importlib.util.spec_from_file_location("cpu_compat", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_refusal(variant: str) -> str | None:
    """Why ``variant`` cannot run on the CPU, or None where it can."""
    if variant == "stock_compiled":
        return "needs a GPU (it compiles the grouped GEMM as TorchTitan does there)"
    if variant == "stock_fp8":
        return stock_fp8_refusal(torch.device("cpu"))
    return None


def without_gpu_only(variants: list[str]) -> tuple[list[str], dict[str, str]]:
    """``variants`` less those that need a GPU, and why each of those was left out: a
    command written for GPUs still runs on the CPU, as an A/B of the variants that can."""
    dropped = {name: why for name in variants if (why := cpu_refusal(name))}
    return [name for name in variants if name not in dropped], dropped


def gpu_only_reasons(dropped: dict[str, str]) -> str:
    """One sentence per variant left out: its name and why it needs a GPU."""
    return " ".join(f"{name} {why}." for name, why in dropped.items())


def stock_fp8_refusal(device: torch.device) -> str | None:
    """Why ``stock_fp8`` cannot run on ``device``, or None: TorchTitan's converter check
    (compute capability), then torchao's MoE training import, which also fails where
    torchao's Triton kernels do not build with the installed Triton."""
    needs = "needs an NVIDIA GPU of compute capability >= {}.{} (fp8 grouped GEMMs)".format(*FP8_CAPABILITY)
    if device.type != "cuda":
        return f"{needs}; none is visible here"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return f"{needs}; {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
    try:
        import torchao.prototype.moe_training  # noqa: F401
    except Exception as error:
        return f"needs torchao's MoE training (torchao 0.16), which failed to import: {error!r}"
    return None


def worker_argv(args) -> list[str]:
    """The arguments that give the ranks exactly what the launcher resolved."""
    # A backend left out is left out for the ranks too: they say why it was chosen.
    backend = [] if args.backend_left_out else ["--backend", args.backend]
    argv = [
        "--shapes", ",".join(args.shapes), "--tokens", ",".join(map(str, args.tokens)),
        "--variants", ",".join(args.variants), "--precision", args.precision, *backend,
        "--comm-sms", str(args.comm_sms), "--reserved-sms", str(args.reserved_sms), "--save-gemm1-load", str(args.save_gemm1_load),
        "--capacity-factor", str(args.capacity_factor), "--receive-load", str(args.receive_load),
        "--warmup", str(args.warmup), "--iters", str(args.iters),
        "--out", args.out,
    ]
    flags = {"--forward-only": args.forward_only, "--save-gemm1": args.save_gemm1,
             "--ep-spans-nodes": args.ep_spans_nodes, "--memory": args.memory}
    return argv + [flag for flag, on in flags.items() if on]


def launch(args, nproc: int) -> None:
    """Replace this process with torchrun running ``nproc`` ranks of this script."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0", __file__, *worker_argv(args)]
    os.execv(sys.executable, argv)


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


def build_layers(shape: LayerShape, variants, device, dtype, ep_mesh, settings: dict) -> dict:
    """The asked-for variants, each its own layer with the same weights: stock MoE under
    ExpertParallel (compiled for ``stock_compiled``; converted to fp8, then compiled, for
    ``stock_fp8``), MegaMoE under MegaExpertParallel with ``settings[variant]``."""
    from torchtitan.distributed.expert_parallel import ExpertParallel
    from torchtitan.models.moe import MoE, MoEArgs

    from titan_megamoe.layer import MegaMoE
    from titan_megamoe.parallel import MegaExpertParallel

    moe_args = MoEArgs(
        num_experts=shape.experts, num_shared_experts=0, top_k=shape.top_k,
        score_func="softmax", route_norm=True, score_before_experts=False,
        # The stock grouped-MM path needs CUDA; on CPU its for-loop path runs instead.
        use_grouped_mm=device.type == "cuda", load_balance_coeff=None,
    )
    layers = {}
    for name in variants:
        torch.manual_seed(0)
        layer = MoE(moe_args, dim=shape.hidden, hidden_dim=shape.inter).to(device)
        with torch.no_grad():
            layer.init_weights(init_std=0.02, buffer_device=device)
        # Weights in the compute dtype; the load-balance counters stay fp32.
        layer.experts.to(dtype)
        layer.router.to(dtype)
        if name in MEGA_VARIANTS:
            layer = MegaMoE(layer, settings[name])
        if name == "stock_fp8":
            # Before ExpertParallel, as TorchTitan converts the model before parallelizing it.
            convert_like_torchtitan_fp8(layer, ep_degree=1 if ep_mesh is None else ep_mesh.size())
        if ep_mesh is not None:
            plan = MegaExpertParallel() if name in MEGA_VARIANTS else ExpertParallel()
            parallelize_module(layer.experts, ep_mesh, plan)
        if name in ("stock_compiled", "stock_fp8"):
            compile_like_torchtitan(layer, ep=ep_mesh is not None)
        layers[name] = layer
    return layers


def convert_like_torchtitan_fp8(layer, ep_degree: int) -> None:
    """Apply TorchTitan 0.2.2's ``quantize.grouped_mm.float8`` converter, built from a job
    config that asks for it on ``experts``, to ``layer``: its ``convert`` runs torchao's
    ``quantize_(layer, MoETrainingConfig(), filter_fn=<FQN contains "experts">)``, which
    wraps the routed experts' weights in ``ScaledGroupedMMTensor`` so that their
    ``torch._grouped_mm`` calls run as fp8 rowwise scaled grouped GEMMs, forward and
    backward.

    The converter also pads token groups to 16 rows (fp8's alignment) for the whole
    process; here that alignment holds only during this layer's forward, so the bf16
    layers keep TorchTitan's default of 8, as in a bf16 job.
    """
    from torchtitan.components.quantization.float8 import Float8GroupedMMConverter
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.moe import utils as moe_utils

    job = JobConfig()
    job.model.converters = [GROUPED_MM_FLOAT8]
    job.quantize.grouped_mm.float8.fqns = ["experts"]
    # The layer is compiled as TorchTitan compiles it (the converter warns otherwise).
    job.compile.enable = True
    job.compile.components = ["model"]
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=ep_degree, etp=1, world_size=ep_degree)
    default_alignment = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    converter = Float8GroupedMMConverter(job, dims)
    fp8_alignment = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    moe_utils.set_token_group_alignment_size_m(default_alignment)
    converter.convert(layer)
    layer.register_forward_pre_hook(lambda *_: moe_utils.set_token_group_alignment_size_m(fp8_alignment))
    layer.register_forward_hook(lambda *_: moe_utils.set_token_group_alignment_size_m(default_alignment))


def compile_like_torchtitan(layer, ep: bool) -> None:
    """Compile ``layer`` as TorchTitan 0.2.2's ``apply_compile`` (llama4, used by qwen3)
    compiles an MoE block: every child but ``experts`` (router, reorderer) fullgraph, the
    token dispatch/combine hooks on ``experts`` eager, and the module-level grouped-GEMM
    function fullgraph, with a dynamic token dimension under EP.

    ``apply_compile`` swaps that module-level function for the whole process; here the
    compiled one is swapped in only around this layer's forward, so the eager stock layer
    stays eager. The backward of the compiled function is already in its autograd graph.
    """
    from torchtitan.models.moe import moe as moe_module

    eager = moe_module._run_experts_grouped_mm
    torch._dynamo.config.capture_scalar_outputs = True
    for name, child in list(layer.named_children()):
        if name != "experts":
            setattr(layer, name, torch.compile(child, fullgraph=True))
    compiled = torch.compile(eager, fullgraph=True)

    def dynamic(w1, w2, w3, x, num_tokens_per_expert):
        torch._dynamo.mark_dynamic(x, 0)  # the routed row count varies under EP
        return compiled(w1, w2, w3, x, num_tokens_per_expert)

    grouped_mm = dynamic if ep else compiled
    layer.register_forward_pre_hook(lambda *_: setattr(moe_module, "_run_experts_grouped_mm", grouped_mm))
    layer.register_forward_hook(lambda *_: setattr(moe_module, "_run_experts_grouped_mm", eager))


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


def matmul_peak_tflops(device, fp8: bool = False) -> float | None:
    """bf16 (or, ``fp8``, e4m3 through ``torch._scaled_mm``) matmul rate measured here, the
    ceiling the layer's TFLOP/s is set against."""
    if device.type != "cuda":
        return None
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    if fp8:
        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major, as _scaled_mm takes it
        one = torch.ones((), device=device)

        def matmul():
            return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    else:
        def matmul():
            return a @ b
    for _ in range(3):
        matmul()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        matmul()
    end.record()
    end.synchronize()
    return 2 * n**3 * 10 / (start.elapsed_time(end) * 1e-3) / 1e12


PROJECT_DIRS = tuple(str(Path(p).resolve().parent) + os.sep for p in (
    titan_megamoe.__file__, importlib.util.find_spec("titan_megamoe.kernels").origin, __file__))
"""Where this project's code lies: a block is attributed to the innermost frame here."""


def live_at_peak(trace: list[dict], baseline: int) -> tuple[int, list[dict]]:
    """``(peak bytes, the allocations live at the peak)`` of one device's allocator trace
    (``torch.cuda.memory._snapshot()["device_traces"][device]``), ``baseline`` bytes being
    allocated when it began. A block counts from its ``alloc`` to its ``free_requested``:
    the allocator's count of allocated bytes drops at the request, before the block's
    stream uses complete."""
    live, now, peak, at_peak = {}, baseline, baseline, []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            now += event["size"]
            if now > peak:
                peak, at_peak = now, list(live.values())
        elif event["action"] == "free_requested" and event["addr"] in live:
            now -= live.pop(event["addr"])["size"]
    return peak, at_peak


def allocation_site(frames: list[dict]) -> str:
    """``file:line function`` of the innermost frame in this project's code (frames run
    innermost first), or of the innermost Python frame."""
    ours = [f for f in frames if f["filename"].startswith(PROJECT_DIRS)]
    if not (ours or frames):
        return "(no Python frame)"
    f = (ours or frames)[0]
    return f"{Path(f['filename']).name}:{f['line']} {f['name']}"


def memory_at_peak(run):
    """``(run(), memory)``, ``run`` under the caching allocator's history. ``memory``: the
    peak, the bytes allocated before ``run`` began, and the bytes live at the peak by
    allocation site (largest first)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        result = run()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, live = live_at_peak(trace, baseline)
    sites = defaultdict(lambda: [0, 0])
    for block in live:
        site = sites[allocation_site(block.get("frames", []))]
        site[0] += block["size"]
        site[1] += 1
    memory = {"peak_bytes": peak, "allocator_peak_bytes": torch.cuda.max_memory_allocated(),
              "baseline_bytes": baseline,
              "sites": sorted(([name, size, count] for name, (size, count) in sites.items()), key=lambda s: -s[1])}
    return result, memory


def measure(layer, x, dy, args, device, timer):
    """One variant's times and, on GPUs, peak memory (``--memory``: and the blocks live at
    the peak, ``memory_at_peak``); its output and gradients."""
    run = functools.partial(run_variant, layer, x, dy, timer, args.warmup, args.iters, args.forward_only)
    if device.type != "cuda":
        return run()
    if args.memory:
        (result, y, grads), memory = memory_at_peak(run)
        result["memory_at_peak"] = memory
    else:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        memory = {"baseline_bytes": torch.cuda.memory_allocated()}
        result, y, grads = run()
    result["resident_memory_gib"] = memory["baseline_bytes"] / 2**30
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
    """mega_moe over each baseline (stock, stock_compiled, stock_fp8), for every time
    both measured."""
    out = {}
    if "mega_moe" not in row:
        return out
    for base in BASELINES:
        for key in ("forward", "backward", "fwd_bwd"):
            if base in row and f"{key}_ms" in row[base]:
                out[f"{key}_vs_{base}"] = row[base][f"{key}_ms"] / row["mega_moe"][f"{key}_ms"]
    return out


def times_text(result, forward_only) -> str:
    return f"{result['forward_ms']:.2f}" + ("" if forward_only else f" / {result['fwd_bwd_ms']:.2f}")


def bench_row(layers, shape_name, tokens, args, device, dtype, timer, peak, say):
    """One (shape, tokens) row: every variant on the same inputs."""
    shape = SHAPES[shape_name]
    capacity = tokens * args.capacity_factor
    for name in MEGA_VARIANTS:
        if name in layers:
            # The fused backend sizes its buffers for the row's tokens per rank (times
            # --capacity-factor).
            experts = layers[name].experts
            experts.settings = experts.settings.replace(capacity_tokens_per_rank=capacity)
    g = torch.Generator(device=device).manual_seed(1000 + dist.get_rank())
    x = torch.randn(1, tokens, shape.hidden, device=device, dtype=dtype, generator=g)
    dy = torch.randn(1, tokens, shape.hidden, device=device, dtype=dtype, generator=g)
    row = {"shape": shape_name, "tokens_per_rank": tokens, "ep": dist.get_world_size()}
    # Routed-expert GEMM work: 3 GEMMs of 2*H*I flops per routed row forward, twice that backward.
    fwd_flops = 2 * 3 * tokens * shape.top_k * shape.hidden * shape.inter
    what = "fwd" if args.forward_only else "fwd / fwd+bwd"
    reference = None
    for name, layer in layers.items():
        prefix = f"[bench_layer] {shape_name} {tokens:,} tokens/rank: {name}"
        say(f"{prefix} started ({args.warmup} warmup + {args.iters} iterations)")
        start = time.perf_counter()
        result, y, grads = measure(layer, x, dy, args, device, timer)
        if name in MEGA_VARIANTS and "peak_memory_gib" in result:
            # The fused backend's symmetric buffers over several ranks live outside
            # PyTorch's caching allocator, so max_memory_allocated does not see them: add
            # them (one rank's are plain allocations, counted already). Imported here: it
            # loads Triton, which only GPU runs of the fused backend need.
            from titan_megamoe import fused, symm

            held = fused.symmetric_bytes(layer.experts.settings.precision.name,
                                         capacity_tokens_per_rank=capacity, hidden=shape.hidden)
            result["symmetric_memory_gib"] = held / 2**30
            if not symm.in_caching_allocator(dist.group.WORLD):
                result["peak_memory_gib"] += result["symmetric_memory_gib"]
            # This variant's buffers (over several ranks, its local ones) would otherwise
            # stay in the caching allocator through the next variant's measurement and
            # count in its peak. Every rank drops them once every rank is done with them.
            torch.cuda.synchronize()
            dist.barrier()
            fused.release_buffers()
        if device.type == "cuda":
            add_rates(result, fwd_flops, peak)
        if name == "stock":
            reference = (y, grads)
        elif reference is not None:
            result["rel_err_vs_stock"] = errors_vs_stock(y, grads, reference, device)
        row[name] = result
        say(f"{prefix} done in {time.perf_counter() - start:.1f} s: {times_text(result, args.forward_only)} ms ({what})")
        if "memory_at_peak" in result:
            say(f"{prefix}: peak {result['peak_memory_gib']:.2f} GiB; live at the peak besides what was allocated "
                f"before ({result['resident_memory_gib']:.2f} GiB):")
            for site, size, count in result["memory_at_peak"]["sites"][:MEMORY_SITES_PRINTED]:
                say(f"    {size / 2**20:10.1f} MiB  x{count:<3} {site}")
    row["speedup"] = speedups(row) if device.type == "cuda" else {}
    return row


def progress(row, forward_only, gpu_timings: bool) -> str:
    """One line per finished row."""
    parts = [f"{name} {times_text(row[name], forward_only)}" for name in VARIANTS if name in row]
    what = ("fwd" if forward_only else "fwd / fwd+bwd") + (" ms" if gpu_timings else " ms on the CPU, not a speed result")
    return f"[bench_layer] {row['shape']} {row['tokens_per_rank']:,} tokens/rank ({what}): " + ", ".join(parts)


def _get(row, variant, key):
    """``row[variant][key]``, or None where that variant or figure was not measured."""
    return row.get(variant, {}).get(key)


def _fmt(value, fmt="{:.2f}") -> str | None:
    return None if value is None else fmt.format(value)


def describe(meta) -> str:
    """What ran, in one line: device, EP, dtype, mega_moe settings, iterations."""
    backend = f"backend {meta['backend']} ({meta['backend_reason']})"
    if meta["ep_spans_nodes"]:
        backend += " [resolved as if the EP group spanned nodes]"
    precision = f"precision {meta['precision']}"
    if meta["precision_requested"] == "auto":
        precision += " (auto: bf16, as with no torchao grouped-MM converter)"
    if not get_precision(meta["precision"]).quantized and meta["dtype"] != "bfloat16":
        # "bf16" names the unquantized format: the GEMMs then run in the tensors' own dtype.
        precision += f": GEMMs unquantized, in {meta['dtype']}"
    fused = ""
    if meta["backend"] == "fused":
        capacity = meta["capacity_factor"]
        fused = (f", comm_sms {meta['comm_sms']}, reserved_sms {meta['reserved_sms']}, "
                 + (f"buffers for {capacity}x the tokens/rank, " if capacity > 1 else "")
                 + f"receive_load {meta['receive_load']}, "
                 + (f"GEMM1 saved for the backward up to {meta['save_gemm1_load']}x the mean load"
                    if meta["save_gemm1"] else "GEMM1 recomputed for the backward"))
    return (
        f"{meta['device']} x{meta['ep']} ({meta['dist_backend']}, EP={meta['ep']}); weights and activations "
        f"{meta['dtype']} in every variant; mega_moe {backend}, {precision}{fused}; "
        f"shapes {', '.join(meta['shapes'])}; tokens/rank {', '.join(f'{t:,}' for t in meta['tokens'])}; "
        f"{'forward only (no_grad)' if meta['forward_only'] else 'forward + backward'}, "
        f"median of {meta['iters']} iterations after {meta['warmup']} warmup"
    )


def table_columns(rows, meta) -> list[tuple[str, list[str | None]]]:
    """(header, cells) of every figure some row has; a cell is None where its row lacks it."""
    passes = [("forward", "fwd")]
    if not meta["forward_only"]:
        passes += [("backward", "bwd"), ("fwd_bwd", "fwd+bwd")]
    columns = [("shape", [r["shape"] for r in rows]), ("tokens/rank", [f"{r['tokens_per_rank']:,}" for r in rows])]
    gpu = meta["gpu_timings"]  # CPU timings compare nothing: no speedups or rates from them
    for key, short in passes:
        columns += [(f"{LABELS[v]} {short} ms", [_fmt(_get(r, v, f"{key}_ms")) for r in rows]) for v in VARIANTS]
        columns += [
            (f"{short} speedup vs {LABELS[base]}", [_fmt(r["speedup"].get(f"{key}_vs_{base}"), "{:.2f}x") for r in rows])
            for base in BASELINES if gpu
        ]
        if key == "forward" and gpu:
            rates = []
            for r in rows:
                rate = _fmt(_get(r, "mega_moe", "forward_tflops"), "{:.3g}")
                pct = _get(r, "mega_moe", "forward_pct_of_peak")
                rates.append(rate if pct is None else f"{rate} ({pct:.0f}% of peak)")
            columns.append(("mega fwd TFLOP/s", rates))
    columns += [(f"{LABELS[v]} peak GiB", [_fmt(_get(r, v, "peak_memory_gib")) for r in rows]) for v in VARIANTS]
    keys = ("y",) if meta["forward_only"] else ("y", "dx", "dgate", "dw1", "dw2", "dw3")
    for v in ("stock_fp8", "mega_moe_bf16", "mega_moe"):
        errors = []
        for r in rows:
            measured = _get(r, v, "rel_err_vs_stock")
            errors.append(None if measured is None else ", ".join(f"{measured[k]:.1e}" for k in keys))
        columns.append((f"{LABELS[v]} max rel err vs stock ({', '.join(keys)})", errors))
    return [(header, cells) for header, cells in columns if any(c is not None for c in cells)]


def markdown(rows, meta) -> str:
    peak = meta["matmul_peak_tflops"]
    lines = [f"Layer A/B on {describe(meta)}" + (f"; bf16 matmul peak measured {peak:.0f} TFLOP/s" if peak else ""), ""]
    if not meta["gpu_timings"]:
        lines[1:1] = ["", f"{CPU_CAVEAT}."]
    columns = table_columns(rows, meta)
    lines += ["| " + " | ".join(h for h, _ in columns) + " |", "|" + " --- |" * len(columns)]
    for i in range(len(rows)):
        lines.append("| " + " | ".join("-" if cells[i] is None else cells[i] for _, cells in columns) + " |")
    return "\n".join(lines) + "\n"


def cpu_summary(rows) -> str:
    """The last line of a CPU run: what it checked, and what its timings are not."""
    errors = [max(e.values()) for r in rows if (e := _get(r, "mega_moe", "rel_err_vs_stock"))]
    checked = f"mega_moe's largest relative error against stock: {max(errors):.1e}. " if errors else ""
    return f"[bench_layer] summary: {checked}{CPU_CAVEAT}; ./scripts/bench_layer.sh on NVIDIA GPUs measures speed"


def plot_title(meta) -> str:
    return (
        f"MoE layer A/B: {meta['device']} x{meta['ep']} (EP={meta['ep']}), {', '.join(meta['shapes'])}, "
        f"mega_moe {meta['precision']} ({meta['backend']} backend)"
    )


def plot(rows, meta, path: Path) -> str:
    if not meta["gpu_timings"]:  # bars of CPU timings would read as a speed result
        return "no plot: CPU timings say nothing about GPU speed"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'titan-megamoe[plot]')"
    variants = meta["variants"]
    labels = [f"{r['shape']}\n{r['tokens_per_rank']:,} tok" for r in rows]
    panels = [("forward_ms", "forward")]
    if not meta["forward_only"]:
        panels += [("backward_ms", "backward"), ("fwd_bwd_ms", "forward + backward")]
    panel_width = max(5, 0.8 * len(rows) * len(variants))
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_width * len(panels), 4.4), squeeze=False)
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
    title = plot_title(meta)
    # Wrapped to the figure: at 11 pt, 9 characters per inch leave room for wide ones.
    fig.suptitle(textwrap.fill(title, width=int(9 * fig.get_figwidth())), fontsize=11)
    fig.tight_layout()
    # The title also goes into the PNG's metadata, where tools (and tests) can read it.
    fig.savefig(path, dpi=120, metadata={"Title": title})
    plt.close(fig)
    return f"wrote {path}"


def new_run_folder(parent: Path) -> Path:
    """A new folder in ``parent`` for one run's files, named by its start time (with a
    count after it where a run that started in the same second has the name): a run never
    overwrites an earlier one's results."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for count in itertools.count(1):
        folder = parent / (stamp if count == 1 else f"{stamp}-{count}")
        try:
            folder.mkdir(parents=True)
        except FileExistsError:
            continue
        return folder


def free(layers) -> None:
    """Give a shape's layers and compiled code back before the next shape."""
    layers.clear()
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args, device, note) -> None:
    """One rank of the benchmark (under torchrun)."""
    cuda = device.type == "cuda"
    if not cuda:
        cpu_shims().apply()
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    rank0 = dist.get_rank() == 0

    def say(line: str) -> None:
        if rank0:
            print(line, flush=True)

    if note:  # started by torchrun directly, not through the launcher
        say(note)
    out = new_run_folder(Path(args.out)) if rank0 else None
    say(f"[bench_layer] this run writes its files to {out}")
    dtype = COMPUTE_DTYPE[device.type]
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "gpu_timings": cuda, "ep": world,
        "dist_backend": dist.get_backend(), "dtype": str(dtype).removeprefix("torch."),
        "shapes": args.shapes, "tokens": args.tokens, "variants": args.variants,
        "precision": args.precision_name, "precision_requested": args.precision,
        "backend": args.resolved_backend, "backend_reason": args.backend_reason,
        "ep_spans_nodes": args.ep_spans_nodes, "comm_sms": args.comm_sms, "reserved_sms": args.reserved_sms,
        "capacity_factor": args.capacity_factor, "receive_load": args.receive_load,
        "save_gemm1": args.save_gemm1, "save_gemm1_load": args.save_gemm1_load, "forward_only": args.forward_only, "iters": args.iters,
        "warmup": args.warmup,
    }
    say(f"[bench_layer] {describe(meta)}")
    if not cuda:
        say(f"[bench_layer] {CPU_CAVEAT}")
    ep_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",)) if world > 1 else None
    settings = OperatorSettings(precision=args.precision_name, backend=args.resolved_backend,
                                comm_sms=args.comm_sms, reserved_sms=args.reserved_sms, save_gemm1=args.save_gemm1,
                                save_gemm1_load=args.save_gemm1_load, receive_load=args.receive_load)
    settings = {"mega_moe": settings, "mega_moe_bf16": settings.replace(precision="bf16", backend=args.bf16_backend)}
    timer = Timer(device)
    meta["matmul_peak_tflops"] = matmul_peak_tflops(device)

    rows = []
    for shape_name in args.shapes:
        layers = build_layers(SHAPES[shape_name], args.variants, device, dtype, ep_mesh, settings)
        for tokens in args.tokens:
            row = bench_row(layers, shape_name, tokens, args, device, dtype, timer, meta["matmul_peak_tflops"], say)
            rows.append(row)
            say(progress(row, args.forward_only, cuda))
        free(layers)

    if rank0:
        table = markdown(rows, meta)
        (out / "bench_layer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (out / "bench_layer.md").write_text(table)
        print(table)
        print(plot(rows, meta, out / "bench_layer.png"))
        print(f"wrote {out / 'bench_layer.json'} and {out / 'bench_layer.md'}", flush=True)
        if not cuda:
            print(cpu_summary(rows), flush=True)
    dist.destroy_process_group()


def main():
    under_torchrun = "LOCAL_RANK" in os.environ
    cuda = torch.cuda.is_available()
    if under_torchrun and cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    args, note = parse_args(device)
    if under_torchrun:
        run(args, device, note)
    else:
        if note:
            print(note, flush=True)
        launch(args, torch.cuda.device_count() if cuda else CPU_RANKS)


if __name__ == "__main__":
    main()

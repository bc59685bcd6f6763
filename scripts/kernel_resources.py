"""What each fused kernel takes of a GPU, compiled on any host (no GPU needed).

    python scripts/kernel_resources.py [--precisions bf16,fp8,fp8_bwd] [--shape 30B-A3B]
                                       [--arch sm90] [--gluon] [--out DIR]

Runs the fused forward and backward (GEMM1 saved and recomputed, both score modes) on CPU
tensors with every Triton launch replaced by a compile for the architecture's target
(``sm_90a``, or ``sm_100a`` for the tile table's Blackwell rows), and prints, per kernel
variant, its shared memory, registers per thread, spill (stack) bytes, machine
instructions (how many, subroutine calls, local-memory accesses, stores of one or two
bytes) and MMA instructions, read from the compiled binary. A kernel whose shared memory
exceeds the architecture's limit cannot launch; spills cost time (and, on first launch, a
local-memory resize that waits for the device to go idle). Writes ``kernel_resources.json``.

``--gluon`` compiles the Gluon grouped GEMM core instead, at the layer's four row GEMMs with
its default tiles, at GEMM1 with its SwiGLU epilogue and the backward's first GEMM with
its SwiGLU-backward epilogue (the tile table's tiles) and (fp8) at the weight gradients dW1
and dW3, grouped along the tokens (bf16 and fp32 outputs), and records what the machine
code shows of its warp specialization: register reallocations (``setmaxnreg``), TMA loads
and stores, and the wgmma groups each wait leaves in flight.

The compile-only launch swaps in a stand-in for Triton's CUDA driver that names the
target and never touches a device: it depends on Triton's runtime internals (tested
with Triton 3.6 and 3.9).
"""

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver, jit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import SHAPES  # noqa: E402  (the bench's layer shapes)

CAPABILITY = {"sm90": 90, "sm100": 100}
"""Compute capability each tile-table architecture compiles for."""
SHARED_BYTES = {"sm90": 232448, "sm100": 232448}
"""Most shared memory one thread block may use (227 KB on H100/H200 and B200)."""

EP, TOKENS_PER_RANK, PROGRAMS, COMM_PROGRAMS = 2, 256, 132, 32
"""The group the kernels are compiled for; sizes that are runtime arguments do not change
the binaries."""


class CompileOnlyCuda(CudaDriver):
    """Triton's CUDA driver as far as compiling goes: a target of compute ``capability``,
    device 0, stream 0."""

    def __init__(self, capability: int):  # the real one loads libcuda
        self.capability = capability

    @classmethod
    def is_active(cls):
        return True

    def get_current_target(self):
        return GPUTarget("cuda", self.capability, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _cuobjdump(cubin: bytes, *options: str) -> list[str]:
    """``cuobjdump`` of a cubin, one report per option."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return [subprocess.run([str(tool), option, f.name], capture_output=True, text=True, check=True).stdout
                for option in options]


SASS_OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.MULTILINE)
"""The opcode of each instruction line of ``cuobjdump -sass`` (after its predicate)."""
NARROW_STORE = re.compile(r"\bSTG\.E\.(?:U|S)(?:8|16)\b")
"""A global store of one or two bytes: rows of e4m3 or bf16 stored an element at a time,
where the compiler lost their 16-byte alignment (every tile and row store here can be 16
bytes wide)."""


@functools.cache
def _usage(cubin: bytes) -> dict[str, int]:
    """Registers and stack bytes of a cubin, as ``cuobjdump -res-usage`` reports them, and
    from its machine code: instructions, subroutine calls (a correctly rounded division's
    slow path is one; the registers live across a call are spilled), local-memory
    loads and stores (spills), narrow stores and the warp-specialized structure. Once per
    cubin: a call launches most kernels several times (rounds, phases), each launch of one
    specialization the same cubin, and reading one takes ``cuobjdump`` half a second."""
    report, sass = _cuobjdump(cubin, "-res-usage", "-sass")
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)", report)
    if found is None:
        raise RuntimeError(f"cuobjdump reported no resource usage:\n{report}")
    regs, stack, _static_shared = map(int, found.groups())
    opcodes = SASS_OPCODE.findall(sass)
    return {"registers": regs, "stack_bytes": stack, "instructions": len(opcodes),
            "calls": opcodes.count("CALL"), "local_accesses": opcodes.count("STL") + opcodes.count("LDL"),
            "narrow_stores": len(NARROW_STORE.findall(sass)), **_warp_specialization(sass)}


def _warp_specialization(sass: str) -> dict[str, object]:
    """What a warp-specialized Hopper kernel's machine code shows of its structure: register
    reallocations between partitions (``setmaxnreg``), TMA loads and stores, and how many
    wgmma groups each wait leaves in flight."""
    return {"setmaxnreg": len(re.findall(r"\bUSETMAXREG\b", sass)),
            "tma_loads": len(re.findall(r"\bUTMALDG\b", sass)),
            "tma_stores": len(re.findall(r"\bUTMASTG\b", sass)),
            "mma_waits_in_flight": sorted({int(n, 16) for n in re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)",
                                                                          sass)})}


def _mma_shapes(ptx: str) -> str:
    """The MMA instructions of a kernel's PTX (Hopper wgmma, Blackwell tcgen05), shapes and types."""
    found = re.findall(r"(wgmma\.mma_async\.sync\.aligned\.\S+?|tcgen05\.mma\.\S+?)[ ;]", ptx)
    return " ".join(sorted({f.removeprefix("wgmma.mma_async.sync.aligned.") for f in found}))


def compile_instead_of_launching(records: list[dict], capability: int) -> None:
    """From now on a kernel launch compiles the kernel for compute ``capability`` and
    records its resources."""
    driver.set_active(CompileOnlyCuda(capability))
    compile_kernel = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = compile_kernel(self, *args, grid=grid, warmup=True, **kwargs)
        record = {"kernel": self.__name__, "num_warps": kernel.metadata.num_warps,
                  "num_stages": kernel.metadata.num_stages, "shared_bytes": kernel.metadata.shared}
        record.update(_usage(bytes(kernel.asm["cubin"])))
        record["mma"] = _mma_shapes(kernel.asm["ptx"])
        if record not in records:
            records.append(record)

    jit.JITFunction.run = run


def run_fused(precision_name: str, shape: str, arch: str) -> None:
    """One forward and backward of each kind (GEMM1 saved or recomputed, score before or
    after the experts), and one in several rounds, on CPU tensors, through the fused
    backend's host code."""
    from titan_megamoe.kernels.backward import GradBuffers, fused_backward
    from titan_megamoe.kernels.buffers import ForwardBuffers, ForwardShape
    from titan_megamoe.kernels.configs import tile_config
    from titan_megamoe.kernels.forward import fused_forward, preact_shape
    from titan_megamoe.precision import get_precision

    layer = SHAPES[shape]
    hidden, inter, top_k = layer.hidden, layer.inter, layer.top_k
    local = layer.experts // EP
    precision = get_precision(precision_name)
    tiles = tile_config(arch, precision.forward.name)
    grad_tiles = tile_config(arch, precision.dgrad.name)

    def symmetric(size, dtype):
        return torch.zeros(size, dtype=dtype), torch.zeros(EP, dtype=torch.int64)

    x = torch.randn(TOKENS_PER_RANK, hidden, dtype=torch.bfloat16)
    idx = torch.randint(0, layer.experts, (TOKENS_PER_RANK, top_k))
    scores = torch.rand(TOKENS_PER_RANK, top_k)
    w1, w3 = (torch.randn(local, inter, hidden, dtype=torch.bfloat16) for _ in range(2))
    w2 = torch.randn(local, hidden, inter, dtype=torch.bfloat16)
    # Buffers that hold every routing (one round a call), then a window of half the mean
    # rows: the later rounds' launches compile too (the weight gradients they add), with
    # half the mean rows saved and with every row saved (no row recomputed).
    for receive_load, kinds in ((0.0, [(0.5, False), (0.5, True), (0.0, False), (0.0, True)]),
                                (0.5, [(0.5, False), (4.0, False)])):
        fshape = ForwardShape(ep=EP, rank=0, capacity_tokens_per_rank=TOKENS_PER_RANK, top_k=top_k,
                              local_experts=local, hidden=hidden, inter=inter, dtype=torch.bfloat16,
                              row_format=precision.forward, native_resend=precision.backward_resends_native,
                              receive_load=receive_load)
        buffers = ForwardBuffers(fshape, tiles, torch.device("cpu"), symmetric)
        grad = GradBuffers(buffers, symmetric, precision, grad_tiles)
        for save_load, score_before in kinds:
            # Half the mean load saved: the backward's launch for the rows past them compiles
            # too. The backward consumes them: one per call. No kernel runs.
            saved = (torch.empty(preact_shape(fshape, tiles, save_load, TOKENS_PER_RANK), dtype=torch.bfloat16)
                     if save_load else None)
            _, _, routing = fused_forward(x, idx, scores, w1, w2, w3, buffers, score_before, COMM_PROGRAMS,
                                          PROGRAMS, 10.0, preact=saved)
            fused_backward(x, x, idx, scores, w1, w2, w3, saved, routing, buffers, grad, score_before,
                           COMM_PROGRAMS, PROGRAMS, 10.0)


def run_gluon(precision_name: str, shape: str, records: list[dict]) -> list[dict]:
    """The Gluon grouped GEMM core (``kernels.gluon.sm90``) at the layer's GEMMs, as
    ``scripts/gemm_bench.py`` runs them with the core's default tiles, on CPU tensors: one
    record per GEMM, named ``gluon <gemm>``."""
    import gemm_bench
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import DEFAULT_TILES, ExpertLayout, grouped_gemm

    local = SHAPES[shape].experts // EP
    layout = ExpertLayout.from_counts(torch.full((local,), TOKENS_PER_RANK), block_m=128, row_align=32)
    fp8 = precision_name == "fp8"
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    compiled = []
    for gemm in gemm_bench.ROW_GEMMS:
        case = gemm_bench.gemm_case(shape, local, gemm, precision_name)
        rows = layout.rows + 128
        b_shape = (local, case.n, case.k) if case.b_k_major else (local, case.k, case.n)
        b = torch.zeros(b_shape, dtype=dtype)
        scales = ((torch.ones(rows, case.k // 128), torch.ones(local, case.n // 128, case.k // 128)) if fp8
                  else (None, None))
        records.clear()
        grouped_gemm(torch.zeros(rows, case.k, dtype=dtype), b, torch.empty(rows, case.n, dtype=torch.bfloat16),
                     layout, DEFAULT_TILES[precision_name, case.two_b], b2=torch.zeros_like(b) if case.two_b else None,
                     a_scale=scales[0], b_scale=scales[1], b_k_major=case.b_k_major,
                     epilogue="swiglu" if case.two_b else "store", programs=PROGRAMS)
        compiled += [{**r, "kernel": f"gluon {gemm}"} for r in records]
    compiled += _compile_swiglu_gemms(shape, local, layout, dtype, records)
    if fp8:  # the weight gradients dW1 and dW3: grouped along the tokens
        from titan_megamoe.kernels.gluon.sm90.token_grouped_gemm import token_grouped_gemm

        layer = SHAPES[shape]
        blocks = torch.full((local,), -(-TOKENS_PER_RANK // 128), dtype=torch.int32)
        block_start = torch.cat([torch.zeros(1, dtype=torch.int32), blocks.cumsum(0).to(torch.int32)])
        tokens = int(block_start[-1]) * 128
        for out_dtype, name in ((torch.bfloat16, "gluon wgrad"), (torch.float32, "gluon wgrad fp32")):
            records.clear()  # fp32: the weight gradients of float32 activations
            token_grouped_gemm(torch.zeros(2 * layer.inter, tokens, dtype=dtype),
                               torch.ones(tokens // 128, 2 * layer.inter),
                               torch.zeros(layer.hidden, tokens, dtype=dtype),
                               torch.ones(tokens // 128, layer.hidden), block_start,
                               tuple(torch.empty(local, layer.inter, layer.hidden, dtype=out_dtype) for _ in range(2)),
                               programs=PROGRAMS)
            compiled += [{**r, "kernel": name} for r in records]
    return compiled


def _compile_swiglu_gemms(shape: str, local: int, layout, dtype: torch.dtype, records: list[dict]) -> list[dict]:
    """GEMM1 (``gate_up_gemm``, saving the pre-activations of half the rows) and the
    backward's first GEMM (``swiglu_grad_gemm``, every row saved; fp8 on W2 transposed,
    bf16 on W2 as stored) on the core, with the tiles the table gives them."""
    from titan_megamoe.kernels.configs import tile_config
    from titan_megamoe.kernels.gluon.sm90.arrivals import ChunkFlags
    from titan_megamoe.kernels.gluon.sm90.gate_up_gemm import GateUpTensors, gate_up_gemm
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import GemmTiles
    from titan_megamoe.kernels.gluon.sm90.swiglu_grad_gemm import SwigluGradTensors, swiglu_grad_gemm
    from titan_megamoe.kernels.sync import STATE_WORDS

    layer, fp8 = SHAPES[shape], dtype == torch.float8_e4m3fn
    hidden, inter = layer.hidden, layer.inter
    row = tile_config("sm90", "fp8_block" if fp8 else "native")
    rows = layout.rows + 128
    chunks = ChunkFlags(torch.zeros(4096, dtype=torch.int64), torch.zeros(EP, dtype=torch.int64),
                        torch.zeros(STATE_WORDS, dtype=torch.int64), torch.zeros(EP, local, dtype=torch.int32),
                        torch.zeros(EP, local, dtype=torch.int32), rank=0, ep=EP, chunk_ready=64, max_chunks=8)
    row_scales = torch.ones(rows, hidden // 128) if fp8 else None
    weight_scales = torch.ones(local, inter // 128, hidden // 128) if fp8 else None
    compiled = []

    records.clear()
    w1, w3 = (torch.zeros(local, inter, hidden, dtype=dtype) for _ in range(2))
    gate_up = GateUpTensors(torch.empty(rows, inter, dtype=dtype), torch.empty(rows, inter // 128) if fp8 else None,
                            torch.empty(rows // 2, 2 * inter, dtype=torch.bfloat16))
    gate_up_gemm(torch.zeros(rows, hidden, dtype=dtype), w1, w3, layout, chunks, gate_up,
                 GemmTiles(row.gemm1_n, row.gemm1_k, row.gemm1_stages), act_dtype=torch.bfloat16,
                 x_scale=row_scales, w1_scale=weight_scales, w3_scale=weight_scales, programs=PROGRAMS)
    compiled += [{**r, "kernel": "gluon gemm1"} for r in records]

    records.clear()
    w2t = torch.zeros((local, inter, hidden) if fp8 else (local, hidden, inter), dtype=dtype)
    swiglu_grad = SwigluGradTensors(
        torch.zeros(rows, 2 * inter, dtype=torch.bfloat16), torch.zeros(rows), torch.empty(rows, 2 * inter,
        dtype=torch.bfloat16), torch.empty(rows, inter, dtype=torch.bfloat16), torch.empty(rows, inter // 128),
        torch.empty(rows, 2 * inter, dtype=dtype) if fp8 else None, torch.empty(rows, 2 * inter // 128) if fp8 else None)
    swiglu_grad_gemm(torch.zeros(rows, hidden, dtype=dtype), w2t, layout, chunks, swiglu_grad,
                     GemmTiles(row.grad1_saved_n, row.grad1_k, row.grad1_saved_stages),
                     saved_m=row.grad1_m, score_before_experts=False, row_align=32, dy_scale=row_scales,
                     w2t_scale=weight_scales, b_k_major=fp8, programs=PROGRAMS)
    return compiled + [{**r, "kernel": "gluon swiglu_grad"} for r in records]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default="bf16,fp8,fp8_bwd", help="comma-separated precisions")
    p.add_argument("--shape", default="30B-A3B", choices=list(SHAPES))
    p.add_argument("--arch", default="sm90", choices=list(CAPABILITY), help="tile-table architecture")
    p.add_argument("--gluon", action="store_true",
                   help="compile the Gluon grouped GEMM core (sm90; precisions bf16 and fp8) instead of the fused "
                        "operator's kernels")
    p.add_argument("--out", default="outputs/kernel_resources")
    args = p.parse_args(argv)
    if args.gluon and (args.arch != "sm90" or not set(args.precisions.split(",")) <= {"bf16", "fp8"}):
        p.error("--gluon compiles the sm90 core in precisions bf16 and fp8")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_resources: compiles for the GPU; unset TRITON_INTERPRET")
    results = {}
    records: list[dict] = []
    compile_instead_of_launching(records, CAPABILITY[args.arch])
    target, limit = f"sm_{CAPABILITY[args.arch]}a", SHARED_BYTES[args.arch]
    for name in args.precisions.split(","):
        records.clear()
        print(f"[kernel_resources] {name}, {args.shape}: compiling for {target}", file=sys.stderr, flush=True)
        if args.gluon:
            results[name] = run_gluon(name, args.shape, records)
        else:
            run_fused(name, args.shape, args.arch)
            results[name] = list(records)
        print(f"\n{name} ({args.shape}, {target})")
        print(f"{'kernel':30s} {'warps':>5s} {'stages':>6s} {'shared KB':>9s} {'regs':>4s} {'spill B':>7s} "
              f"{'instr':>6s} {'calls':>5s} {'STL/LDL':>7s} {'narrow':>6s}  mma")
        for r in results[name]:
            over = "  > limit" if r["shared_bytes"] > limit else ""
            print(f"{r['kernel']:30s} {r['num_warps']:5d} {r['num_stages']:6d} {r['shared_bytes'] / 1024:9.1f} "
                  f"{r['registers']:4d} {r['stack_bytes']:7d} {r['instructions']:6d} {r['calls']:5d} "
                  f"{r['local_accesses']:7d} {r['narrow_stores']:6d}  {r['mma']}{over}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_resources.json").write_text(json.dumps(
        {"shape": args.shape, "arch": args.arch, "shared_limit_bytes": limit, "precisions": results}, indent=1))
    print(f"wrote {out / 'kernel_resources.json'}", file=sys.stderr)
    over = [(n, r["kernel"]) for n, rs in results.items() for r in rs if r["shared_bytes"] > limit]
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())

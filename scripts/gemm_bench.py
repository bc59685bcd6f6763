"""The operator's expert GEMMs alone, each implementation against the others, on one GPU.

    python scripts/gemm_bench.py [--layers 30B-A3B,235B-A22B] [--local-experts 128,16]
                                 [--tokens 16384] [--gemms gate_up,down,dy_w2,dgrad,wgrad_w13,wgrad_w2]
                                 [--precisions bf16,fp8] [--impls gluon,tl,torch]
                                 [--sweep] [--iters 20] [--out DIR]

Rows are what one rank receives: ``tokens x top-k`` routed rows spread at random over the
local experts (uneven, as a router spreads them; 16 local experts is one rank's share of
128 at EP = 8), laid out as the operator's receive buffer lays them out (each expert's
rows on a 32-row boundary). The GEMMs:

- ``gate_up``: ``h = silu(x W1^T) * (x W3^T)``, K = hidden, N = intermediate. Blockwise fp8
  runs one GEMM over ``[W1; W3]`` (N = 2 x intermediate) with a plain store: the
  mainloop's rate (its SwiGLU epilogue is not fused in fp8 yet).
- ``down``: ``h W2^T``, K = intermediate, N = hidden.
- ``dy_w2``: ``dy W2``, K = hidden, N = intermediate; bf16 reads W2 as stored (an N-major
  B), fp8 a K-major transposed copy (Hopper's fp8 MMA takes K-major operands only).
- ``dgrad``: ``[da | db] [W1 | W3]``, K = 2 x intermediate, N = hidden; N-major in bf16, a
  transposed copy in fp8.
- ``wgrad_w13`` and ``wgrad_w2`` (fp8 only): the weight gradients ``dW1 | dW3 = [da | db]^T
  x`` (M = 2 x intermediate, N = hidden, two outputs) and ``dW2 = dy^T h`` (M = hidden, N =
  intermediate), each expert contracting its own rows, as the backward runs them: on
  token-major e4m3 copies with one scale per column per 128-token block. ``gluon`` is
  ``kernels.gluon.sm90.token_grouped_gemm``, ``tl`` the ``tl`` kernel (``wgrad_kernel``)
  with its former tiles, ``torch`` torch's blockwise-scaled matmul one expert at a time
  (the backward's choice for deep experts).

Implementations: ``gluon`` (``kernels.gluon.sm90``; ``--sweep`` times every candidate tile
config, else the first), ``tl`` (the operator's ``tl.dot`` mainloop,
``kernels.mainloop.tile_gemm``, in a grouped kernel of its own with the tile table's
tiles), ``torch`` (``torch._grouped_mm`` in bf16, two calls for gate_up as TorchTitan's
experts make them; in fp8 ``torch._scaled_grouped_mm`` with rowwise scales, torchao's
recipe). Every output is checked against fp32 from the same (dequantized) operands
before it is timed; a wrong one is reported and not timed. Times are medians of
CUDA-event-timed runs after warm-up, rotating over input sets larger than L2; TFLOP/s
count the real rows (not the padding an implementation computes), against the matmul
peak of the precision measured in the same run. Prints a table and writes
``gemm_bench.json``.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import zlib
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.nn.functional import ScalingType, scaled_mm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import SHAPES, matmul_peak_tflops  # noqa: E402  (the bench's layer shapes)

from titan_megamoe.kernels.layout import tile_rows  # noqa: E402
from titan_megamoe.kernels.mainloop import tile_gemm  # noqa: E402

ROW_GEMMS = ("gate_up", "down", "dy_w2", "dgrad")
WGRAD_GEMMS = ("wgrad_w13", "wgrad_w2")
GEMMS = ROW_GEMMS + WGRAD_GEMMS
IMPLS = ("gluon", "tl", "torch")
PRECISIONS = ("bf16", "fp8")
LAYERS = ("30B-A3B", "235B-A22B")
ROW_ALIGN = 32
"""Each expert's rows start on a multiple of this (the operator's receive layout)."""
FP8_BLOCK = 128
INPUT_SETS = 3
"""Input sets timed in rotation (together well past the 50 MB L2 at these shapes)."""
TOLERANCE = {"bf16": 1e-2, "fp8": 1e-2}
"""Relative error against fp32 from the same operands (the output's own rounding, and
fp8 MMAs' limited-precision accumulation inside a 128-deep block)."""
ROWWISE_TOLERANCE = 8e-2
"""torch's rowwise fp8 quantizes the bf16 operands itself: measured against fp32 from the
bf16 operands."""


@dataclasses.dataclass(frozen=True)
class GemmCase:
    """One GEMM at one layer shape: ``out [rows, n] = a [rows, k] b[e]^T`` per expert."""

    gemm: str
    layer: str
    local_experts: int
    precision: str
    n: int
    k: int
    two_b: bool
    """gate_up in bf16: two weights, SwiGLU epilogue."""
    b_k_major: bool
    """B stored ``[experts, n, k]``; else ``[experts, k, n]`` (read as stored, bf16)."""
    m: int = 0
    """Weight gradients: output rows per expert (``out[e] [m, n] = A_e^T B_e``, K the
    expert's rows); 0 for the row GEMMs."""

    def flops(self, rows: int) -> int:
        if self.m:
            return 2 * rows * self.m * self.n
        return 2 * rows * self.k * self.n * (2 if self.two_b else 1)


def gemm_case(layer: str, local_experts: int, gemm: str, precision: str) -> GemmCase:
    shape = SHAPES[layer]
    h, i = shape.hidden, shape.inter
    fp8 = precision == "fp8"
    if gemm in WGRAD_GEMMS:
        if not fp8:
            raise ValueError(f"{gemm}: bf16 weight gradients run torch's grouped GEMM, which this bench does not time")
        m, n = (2 * i, h) if gemm == "wgrad_w13" else (h, i)
        return GemmCase(gemm, layer, local_experts, precision, n, 0, False, True, m=m)
    n, k, two_b, k_major = {
        "gate_up": (2 * i if fp8 else i, h, not fp8, True),
        "down": (h, i, False, True),
        "dy_w2": (i, h, False, fp8),
        "dgrad": (h, 2 * i, False, fp8),
    }[gemm]
    return GemmCase(gemm, layer, local_experts, precision, n, k, two_b, k_major)


def gluon_candidates(case: GemmCase):
    """Tile configs worth timing for ``case``: the core's default first."""
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import DEFAULT_TILES, GemmTiles

    if case.precision == "fp8":
        others = [GemmTiles(128, 128, 4), GemmTiles(128, 128, 6)]
    elif case.two_b:
        others = [GemmTiles(128, 64, 3), GemmTiles(64, 64, 6)]
    else:
        others = [GemmTiles(256, 64, 3), GemmTiles(128, 64, 6), GemmTiles(128, 64, 4)]
    return [DEFAULT_TILES[case.precision, case.two_b], *others]


# -- operands -----------------------------------------------------------------------------


@dataclasses.dataclass
class Operands:
    """One input set: bf16 operands, and for fp8 their blockwise quantization."""

    a: torch.Tensor
    b: torch.Tensor
    b2: torch.Tensor | None
    qa: torch.Tensor | None = None
    a_scale: torch.Tensor | None = None
    qb: torch.Tensor | None = None
    b_scale: torch.Tensor | None = None


def make_operands(case: GemmCase, rows: int, device, generator) -> Operands:
    from titan_megamoe.kernels.quantize import quantize_rows, quantize_weights
    from titan_megamoe.precision import FP8_BLOCK as FORMAT

    a = torch.randn(rows, case.k, generator=generator).to(device, torch.bfloat16)
    w_shape = (case.local_experts, case.n, case.k) if case.b_k_major else (case.local_experts, case.k, case.n)

    def weight():
        return (torch.randn(w_shape, generator=generator) / case.k**0.5).to(device, torch.bfloat16)

    ops = Operands(a, weight(), weight() if case.two_b else None)
    if case.precision == "fp8":
        ops.qa, ops.a_scale = quantize_rows(a, FP8_BLOCK, FORMAT.power_of_two)
        [(ops.qb, ops.b_scale)] = quantize_weights([ops.b], FORMAT)
    return ops


def _dequantized(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    expanded = scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return q.float() * expanded[..., :q.shape[-2], :q.shape[-1]]


def reference(case: GemmCase, ops: Operands, layout, quantized: bool) -> torch.Tensor:
    """fp32 ``out`` over every expert's rows (zeros elsewhere), from the operands the
    implementation multiplies (dequantized where ``quantized``)."""
    if quantized:
        a = _dequantized(ops.qa, ops.a_scale, (1, FP8_BLOCK))
        b, b2 = _dequantized(ops.qb, ops.b_scale, (FP8_BLOCK, FP8_BLOCK)), None
    else:
        a, b = ops.a.float(), ops.b.float()
        b2 = ops.b2.float() if ops.b2 is not None else None
    out = torch.zeros(a.shape[0], case.n, device=a.device)
    for e, (base, count) in enumerate(zip(layout.local_base.tolist(), layout.local_rows.tolist())):
        x = a[base:base + count]
        y = x @ (b[e].t() if case.b_k_major else b[e])
        if b2 is not None:
            y = torch.nn.functional.silu(y) * (x @ (b2[e].t() if case.b_k_major else b2[e]))
        out[base:base + count] = y
    return out


def live_rows(layout, total: int, device) -> torch.Tensor:
    live = torch.zeros(total, dtype=torch.bool, device=device)
    for base, count in zip(layout.local_base.tolist(), layout.local_rows.tolist()):
        live[base:base + count] = True
    return live


def relative_error(out: torch.Tensor, ref: torch.Tensor, live: torch.Tensor) -> float:
    """Relative Frobenius error over the experts' rows; NaN where any of them is not finite."""
    got, want = out[live].float(), ref[live]
    if not torch.isfinite(got).all():
        return float("nan")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# -- the tl mainloop in a grouped kernel ----------------------------------------------------


@triton.jit
def tl_grouped_gemm_kernel(a, a_scale, b, b_scale, b2, out, block_base, local_base, local_rows, local_experts,
                           num_blocks, N: tl.constexpr, K: tl.constexpr, LOCAL_PAD: tl.constexpr,
                           BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, TWO_B: tl.constexpr, SCALE_K: tl.constexpr,
                           B_N_MAJOR: tl.constexpr):
    """``tile_gemm`` over the layout's tiles, static stride over the programs, as the
    operator's rows GEMM runs it; SwiGLU with ``TWO_B``."""
    n_tiles: tl.constexpr = N // BLOCK_N
    num_tiles = tl.load(num_blocks) * (BLOCK_M // TILE_M) * n_tiles
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        n0 = (tile % n_tiles) * BLOCK_N
        le, _, end, row0 = tile_rows(block_base, local_base, local_rows, local_experts,
                                     (tile // n_tiles) * TILE_M, LOCAL_PAD)
        rows = row0 + tl.arange(0, TILE_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        product = tile_gemm(a, a_scale, rows, b, b_scale, b2, b_scale, le, n0, 0, K, N=N, K=K, BLOCK_M=TILE_M,
                            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, TWO_B=TWO_B, SCALE_K=SCALE_K, B_SCALE_N=SCALE_K,
                            MX_DOT=0, QUANTIZE_A=0, UPCAST_DOT=False, B_N_MAJOR=B_N_MAJOR, B_K_SPLIT=0)
        if TWO_B:
            g, u = product
            acc = g * tl.sigmoid(g) * u
        else:
            acc = product
        tl.store(out + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out.dtype.element_ty),
                 mask=(rows < end)[:, None])


def tl_impl(case: GemmCase, ops: Operands, layout, out):
    from titan_megamoe.kernels.configs import tile_config

    t = tile_config("sm90", "fp8_block" if case.precision == "fp8" else "native")
    if case.gemm == "gate_up" and case.two_b:
        tile_m, block_n, block_k, warps, stages = t.gemm1_m, t.gemm1_n, t.gemm1_k, t.gemm1_warps, t.gemm1_stages
    else:
        tile_m, block_n, block_k, warps, stages = t.gemm2_m, t.gemm2_n, t.gemm2_k, t.gemm2_warps, t.gemm2_stages
    fp8 = case.precision == "fp8"
    a, b = (ops.qa, ops.qb) if fp8 else (ops.a, ops.b)
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count
    local_pad = triton.next_power_of_2(case.local_experts)

    def run():
        tl_grouped_gemm_kernel[(programs,)](
            a, ops.a_scale, b, ops.b_scale, ops.b2, out, layout.block_base, layout.local_base, layout.local_rows,
            case.local_experts, layout.num_blocks, case.n, case.k, local_pad, t.block_m, tile_m, block_n, block_k,
            case.two_b, FP8_BLOCK if fp8 else 0, not case.b_k_major, num_warps=warps, num_stages=stages)
    return run


def gluon_impl(case: GemmCase, ops: Operands, layout, out, tiles):
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import grouped_gemm

    fp8 = case.precision == "fp8"

    def run():
        grouped_gemm(ops.qa if fp8 else ops.a, ops.qb if fp8 else ops.b, out, layout, tiles, b2=ops.b2,
                     a_scale=ops.a_scale, b_scale=ops.b_scale, b_k_major=case.b_k_major,
                     epilogue="swiglu" if case.two_b else "store")
    return run


def torch_impl(case: GemmCase, ops: Operands, layout, out):
    """TorchTitan's grouped GEMMs; each group is an expert's padded row range."""
    ends = torch.cat([layout.local_base[1:], layout.local_base.new_tensor([layout.rows])])
    a = ops.a[:layout.rows]
    b = ops.b.transpose(1, 2) if case.b_k_major else ops.b  # [E, K, N]
    if case.precision == "bf16":
        b2 = ops.b2.transpose(1, 2) if ops.b2 is not None else None

        def run():
            y = torch._grouped_mm(a, b, offs=ends)
            if b2 is not None:
                y = torch.nn.functional.silu(y) * torch._grouped_mm(a, b2, offs=ends)
            out[:layout.rows] = y
        return run
    # Rowwise e4m3 from the bf16 operands: one scale per row of A, per output column of B.
    a_scale = a.float().abs().amax(1).clamp_min(1e-12) / 448.0
    b_scale = b.float().abs().amax(1).clamp_min(1e-12) / 448.0  # [E, N]
    qa = (a.float() / a_scale[:, None]).to(torch.float8_e4m3fn)
    qb = (b.float() / b_scale[:, None, :]).to(torch.float8_e4m3fn).transpose(1, 2).contiguous().transpose(1, 2)

    def run():
        out[:layout.rows] = torch._scaled_grouped_mm(qa, qb, a_scale, b_scale, offs=ends, out_dtype=torch.bfloat16)
    return run


# -- the weight gradients -------------------------------------------------------------------

TL_WGRAD_TILES = dict(wgrad_kernel="tl", wgrad_m=64, wgrad_n=128, wgrad_k=128, wgrad_warps=4, wgrad_stages=3)
"""The ``tl`` weight-gradient kernel's tiles in the sm90 fp8 row before the Gluon kernel took
it (docs/perf-history.md v16, v43)."""


@dataclasses.dataclass
class TokenOperands:
    """One input set of a weight gradient: the two operands token-major (``[cols, tokens]``
    e4m3, each expert's rows from its first 128-token block, zeros past them), their scales
    ``[cols, tokens / 128]`` and block-major, and each expert's first block."""

    a: tuple[torch.Tensor, torch.Tensor]
    b: tuple[torch.Tensor, torch.Tensor]
    a_block_major: torch.Tensor
    b_block_major: torch.Tensor
    block_start: torch.Tensor
    per_expert: tuple[int, ...]


def make_token_operands(case: GemmCase, counts: torch.Tensor, device, generator) -> TokenOperands:
    from titan_megamoe.kernels.quantize import quantize_rows
    from titan_megamoe.precision import FP8_BLOCK as FORMAT

    per_expert = tuple(counts.tolist())
    blocks = [-(-c // FP8_BLOCK) for c in per_expert]
    starts = [0]
    for b in blocks:
        starts.append(starts[-1] + b)
    tokens = starts[-1] * FP8_BLOCK

    def operand(cols):
        values = torch.zeros(cols, tokens)
        for start, count in zip(starts, per_expert):
            values[:, start * FP8_BLOCK:start * FP8_BLOCK + count] = torch.randn(cols, count, generator=generator)
        return quantize_rows(values.to(device, torch.bfloat16), FP8_BLOCK, FORMAT.power_of_two)

    a, b = operand(case.m), operand(case.n)
    return TokenOperands(a, b, a[1].t().contiguous(), b[1].t().contiguous(),
                         torch.tensor(starts, dtype=torch.int32, device=device), per_expert)


def wgrad_reference(ops: TokenOperands) -> list[torch.Tensor]:
    """fp32 ``A_e^T B_e`` per expert from the dequantized copies."""
    (qa, sa), (qb, sb) = ops.a, ops.b
    a, b = _dequantized(qa, sa, (1, FP8_BLOCK)), _dequantized(qb, sb, (1, FP8_BLOCK))
    starts = ops.block_start.tolist()
    return [a[:, s * FP8_BLOCK:e * FP8_BLOCK] @ b[:, s * FP8_BLOCK:e * FP8_BLOCK].t()
            for s, e in zip(starts[:-1], starts[1:])]


def wgrad_impl(impl: str, case: GemmCase, ops: TokenOperands, outs: tuple[torch.Tensor, ...]):
    from types import SimpleNamespace

    from titan_megamoe.kernels import backward
    from titan_megamoe.kernels.configs import tile_config
    from titan_megamoe.kernels.gluon.sm90.token_grouped_gemm import token_grouped_gemm
    from titan_megamoe.precision import FP8_BLOCK as FORMAT

    tiles = tile_config("sm90", FORMAT.name)
    if impl == "gluon":
        return lambda: token_grouped_gemm(ops.a[0], ops.a_block_major, ops.b[0], ops.b_block_major, ops.block_start,
                                          outs)
    if impl == "tl":
        tl_tiles = dataclasses.replace(tiles, **TL_WGRAD_TILES)
        layout = SimpleNamespace(shape=SimpleNamespace(local_experts=case.local_experts))
        return lambda: backward._quantized_wgrad(layout, tl_tiles, FORMAT, ops.block_start, ops.a, ops.b, outs)
    return lambda: library_wgrad(ops, outs)


def library_wgrad(ops: TokenOperands, outs: tuple[torch.Tensor, ...]) -> None:
    """The comparison the ``torch`` implementation times: torch's blockwise-scaled matmul
    (on Hopper a cuBLASLt fp8 GEMM that applies each block's scales in its mainloop), one
    launch per expert over its token range (the host knows each expert's rows), zeros for
    an expert without rows."""
    (at, _), (bt, _) = ops.a, ops.b
    split = outs[0].shape[1] if len(outs) == 2 else 0
    k0 = 0
    for e, rows in enumerate(ops.per_expert):
        k1 = k0 + -(-rows // FP8_BLOCK) * FP8_BLOCK
        if k1 == k0:
            for out in outs:
                out[e].zero_()
            continue
        blocks = slice(k0 // FP8_BLOCK, k1 // FP8_BLOCK)
        product = scaled_mm(at[:, k0:k1], bt[:, k0:k1].t(), ops.a_block_major[blocks].t(), ScalingType.BlockWise1x128,
                            ops.b_block_major[blocks].t(), ScalingType.BlockWise1x128, output_dtype=outs[0].dtype)
        if split:
            outs[0][e].copy_(product[:split])
            outs[1][e].copy_(product[split:])
        else:
            outs[0][e].copy_(product)
        k0 = k1


def bench_wgrad_case(case: GemmCase, impls: list[str], tokens: int, top_k: int, iters: int, peak: dict, device,
                     say) -> list[dict]:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{case.layer} {case.local_experts} {case.gemm}".encode()))
    rows = tokens * top_k
    counts = torch.bincount(torch.randint(0, case.local_experts, (rows,), generator=generator),
                            minlength=case.local_experts)
    sets = [make_token_operands(case, counts, device, generator) for _ in range(INPUT_SETS)]
    split = case.gemm == "wgrad_w13"
    shape = (case.local_experts, case.m // 2 if split else case.m, case.n)
    flops = case.flops(rows)
    ref = wgrad_reference(sets[0])
    results = []
    for impl in impls:
        outs = [tuple(torch.full(shape, float("nan"), device=device, dtype=torch.bfloat16)
                      for _ in range(2 if split else 1)) for _ in sets]
        try:
            runs = [wgrad_impl(impl, case, s, o) for s, o in zip(sets, outs)]
            runs[0]()
            torch.cuda.synchronize()
        except Exception as error:  # reported, the rest go on
            say(f"  {impl}: cannot run: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            results.append({"impl": impl, "error": f"{type(error).__name__}: {error}"[:2000]})
            continue
        got = torch.cat(outs[0], dim=1).float()
        errors = [float((g - r).norm() / r.norm().clamp_min(1e-30)) for g, r in zip(got, ref) if r.abs().max() > 0]
        error = max(errors) if all(e == e for e in errors) else float("nan")
        results.append(checked_and_timed(impl, error, TOLERANCE["fp8"], "worst expert's relative error", runs, iters,
                                         flops, peak["fp8"], say))
    return [{**dataclasses.asdict(case), "rows": rows, "flops": flops, **r} for r in results]


# -- timing ---------------------------------------------------------------------------------


def median_ms(runs: list, iters: int) -> float:
    """Median over ``iters`` rounds of one run of each input set, CUDA events per run."""
    for run in runs:
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        for run in runs:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def checked_and_timed(name: str, error: float, bound: float, what: str, runs: list, iters: int, flops: int,
                      peak_tflops: float | None, say) -> dict:
    """One implementation's record: its error against fp32 (``what`` names the measure) and,
    where that is within ``bound``, its median time and rate; a wrong one is not timed."""
    record = {"impl": name, "rel_error": error}
    if not error <= bound:
        say(f"  {name}: WRONG: {what} {error:.3g} > {bound:g}; not timed")
        return {**record, "wrong": True}
    ms = median_ms(runs, iters)
    tflops = flops / (ms * 1e-3) / 1e12
    say(f"  {name}: {ms:.3f} ms, {tflops:.0f} TFLOP/s, error {error:.2e}")
    return {**record, "ms": ms, "tflops": tflops, "peak_share": tflops / peak_tflops if peak_tflops else None}


def bench_case(case: GemmCase, impls: list[str], tokens: int, top_k: int, iters: int, sweep: bool,
               peak: dict, device, say) -> list[dict]:
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import ExpertLayout

    generator = torch.Generator().manual_seed(zlib.crc32(f"{case.layer} {case.local_experts} {case.gemm}".encode()))
    rows = tokens * top_k
    counts = torch.bincount(torch.randint(0, case.local_experts, (rows,), generator=generator),
                            minlength=case.local_experts)
    layout = ExpertLayout.from_counts(counts.to(device), block_m=128, row_align=ROW_ALIGN)
    total = layout.rows + 128  # a tile's slack past the last expert, as receive buffers have
    sets = [make_operands(case, total, device, generator) for _ in range(INPUT_SETS)]
    live = live_rows(layout, total, device)
    flops = case.flops(rows)
    variants = []
    for impl in impls:
        if impl == "gluon":
            tiles_list = gluon_candidates(case)
            variants += [(f"gluon {t.block_m}x{t.block_n}x{t.block_k}/{t.stages}", impl, t)
                         for t in (tiles_list if sweep else tiles_list[:1])]
        else:
            variants.append((impl, impl, None))
    results = []
    for name, impl, tiles in variants:
        outs = [torch.full((total, case.n), float("nan"), device=device, dtype=torch.bfloat16) for _ in sets]
        try:
            if impl == "gluon":
                runs = [gluon_impl(case, s, layout, o, tiles) for s, o in zip(sets, outs)]
            elif impl == "tl":
                runs = [tl_impl(case, s, layout, o) for s, o in zip(sets, outs)]
            else:
                runs = [torch_impl(case, s, layout, o) for s, o in zip(sets, outs)]
            runs[0]()
            torch.cuda.synchronize()
        except Exception as error:  # a variant that cannot run here is reported, the rest go on
            say(f"  {name}: cannot run: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            results.append({"impl": name, "error": f"{type(error).__name__}: {error}"[:2000]})
            continue
        rowwise = impl == "torch" and case.precision == "fp8"
        error = relative_error(outs[0], reference(case, sets[0], layout, quantized=case.precision == "fp8"
                                                  and not rowwise), live)
        bound = ROWWISE_TOLERANCE if rowwise else TOLERANCE[case.precision]
        results.append(checked_and_timed(name, error, bound, "relative error", runs, iters, flops, peak[case.precision],
                                         say))
    return [{**dataclasses.asdict(case), "rows": rows, "flops": flops, **r} for r in results]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--local-experts", default="128,16", help="comma-separated local expert counts")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank (rows = tokens x top-k)")
    p.add_argument("--gemms", default=",".join(GEMMS))
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--sweep", action="store_true", help="time every candidate Gluon tile config")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="outputs/gemm_bench")
    args = p.parse_args(argv)

    def choices(value, allowed, what):
        items = value.split(",")
        bad = [i for i in items if i not in allowed]
        if bad:
            p.error(f"--{what}: {', '.join(bad)} not among {', '.join(allowed)}")
        return items

    layers = choices(args.layers, LAYERS, "layers")
    gemms = choices(args.gemms, GEMMS, "gemms")
    precisions = choices(args.precisions, PRECISIONS, "precisions")
    impls = choices(args.impls, IMPLS, "impls")
    local_experts = [int(e) for e in args.local_experts.split(",")]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("gemm_bench: needs a Hopper GPU (compute capability 9.0): the Gluon kernels are SM90's")

    def say(line):
        print(line, flush=True)

    device = torch.device("cuda")
    peak = {"bf16": matmul_peak_tflops(device), "fp8": matmul_peak_tflops(device, fp8=True)}
    say(f"gemm_bench on {torch.cuda.get_device_name()}: matmul peak bf16 {peak['bf16']:.0f}, "
        f"fp8 {peak['fp8']:.0f} TFLOP/s; {args.tokens} tokens x top-8 rows")
    results = []
    for layer in layers:
        for experts in local_experts:
            for precision in precisions:
                for gemm in gemms:
                    if gemm in WGRAD_GEMMS:
                        if precision != "fp8":
                            continue  # bf16's weight gradients are torch's grouped GEMM alone
                        case = gemm_case(layer, experts, gemm, precision)
                        say(f"{layer}, {experts} experts, {precision} {gemm}: M {case.m}, N {case.n}, K each "
                            "expert's rows")
                        results += bench_wgrad_case(case, impls, args.tokens, SHAPES[layer].top_k, args.iters, peak,
                                                    device, say)
                        continue
                    case = gemm_case(layer, experts, gemm, precision)
                    say(f"{layer}, {experts} experts, {precision} {gemm}: N {case.n}, K {case.k}"
                        + (", B N-major" if not case.b_k_major else ""))
                    results += bench_case(case, impls, args.tokens, SHAPES[layer].top_k, args.iters, args.sweep,
                                          peak, device, say)

    say("")
    say(f"{'layer':10s} {'experts':>7s} {'prec':4s} {'gemm':8s} {'impl':26s} {'ms':>8s} {'TFLOP/s':>8s} {'% peak':>6s}")
    for r in results:
        if "ms" in r:
            share = f"{100 * r['peak_share']:.0f}" if r.get("peak_share") else ""
            say(f"{r['layer']:10s} {r['local_experts']:7d} {r['precision']:4s} {r['gemm']:8s} {r['impl']:26s} "
                f"{r['ms']:8.3f} {r['tflops']:8.0f} {share:>6s}")
        else:
            say(f"{r['layer']:10s} {r['local_experts']:7d} {r['precision']:4s} {r['gemm']:8s} {r['impl']:26s} "
                + ("wrong" if r.get("wrong") else "cannot run"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_bench.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "peak_tflops": peak, "tokens": args.tokens, "results": results},
        indent=1))
    say(f"wrote {out / 'gemm_bench.json'}")
    return 1 if any(r.get("wrong") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The backward's first GEMM on the Gluon core alone (``swiglu_grad_gemm``, every row saved and
arrived), 30B-A3B's shape at 16,384 tokens (131,072 rows, random top-8 routing over 128
experts), against the plain ``dy W2`` grouped GEMM with the store epilogue on the same rows.

    STAGES="3 4" python docs/results/1xh100-grad1-schedules/standalone.py
    SKIP_GEMM=1 ...   only the fused kernel; NAME=... names the JSON written under $OUT
"""
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path[:0] = ["tests/gpu", "tests/cpu"]
from test_gluon_gemm_gpu import _arrived  # noqa: E402

from titan_megamoe.kernels.gluon.sm90.grouped_gemm import ExpertLayout, GemmTiles, grouped_gemm  # noqa: E402
from titan_megamoe.kernels.gluon.sm90.swiglu_grad_gemm import SwigluGradTensors, swiglu_grad_gemm  # noqa: E402
from titan_megamoe.kernels.quantize import quantize_rows, quantize_weights  # noqa: E402
from titan_megamoe.precision import get_precision  # noqa: E402

EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 128, 2048, 768, 16384, 8


def main():
    results = {}
    generator = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.bincount(torch.randint(0, EXPERTS, (TOKENS * TOP_K,), device="cuda", generator=generator),
                            minlength=EXPERTS)
    layout = ExpertLayout.from_counts(counts, block_m=128, row_align=32)
    rows = layout.rows + 128
    chunks = _arrived(counts)
    dy = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    w2t = (torch.randn(EXPERTS, INTER, HIDDEN, device="cuda") / HIDDEN**0.5).bfloat16()
    preact = (2 * torch.randn(rows, 2 * INTER, device="cuda")).bfloat16()
    score = torch.rand(rows, device="cuda")
    flops = 2 * int(counts.sum()) * INTER * HIDDEN

    def report(name, fn):
        ms = do_bench(fn, warmup=20, rep=200)
        results[name] = ms
        print(f"{name}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)

    for precision in ("fp8", "bf16"):
        fp8 = precision == "fp8"
        fmt = get_precision("fp8").dgrad
        if fp8:  # blockwise e4m3, W2 transposed (K-major), as the fp8 row runs it
            a, a_scale = quantize_rows(dy, 128, fmt.power_of_two)
            ((b, b_scale),) = quantize_weights([w2t], fmt)
        else:  # bf16, W2 as stored (N-major), as the bf16 row runs it
            a, a_scale, b, b_scale = dy, None, w2t.transpose(1, 2).contiguous(), None
        outs = SwigluGradTensors(
            preact, score, torch.empty(rows, 2 * INTER, device="cuda", dtype=torch.bfloat16),
            torch.empty(rows, INTER, device="cuda", dtype=torch.bfloat16),
            torch.empty(rows, INTER // 128, device="cuda"),
            torch.empty(rows, 2 * INTER, device="cuda", dtype=torch.float8_e4m3fn) if fp8 else None,
            torch.empty(rows, 2 * INTER // 128, device="cuda") if fp8 else None)
        for programs in (132, 100):  # every SM; those the dispatch's 32 leave in the operator
            for stages in [int(s) for s in os.environ.get("STAGES", "3").split()]:
                tiles = GemmTiles(128, 128 if fp8 else 64, stages)
                report(f"{precision} swiglu_grad programs={programs} stages={stages}",
                       lambda: swiglu_grad_gemm(a, b, layout, chunks, outs, tiles, saved_m=64 if fp8 else 128,
                                                score_before_experts=False, row_align=32, dy_scale=a_scale,
                                                w2t_scale=b_scale, b_k_major=fp8, power_of_two=fmt.power_of_two,
                                                programs=programs))
        if os.environ.get("SKIP_GEMM"):
            continue
        out = torch.empty(rows, INTER, device="cuda", dtype=torch.bfloat16)
        for programs in (132, 100):
            for block_n, stages in ((128, 5), (128, 3)) if fp8 else ((128, 4), (256, 4)):
                tiles = GemmTiles(block_n, 128 if fp8 else 64, stages)
                report(f"{precision} dy_w2 store programs={programs} n={block_n} stages={stages}",
                       lambda: grouped_gemm(a, b, out, layout, tiles, a_scale=a_scale, b_scale=b_scale,
                                            b_k_major=fp8, programs=programs))
    path = os.path.join(os.environ.get("OUT", "."), os.environ.get("NAME", "standalone") + ".json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

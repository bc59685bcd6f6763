"""Which rows the quantized weight-gradient GEMMs should read: measured against fp32.

    python scripts/wgrad_source_error.py [--rows 1024] [--out outputs/wgrad_source_error]

The weight gradients contract over an expert's rows, so their operands are quantized
along the rows (128 x 1 blocks for fp8, 32 x 1 for mxfp8). The expert inputs and dy
arrive quantized along the hidden dimension (1 x 128 / 1 x 32, the format of the GEMM
that reads them first). Either the weight-gradient GEMMs requantize those arrived
values (the reference's spec: nothing more crosses the link), or the bf16 rows are sent
as well and quantized along the rows from bf16. This prints the relative error of dw1,
dw2 and dw3 against fp32 for both, one expert on random data at the Qwen3 MoE shapes,
and writes the table as JSON. CPU only; about a minute.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from titan_megamoe import reference
from titan_megamoe.precision import get_precision
from titan_megamoe.reference import quantize_operand, relative_error

SHAPES = {"30B-A3B": (2048, 768), "235B-A22B": (4096, 1536)}
"""Expert shapes: (hidden, intermediate)."""
PRECISIONS = ("fp8", "mxfp8")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def errors(hidden: int, inter: int, rows: int, precision_name: str, seed: int) -> dict[str, dict[str, float]]:
    """``{"requantized": {dw1, dw2, dw3}, "from bf16": {...}}``: relative errors against fp32."""
    precision = get_precision(precision_name)
    g = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(rows, hidden, generator=g).bfloat16() for _ in range(2))
    # fp32 weights holding bf16 values: the gradients come back unrounded.
    w1, w3 = (torch.randn(1, inter, hidden, generator=g).bfloat16().float() / hidden**0.5 for _ in range(2))
    w2 = torch.randn(1, hidden, inter, generator=g).bfloat16().float() / inter**0.5
    idx, ones = torch.zeros(rows, 1, dtype=torch.int64), torch.ones(rows, 1)

    xf, gf = x.float(), dy.float()
    a, b = xf @ w1[0].T, xf @ w3[0].T
    sig = torch.sigmoid(a)
    dh = gf @ w2[0]
    da, db = dh * b * sig * (1 + a * (1 - sig)), dh * a * sig
    truth = {"dw1": da.T @ xf, "dw2": gf.T @ (F.silu(a) * b), "dw3": db.T @ xf}

    _, _, dw1, dw2, dw3 = reference.moe_backward(dy, x, idx, ones, w1, w2, w3, None, False, precision)
    requantized = {"dw1": dw1[0], "dw2": dw2[0], "dw3": dw3[0]}

    # The alternative: the same forward and dgrad, weight-gradient operands from bf16.
    fmt = precision.forward

    def q(t: torch.Tensor, is_weight: bool = False) -> torch.Tensor:
        return quantize_operand(t.contiguous(), fmt, is_weight)

    x_arrived, dy_arrived = q(x), q(dy)
    a8, b8 = x_arrived @ q(w1[0], True).T, x_arrived @ q(w3[0], True).T
    sig8 = torch.sigmoid(a8)
    h8 = (F.silu(a8) * b8).bfloat16()
    dh8 = dy_arrived @ q(w2[0].T, True).T
    da8 = (dh8 * b8 * sig8 * (1 + a8 * (1 - sig8))).bfloat16()
    db8 = (dh8 * a8 * sig8).bfloat16()
    from_bf16 = {"dw1": q(da8.T) @ q(x.T).T, "dw2": q(dy.T) @ q(h8.T).T, "dw3": q(db8.T) @ q(x.T).T}
    return {
        "requantized": {k: relative_error(v, truth[k]) for k, v in requantized.items()},
        "from bf16": {k: relative_error(v, truth[k]) for k, v in from_bf16.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=positive_int, default=1024, help="rows of the one expert (default 1024)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/wgrad_source_error")
    args = p.parse_args()

    results = []
    print("| precision | shape | rows | source | dw1 | dw2 | dw3 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for precision in PRECISIONS:
        for shape, (hidden, inter) in SHAPES.items():
            measured = errors(hidden, inter, args.rows, precision, args.seed)
            for source, errs in measured.items():
                results.append(dict(precision=precision, shape=shape, rows=args.rows, source=source, **errs))
                print(f"| {precision} | {shape} | {args.rows} | {source} | "
                      + " | ".join(f"{errs[k]:.4f}" for k in ("dw1", "dw2", "dw3")) + " |", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "wgrad_source_error.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'wgrad_source_error.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Precision names, the torchao recipe table, and the numeric formats they stand for.

A *format* says how one GEMM operand is stored: ``native`` (the tensor's own dtype,
bf16 in training), ``fp8_block`` (DeepSeek-V3 blockwise e4m3, fp32 scales) or
``mxfp8`` (OCP MX: e4m3, one UE8M0 scale per 32 elements along K).

A *precision* assigns a format to each of the three GEMM families of the operator:
the forward GEMMs, the backward data-gradient GEMMs (``dgrad``) and the weight-gradient
GEMMs (``wgrad``).
"""

from dataclasses import dataclass

NATIVE = "native"
FP8_BLOCK = "fp8_block"
MXFP8 = "mxfp8"

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
FP8_BLOCK_ACTIVATION = (1, 128)
"""fp8_block scale tile of activations and incoming gradients: 1 row x 128 along K."""
FP8_BLOCK_WEIGHT = (128, 128)
"""fp8_block scale tile of weights: 128 x 128."""
MX_BLOCK = 32
"""mxfp8 scale block: 32 elements along K, for every operand."""
UE8M0_EXP_MIN, UE8M0_EXP_MAX = -127, 127
"""Range of the power-of-two exponent a UE8M0 scale can hold."""


@dataclass(frozen=True)
class Precision:
    """Formats of the operator's three GEMM families."""

    name: str
    forward: str
    dgrad: str
    wgrad: str


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("bf16", NATIVE, NATIVE, NATIVE),
        Precision("fp8", FP8_BLOCK, FP8_BLOCK, FP8_BLOCK),
        Precision("fp8_bwd", NATIVE, FP8_BLOCK, FP8_BLOCK),
        Precision("mxfp8", MXFP8, MXFP8, MXFP8),
        Precision("mxfp8_wgrad_bf16", MXFP8, MXFP8, NATIVE),
    )
}
"""Every precision the operator runs, by name (the name travels through the custom op)."""

PRECISION_CHOICES = ("auto", "bf16", "fp8", "fp8_bwd", "mxfp8")
"""What ``[mega_moe] precision`` accepts."""

GROUPED_MM_FLOAT8 = "quantize.grouped_mm.float8"
GROUPED_MM_MX = "quantize.grouped_mm.mx"

MX_RECIPE_PRECISION = {
    "mxfp8": "mxfp8",
    "mxfp8_rceil": "mxfp8",
    "mxfp8_rceil_wgrad_with_hp": "mxfp8_wgrad_bf16",
}
"""torchao MX grouped-MM recipe -> precision (all MX recipes round scales up, RCEIL)."""


def precision_from_recipe(converters: list[str], mx_recipe: str) -> tuple[str, str]:
    """The precision that stands in for the torchao grouped-MM converter in ``converters``.

    Returns ``(precision name, what it was mapped from)``; bf16 when the list has none.
    """
    if GROUPED_MM_FLOAT8 in converters:
        return "fp8", f"{GROUPED_MM_FLOAT8} (torchao fp8 rowwise)"
    if GROUPED_MM_MX in converters:
        if mx_recipe not in MX_RECIPE_PRECISION:
            raise ValueError(
                f"[quantize.grouped_mm.mx] recipe_name = {mx_recipe!r} has no mega_moe "
                f"precision; supported recipes: {', '.join(MX_RECIPE_PRECISION)}"
            )
        return MX_RECIPE_PRECISION[mx_recipe], f"{GROUPED_MM_MX} recipe {mx_recipe!r}"
    return "bf16", "no torchao grouped-MM converter"


def get_precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(
            f"unknown precision {name!r}; known precisions: {', '.join(PRECISIONS)}"
        )
    return PRECISIONS[name]

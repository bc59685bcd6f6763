"""Precision names, the torchao recipe table, and the numeric formats they stand for.

A :class:`Format` says how one GEMM operand is stored: ``native`` (the tensor's own
dtype, bf16 in training), ``fp8_block`` (DeepSeek-V3 blockwise e4m3, fp32 scales) or
``mxfp8`` (OCP MX: e4m3, one UE8M0 scale per 32 elements along K). A :class:`Precision`
assigns a format to each of the operator's three GEMM families: the forward GEMMs, the
backward data-gradient GEMMs (``dgrad``) and the weight-gradient GEMMs (``wgrad``).

A precision name is parsed once, by :func:`get_precision`; everything below that (the
reference, the backends, the kernels' constexprs) works from the objects.
"""

import dataclasses
from dataclasses import dataclass

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
UE8M0_EXP_MIN, UE8M0_EXP_MAX = -127, 127
"""Range of the power-of-two exponent a UE8M0 scale can hold."""
AMAX_FLOOR = 2.0**-117
"""Smallest block maximum an fp32 scale is computed from: above it ``amax / 448`` is a
normal fp32 number and ``448 / amax`` finite (blocks of smaller nonzero values are scaled
as if their maximum were this; DeepSeek-V3's quantizer floors at 1e-4)."""


@dataclass(frozen=True)
class Format:
    """How one GEMM operand is stored.

    Scales are one per *scale block*: ``activation_block`` for rows of activations and
    incoming gradients, ``weight_block`` for weights, each ``(rows, columns along K)``.
    """

    name: str
    element: str
    """``native`` (the operand's own dtype), ``e4m3`` (with fp32 scales), or ``bf16``: the
    e4m3 format's values (each e4m3 value times its power-of-two scale, exact in bf16 from
    2^-126 up) held in bf16, for GEMMs on GPUs without an MMA for the format
    (``in_bf16``)."""
    activation_block: tuple[int, int] = (0, 0)
    weight_block: tuple[int, int] = (0, 0)
    power_of_two: bool = False
    """Scales are powers of two (UE8M0, rounded up: RCEIL) rather than fp32 ``amax / 448``."""

    @property
    def quantized(self) -> bool:
        """The operand's values are rounded to the format (stored in e4m3 or in bf16)."""
        return self.element != "native"

    @property
    def row_scale_k(self) -> int:
        """Elements per scale along a row of activations or gradients stored in e4m3 (0:
        unquantized, or held in bf16)."""
        return self.activation_block[1] if self.element == "e4m3" else 0

    @property
    def round_k(self) -> int:
        """Elements per block along a row of activations or gradients held in bf16 (0: not
        held so): each block is rounded to e4m3 times its scale where the row is made."""
        return self.activation_block[1] if self.element == "bf16" else 0

    @property
    def scaled_mma(self) -> bool:
        """The GEMMs hand the scales to the MMA (``tl.dot_scaled``: OCP MX, one UE8M0 scale
        per 32 elements along K of both operands) instead of promoting each scale block's
        partial product into the accumulator."""
        return (self.element == "e4m3" and self.power_of_two
                and self.activation_block == self.weight_block == (1, 32))

    def in_bf16(self) -> "Format":
        """This format's values held in bf16 (``element``): the GEMMs then run bf16 MMAs on
        exactly the values they would multiply in e4m3 with scales. Power-of-two scales
        only (others would not keep the values exact)."""
        if self.element != "e4m3" or not self.power_of_two:
            raise ValueError(f"format {self.name!r} has no exact bf16 form: that needs e4m3 values "
                             "with power-of-two scales")
        return dataclasses.replace(self, name=f"{self.name}_in_bf16", element="bf16")

    def block(self, is_weight: bool) -> tuple[int, int]:
        """The scale block of a weight operand or of an activation / gradient operand."""
        return self.weight_block if is_weight else self.activation_block


NATIVE = Format("native", "native")
FP8_BLOCK = Format("fp8_block", "e4m3", activation_block=(1, 128), weight_block=(128, 128))
MXFP8 = Format("mxfp8", "e4m3", activation_block=(1, 32), weight_block=(1, 32), power_of_two=True)
FORMATS = {f.name: f for f in (NATIVE, FP8_BLOCK, MXFP8)}


@dataclass(frozen=True)
class Precision:
    """Formats of the operator's three GEMM families."""

    name: str
    forward: Format
    dgrad: Format
    wgrad: Format
    wgrad_from_link: bool = False
    """Native weight gradients after a quantized forward: False, they read ``x`` and
    ``dy`` unquantized, so the backward sends both unquantized (torchao's ``with_hp``
    recipes); True, they read the rows that crossed quantized, dequantized into the
    activation dtype, so the link stays quantized both ways."""

    @property
    def formats(self) -> tuple[Format, Format, Format]:
        return self.forward, self.dgrad, self.wgrad

    @property
    def quantized(self) -> bool:
        """Whether any GEMM family quantizes its operands."""
        return any(f.quantized for f in self.formats)

    @property
    def backward_link(self) -> tuple[Format, Format]:
        """Formats the backward's expert-input rows and ``dy`` rows cross the link in: those
        of the GEMMs that read them on arrival (GEMM1, ``dy W2``), quantized once at their
        source; but native weight gradients read the same rows, so with those both cross
        unquantized (and the GEMMs quantize them as they read them), unless they read them
        dequantized (``wgrad_from_link``)."""
        if self.wgrad.quantized or self.wgrad_from_link:
            return self.forward, self.dgrad
        return NATIVE, NATIVE

    @property
    def backward_resends_native(self) -> bool:
        """The backward sends the expert inputs unquantized where the forward sent them
        quantized (``mxfp8_wgrad_bf16``)."""
        return self.forward.quantized and not self.backward_link[0].quantized


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("bf16", NATIVE, NATIVE, NATIVE),
        Precision("fp8", FP8_BLOCK, FP8_BLOCK, FP8_BLOCK),
        Precision("fp8_bwd", NATIVE, FP8_BLOCK, FP8_BLOCK),
        Precision("mxfp8", MXFP8, MXFP8, MXFP8),
        Precision("fp8_wgrad_bf16", FP8_BLOCK, FP8_BLOCK, NATIVE, wgrad_from_link=True),
        Precision("mxfp8_wgrad_bf16", MXFP8, MXFP8, NATIVE),
    )
}
"""Every precision the operator runs, by name."""

PRECISION_CHOICES = ("auto", "bf16", "fp8", "fp8_bwd", "fp8_wgrad_bf16", "mxfp8", "mxfp8_wgrad_bf16")
"""What ``[mega_moe] precision`` (and every script's ``--precision``) accepts; ``auto``
follows the torchao grouped-MM converter in ``model.converters``."""

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
    """The precision called ``name``; raises naming the known ones."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; known precisions: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]

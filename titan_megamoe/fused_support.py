"""Where the ``fused`` backend can run, decided from facts alone (no Triton import, so
``auto`` can rule it out on hosts that will never launch a kernel).

The fused kernels run where the tile table (``titan_megamoe.kernels.configs``) has a
row for the GPU's architecture and every format of the precision, for the activation
dtypes listed in ``SERVED_DTYPES``, with the EP group's GPUs on one node, and, quantized,
for experts whose intermediate size holds whole scale blocks (``shape_unsupported_reason``).
"""

import functools
from dataclasses import dataclass

import torch

from titan_megamoe.kernels.configs import INTERPRET, TILE_CONFIGS, arch_of
from titan_megamoe.precision import NATIVE, PRECISIONS, Precision

SERVED_DTYPES = {
    "sm90": (torch.bfloat16,),
    "sm100": (torch.bfloat16,),
    "interpret": (torch.float32, torch.bfloat16),
}
"""Activation dtypes the kernels are built and tested for, by architecture."""

AUTO_PRECISIONS = {
    # fp8_bwd: no layer bench of fused fp8_bwd exists; its figures are derived from measured
    # parts (one H200, EP 1, GEMM1 saved, bench_layer at 8e977fa): our bf16 forward, plus our
    # fp8 backward (fp8 fwd+bwd minus fp8 fwd), against stock bf16, fwd / fwd+bwd ms:
    # 30B-A3B 4k 1.19 / 4.32 vs 2.17 / 6.29, 16k 3.31 / 10.72 vs 7.21 / 18.31; 235B-A22B
    # 4k 3.16 / 13.26 vs 5.14 / 14.75, 16k 10.45 / 34.83 vs 18.11 / 46.60; 30B-A3B@ep8 16k
    # 2.98 / 8.88 vs 6.95 / 16.63. Faster at every row (least: 1.11x at 235B-A22B 4k),
    # where stock's own fp8_bwd path takes 35.06 ms at 30B-A3B 16k (stock.AUTO_NOTES).
    "sm90": ("bf16", "fp8", "fp8_bwd", "fp8_wgrad_bf16", "mxfp8", "mxfp8_wgrad_bf16"),
    "sm100": (),
    "interpret": ("bf16", "fp8", "fp8_bwd", "fp8_wgrad_bf16", "mxfp8", "mxfp8_wgrad_bf16"),
}
"""Precisions ``backend = "auto"`` gives the fused kernels, by architecture: those whose
fused layer the bench has measured faster than the same job without ``mega_moe`` there
(``fp8``: stock with torchao's FP8 recipe; ``fp8_wgrad_bf16``, which no torchao recipe
computes: stock bf16; sm90 ``mxfp8`` and ``mxfp8_wgrad_bf16``, which stock TorchTitan
cannot run on Hopper: stock bf16, measured on one H200, perf log v20), or, for sm90
``fp8_bwd``, which no torchao recipe computes either, derived faster than stock bf16 from
its measured parts (the comment above). The others run fused when asked for
(``backend = "fused"``) and go to the stock backend under ``auto``: every sm100 kernel
is compiled but never run."""


def arch(device: torch.device) -> tuple[str | None, str]:
    """``(tile-table architecture or None, what the device is)`` for ``device``."""
    if INTERPRET:
        return "interpret", "the Triton interpreter"
    if device.type != "cuda":
        return None, f"a {device.type} device"
    return _cuda_arch(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
@torch.compiler.assume_constant_result
def _cuda_arch(index: int) -> tuple[str | None, str]:
    """``arch`` of CUDA device ``index``, asked of the driver once: a device's capability
    never changes, and every call of the operator checks it. A constant to
    ``torch.compile``, which cannot trace the driver's answers (a full graph around the
    operator would fail on them)."""
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if torch.version.hip is not None:
        return None, f"{name}, a ROCm GPU (it reports compute capability {major}.{minor})"
    return arch_of((major, minor)), f"{name} (compute capability {major}.{minor})"


def why_not(device: torch.device, dtype: torch.dtype, precision: Precision, *,
            weight_dtype: torch.dtype | None = None, intermediate_size: int | None = None,
            ep_within_node: bool = True) -> str | None:
    """Why the fused backend cannot run experts computing in ``dtype`` on ``device`` in
    ``precision`` (with weights of ``weight_dtype`` and an intermediate size of
    ``intermediate_size``, where given; the EP group on one node or not), or None if it can:
    the one question every caller asks (``unsupported_reason``,
    ``weights_unsupported_reason``, ``shape_unsupported_reason``, in that order)."""
    reason = unsupported_reason(device, dtype, precision, ep_within_node)
    if reason is None and weight_dtype is not None:
        reason = weights_unsupported_reason(dtype, weight_dtype, precision)
    if reason is None and intermediate_size is not None:
        reason = shape_unsupported_reason(precision, intermediate_size)
    return reason


def auto_unsupported_reason(
    device: torch.device, dtype: torch.dtype, precision: Precision, ep_within_node: bool
) -> str | None:
    """Why ``auto`` does not pick the fused backend here (``unsupported_reason``, or a
    precision not yet measured faster than stock), or None if it does."""
    reason = unsupported_reason(device, dtype, precision, ep_within_node)
    if reason is not None:
        return reason
    target, _ = arch(device)
    if precision.name not in AUTO_PRECISIONS[target]:
        return (f"its {target} {precision.name} kernels are not yet measured faster than stock "
                "(backend = 'fused' runs them)")
    return None


def unsupported_reason(
    device: torch.device, dtype: torch.dtype, precision: Precision, ep_within_node: bool
) -> str | None:
    """Why the fused backend cannot run experts computing in ``dtype`` on ``device`` in
    ``precision``, or None if it can."""
    if not ep_within_node:
        return "its EP group must be GPUs of one node (NVLink peers); this one spans nodes"
    target, described = arch(device)
    if target is None:
        rows = ", ".join(sorted({a for a, _ in TILE_CONFIGS} - {"interpret"}))
        return f"the tile table has no row for {described}; it has: {rows} (H100/H200, B200)"
    one_backward_format = precision.wgrad == precision.dgrad and precision.forward in (NATIVE, precision.dgrad)
    # Native weight gradients read the rows as they crossed: unquantized, which GEMM1 and
    # ``dy W2`` then quantize as they read them (a scaled MMA's mainloop can), or quantized,
    # dequantized for them (``wgrad_from_link``).
    native_wgrad = (precision.wgrad == NATIVE and precision.forward == precision.dgrad
                    and (precision.dgrad.scaled_mma or precision.wgrad_from_link))
    if not (one_backward_format or native_wgrad):
        return (f"precision {precision.name!r} mixes formats (forward {precision.forward.name}, "
                f"backward {precision.dgrad.name} / {precision.wgrad.name}); the fused kernels run one "
                "format throughout, a native forward with one backward format, or a quantized "
                "format with native weight gradients (fp8_wgrad_bf16, mxfp8_wgrad_bf16)")
    missing = sorted({f.name for f in precision.formats if (target, f.name) not in TILE_CONFIGS})
    if missing:
        return (f"precision {precision.name!r} needs {', '.join(missing)} GEMM kernels, which the "
                f"fused backend does not have on {target} yet")
    if dtype not in SERVED_DTYPES[target]:
        served = ", ".join(str(d).removeprefix("torch.") for d in SERVED_DTYPES[target])
        return (f"its {target} kernels take {served} activations; these experts compute in "
                f"{str(dtype).removeprefix('torch.')} (FSDP's mixed_precision_param sets it)")
    return None


def reads_weights_quantized(precision: Precision) -> bool:
    """Whether every fused GEMM that reads the expert weights (GEMM1 and GEMM2 in the
    forward's format, the backward's in its dgrad format) reads them quantized: the
    kernels then quantize the weights from whatever float dtype they are stored in, so
    float32 weights need no bf16 copy (their weight gradients come back in float32)."""
    return precision.forward.quantized and precision.dgrad.quantized


@dataclass(frozen=True)
class OperandCasts:
    """The copies a layer hands the fused kernels of experts computing in a dtype the
    kernels do not take: its tokens in ``tokens``, its weights in ``weights``, or, where
    ``weights`` is None, the weights as stored (``reads_weights_quantized``)."""

    tokens: torch.dtype
    weights: torch.dtype | None

    def describe(self, computes: torch.dtype) -> str:
        """How the kernels take the operands, for the log."""
        if self.weights is None:
            return (f"the fused kernels take {self.tokens} copies of their tokens, as TorchTitan's grouped-MM "
                    f"path does, and quantize the {computes} weights themselves")
        return (f"the fused kernels take {self.tokens} copies of their tokens and weights, as TorchTitan's "
                "grouped-MM path does")


def operand_cast(device: torch.device, dtype: torch.dtype, precision: Precision) -> OperandCasts | None:
    """The copies a layer makes of the tokens and weights of experts computing in
    ``dtype`` before the fused kernels, or None (none): for float32 experts, where the
    kernels take bf16 but not float32, bf16 tokens, and bf16 weights unless the precision
    reads them only quantized (``reads_weights_quantized``: the kernels quantize the
    float32 weights). TorchTitan's grouped-MM path runs its GEMMs on bf16 copies too,
    whatever the parameters' dtype (single-device and DDP jobs keep float32 parameters);
    the layer casts the output back."""
    target, _ = arch(device)
    if target is None or dtype in SERVED_DTYPES[target]:
        return None
    if dtype == torch.float32 and torch.bfloat16 in SERVED_DTYPES[target]:
        return OperandCasts(torch.bfloat16, None if reads_weights_quantized(precision) else torch.bfloat16)
    return None


def weights_unsupported_reason(dtype: torch.dtype, weight_dtype: torch.dtype, precision: Precision) -> str | None:
    """Why the fused kernels cannot take weights of ``weight_dtype`` with activations of
    ``dtype`` in ``precision``, or None: weights in the activations' dtype, or float32
    weights that every GEMM reads quantized (``reads_weights_quantized``)."""
    if weight_dtype == dtype or (weight_dtype == torch.float32 and reads_weights_quantized(precision)):
        return None
    return (f"{str(weight_dtype).removeprefix('torch.')} weights with {str(dtype).removeprefix('torch.')} tokens "
            f"in precision {precision.name!r}: its kernels take weights in the tokens' dtype, or float32 weights "
            f"where every GEMM reads them quantized ({', '.join(_QUANTIZED_WEIGHT_READS)})")


_QUANTIZED_WEIGHT_READS = tuple(name for name, p in PRECISIONS.items() if reads_weights_quantized(p))
"""The precisions that take float32 weights with bf16 tokens."""


def runs_fp8_mma(target: str, precision: Precision) -> bool:
    """Whether the fused GEMMs of ``precision`` issue fp8 MMAs on architecture ``target``
    (Hopper has no MX MMA: MX tiles go through bf16 MMAs there)."""
    fmt = precision.dgrad
    return fmt.quantized and not (fmt.scaled_mma and target == "sm90")


def describe_mma(target: str, precision: Precision) -> str:
    """How the fused GEMMs of ``precision`` multiply on architecture ``target``, for the log."""
    fmt = precision.dgrad
    if not fmt.quantized:
        return "bf16 MMA"
    if not fmt.scaled_mma:
        return f"fp8 MMA, scales promoted per {fmt.row_scale_k}-element block"
    if target == "sm90":
        if TILE_CONFIGS[target, fmt.name].mx_in_bf16:
            described = ("MX MMA emulated: Hopper has none, so the operands are held in bf16 rounded to MX "
                         "(exact; the rows cross the link in bf16) and multiplied by bf16 MMAs")
        else:
            described = ("MX MMA emulated: Hopper has none, so each e4m3 tile is scaled into bf16 and "
                         "multiplied by a bf16 MMA (exact)")
        if precision.wgrad.scaled_mma and TILE_CONFIGS[target, precision.wgrad.name].mx_wgrad_dequantized:
            described += ("; weight gradients by torch's bf16 grouped GEMM on copies quantized along "
                          "the tokens and dequantized (exact)")
        return described
    if target == "sm100":
        return "native MX MMA (block-scaled tcgen05)"
    return "MX scaled dot"


def shape_unsupported_reason(precision: Precision, inter: int) -> str | None:
    """Why the fused kernels cannot run experts of intermediate size ``inter`` in
    ``precision``, or None if they can: a quantized backward stores the SwiGLU gradient
    ``[da | db]`` in whole scale blocks along the intermediate dimension."""
    block = precision.dgrad.row_scale_k
    if block and inter % block:
        return (f"precision {precision.name!r} quantizes the SwiGLU gradient in blocks of {block} along the "
                f"intermediate size, and these experts' intermediate size {inter} is not a multiple of {block}")
    return None

"""The routed experts as stock TorchTitan 0.2.2 computes them under its ``ExpertParallel``.

The ``stock`` backend: where the fused operator cannot serve a layer, ``auto`` runs it
here, at stock TorchTitan's speed, because the work is stock's own: the same token sort,
the same count exchange and host-synchronised splits, torch's autograd all-to-all, the
same alignment padding (``generate_permute_indices``) and TorchTitan's own expert
functions, ``_run_experts_grouped_mm`` on CUDA and ``_run_experts_for_loop`` on the CPU.
Only the glue that TorchTitan spreads over modules, DTensor hooks and module state
(``MoE.forward``, ``TokenReorderer``, ``ExpertParallel._token_dispatch`` /
``_token_combine``, ``_permute``) is restated here for plain tensors and a process group.
Gradients flow through ordinary autograd.

Numerics are stock's: the score multiplies the expert input in fp32 and is rounded to
the activation dtype (``score_before_experts``), or weights the k expert outputs in an
fp32 batched product; on CUDA the GEMMs run in bf16 whatever the parameters' dtype (as
``_run_experts_grouped_mm`` casts them), on the CPU in the activation dtype.

Precisions, as a stock job with the matching torchao converter runs them:

- ``bf16``: ``torch._grouped_mm``.
- ``fp8`` (``quantize.grouped_mm.float8``): every grouped GEMM goes to torchao's
  ``_quantize_then_scaled_grouped_mm`` with ``MoEScalingType.FP8_ROWWISE``, which is
  where torchao's ``ScaledGroupedMMTensor`` weights send ``torch._grouped_mm`` in a
  stock job. That format is torchao's (e4m3, one power-of-two scale per row of each
  operand along K), not the blockwise format of mega_moe's ``fp8`` reference. The
  expert function of the quantized recipes is compiled, as a stock job that compiles
  runs it (bf16 runs whatever TorchTitan's module holds: compiled in such a job).
- ``fp8_bwd``: bf16 forward GEMMs; their gradients computed by torchao's fp8 rowwise
  backward (``_Float8GroupedMM.backward``).
- ``mxfp8`` / ``mxfp8_wgrad_bf16``: torchao's MXFP8 grouped GEMMs, on SM100 only, as
  TorchTitan's MX converter demands.

The fp8 recipes need hidden and intermediate sizes that are multiples of 32 (a torchao
kernel writes past its buffer otherwise, in stock jobs too); other sizes raise.

Token groups are padded to the alignment each recipe needs (8 rows for bf16, 16 for
fp8, 32 for MX), as TorchTitan's converters set it.
"""

import functools
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torchtitan.models.moe import moe as moe_module
from torchtitan.models.moe.kernels import generate_permute_indices
from torchtitan.models.moe.moe import _run_experts_for_loop
from torchtitan.models.moe.utils import _unpermute

from titan_megamoe.inputs import check_inputs
from titan_megamoe.precision import FP8_BLOCK, MXFP8, NATIVE, Precision

_RECIPES: dict[tuple, str] = {
    (NATIVE, NATIVE, NATIVE): "bf16",
    (FP8_BLOCK, FP8_BLOCK, FP8_BLOCK): "fp8",
    (NATIVE, FP8_BLOCK, FP8_BLOCK): "fp8_bwd",
    (MXFP8, MXFP8, MXFP8): "mxfp8",
    (MXFP8, MXFP8, NATIVE): "mxfp8_wgrad_bf16",
}
"""(forward, dgrad, wgrad) formats -> the grouped GEMMs that run them here."""

_ALIGNMENT = {"bf16": 8, "fp8": 16, "fp8_bwd": 16, "mxfp8": 32, "mxfp8_wgrad_bf16": 32}
"""Rows each expert's token group is padded to a multiple of: TorchTitan's default (16
bytes of bf16) and the sizes its float8 / MX grouped-MM converters set
(``FP8_GROUP_ALIGNMENT_SIZE``, ``MXFP8_GROUP_ALIGNMENT_SIZE``)."""

_FOR_LOOP_DEVICES = ("cpu",)
"""Device types whose experts run TorchTitan's for-loop; others run its grouped GEMMs."""

_TORCHAO_FP8_DIM_MULTIPLE = 32
"""torchao 0.16's per-group column-scale kernel (fp8 weight gradients) writes its scales in
blocks of 32 columns unmasked past the last column: a hidden or intermediate size that is
not a multiple of 32 makes it write past its buffer (stock TorchTitan included)."""


AUTO_NOTES = {
    "fp8_bwd": ("stock TorchTitan has no fp8_bwd recipe: this path runs its bf16 forward and torchao's fp8 "
                "rowwise backward uncompiled, measured slower than stock bf16 (7.25 / 35.06 against 7.21 / 18.31 "
                "ms fwd / fwd+bwd, 30B-A3B at 16,384 tokens on one H200); where the fused backend cannot run, "
                "precision bf16 trains faster"),
}
"""Recipe -> what ``auto`` says when it runs it here: the stock paths measured slower than
stock bf16 that no stock TorchTitan job would run."""


def _recipe(precision: Precision) -> str | None:
    return _RECIPES.get(precision.formats)


def auto_note(precision: Precision) -> str | None:
    """What the log adds where ``auto`` runs ``precision`` on this backend (``AUTO_NOTES``)."""
    return AUTO_NOTES.get(_recipe(precision))


# ---------------------------------------------------------------------------------------
# torchao's grouped GEMMs in place of torch._grouped_mm.
# ---------------------------------------------------------------------------------------


class _Bf16ForwardFp8Backward(torch.autograd.Function):
    """``torch._grouped_mm(a, b_t, offs=offs)`` in bf16, differentiated by torchao's fp8
    rowwise grouped GEMMs (``fp8_bwd``)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        # What torchao's _Float8GroupedMM.backward reads from its context.
        ctx.save_for_backward(a, b_t, offs)
        ctx.out_dtype = torch.bfloat16
        return torch._grouped_mm(a, b_t, offs=offs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        from torchao.prototype.moe_training.scaled_grouped_mm import _Float8GroupedMM

        grad_a, grad_b_t = _Float8GroupedMM.backward(ctx, grad_out)[:2]
        return grad_a, grad_b_t, None


def _bf16_forward_fp8_backward(a, b_t, *, offs):
    return _Bf16ForwardFp8Backward.apply(a, b_t, offs)


def _torchao_grouped_mm(recipe: str) -> Callable[..., torch.Tensor] | None:
    """What ``torch._grouped_mm`` becomes under ``recipe``; None: itself (bf16)."""
    if recipe == "bf16":
        return None
    if recipe == "fp8_bwd":
        return _bf16_forward_fp8_backward
    from torchao.prototype.moe_training.conversion_utils import MoEScalingType
    from torchao.prototype.moe_training.scaled_grouped_mm import _quantize_then_scaled_grouped_mm

    scaling = {
        "fp8": MoEScalingType.FP8_ROWWISE,
        "mxfp8": MoEScalingType.MXFP8,
        "mxfp8_wgrad_bf16": MoEScalingType.MXFP8_WGRAD_WITH_HP,
    }[recipe]
    return functools.partial(_quantize_then_scaled_grouped_mm, scaling_type=scaling)


def _experts_with(grouped_mm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """TorchTitan 0.2.2's ``_run_experts_grouped_mm`` with its three ``torch._grouped_mm``
    calls made by ``grouped_mm``: what torchao's ``ScaledGroupedMMTensor`` weights make of
    them in a stock job. Restated rather than wrapped in a torch function mode, because
    the compiler ignores such a mode and would run the GEMMs in bf16, silently."""

    def run(w1, w2, w3, x, num_tokens_per_expert):
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(grouped_mm(x.bfloat16(), w1.bfloat16().transpose(-2, -1), offs=offsets))
        h = h * grouped_mm(x.bfloat16(), w3.bfloat16().transpose(-2, -1), offs=offsets)
        return grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)

    return run


@functools.cache
def _quantized_experts(recipe: str) -> Callable[..., torch.Tensor]:
    """The expert function of a quantized ``recipe``, compiled fullgraph as TorchTitan's
    ``apply_compile`` compiles its own (``fp8_bwd`` excepted). Compiled whether or not the job compiles: eager,
    torchao's quantization steps run unfused and the layer is ~1.4x slower (30B-A3B,
    16k tokens), and ``auto`` must be no slower than stock in either kind of job."""
    experts = _experts_with(_torchao_grouped_mm(recipe))
    if recipe == "fp8_bwd":  # not a stock recipe; its backward calls torchao's, which does not compile
        return experts
    return torch.compile(experts, fullgraph=True)


def _run_experts(w1, w2, w3, rows: torch.Tensor, rows_per_expert: torch.Tensor, recipe: str) -> torch.Tensor:
    """TorchTitan's expert function on expert-major, padded ``rows``."""
    if rows.device.type in _FOR_LOOP_DEVICES:
        if recipe != "bf16":  # the for-loop would run it unquantized, silently
            raise NotImplementedError(
                f"stock experts run {recipe!r} through torchao's CUDA grouped GEMMs; on "
                f"{rows.device.type} only bf16 (unquantized) runs"
            )
        return _run_experts_for_loop(w1, w2, w3, rows, rows_per_expert)
    if recipe == "bf16":
        # Looked up per call: a job that compiles has TorchTitan's compiled one there.
        return moe_module._run_experts_grouped_mm(w1, w2, w3, rows, rows_per_expert)
    hidden, inter = rows.shape[1], w1.shape[1]
    if hidden % _TORCHAO_FP8_DIM_MULTIPLE or inter % _TORCHAO_FP8_DIM_MULTIPLE:
        raise ValueError(
            f"precision {recipe!r} through torchao needs hidden and intermediate sizes that are "
            f"multiples of {_TORCHAO_FP8_DIM_MULTIPLE} (its fp8 scale kernels write past their buffers "
            f"otherwise); got hidden {hidden}, intermediate {inter}"
        )
    torch._dynamo.mark_dynamic(rows, 0)  # the routed row count varies from call to call
    return _quantized_experts(recipe)(w1, w2, w3, rows, rows_per_expert)


# ---------------------------------------------------------------------------------------
# Dispatch and combine, as ExpertParallel does them.
# ---------------------------------------------------------------------------------------


def _exchange_counts(
    counts: torch.Tensor, num_local: int, group: dist.ProcessGroup, ep: int
) -> tuple[torch.Tensor, list[int], list[int]]:
    """``ExpertParallel._token_dispatch``'s count exchange, from ``counts [E + 1]`` (rows
    per global expert, then this rank's invalid expert ids). Returns the rows each local
    expert gets from each rank (by source rank, then expert) and the all-to-all splits on
    the host: one device-to-host sync, as stock.

    Every rank's invalid-id count rides along in the same exchange, so that all ranks
    raise together instead of leaving their peers waiting in the next all-to-all.
    """
    with torch.no_grad():
        per_rank = counts[:-1].view(ep, num_local)
        send = torch.cat([per_rank, counts[-1:].expand(ep, 1)], dim=1)
        received = all_to_all_single(send.reshape(-1), None, None, group=group)
        received = torch.ops._c10d_functional.wait_tensor(received).view(ep, num_local + 1)
        send_splits = per_rank.sum(1).to("cpu", non_blocking=True)
        # The blocking copy waits for the stream, so ``send_splits`` has landed after it.
        host = torch.cat([received[:, :-1].sum(1), received[:, -1]]).to("cpu").tolist()
        send_splits = send_splits.tolist()
    recv_splits, invalid = host[:ep], host[ep:]
    if any(invalid):
        raise ValueError(
            f"topk_idx holds expert ids outside [0, {ep * num_local}) ({ep} EP ranks x "
            f"{num_local} local experts): {invalid[dist.get_rank(group)]} on this rank, "
            f"{invalid} on ranks 0..{ep - 1}"
        )
    return received[:, :-1].reshape(-1), send_splits, recv_splits


def _pad_expert_major(
    rows: torch.Tensor, received_per_expert: torch.Tensor, num_local: int, ep: int, alignment: int
) -> tuple[torch.Tensor, torch.Size, torch.Tensor, torch.Tensor]:
    """TorchTitan's ``_permute`` with the alignment given: received rows (by source rank,
    then expert) regrouped by local expert, each group padded with zero rows to a multiple
    of ``alignment`` (at least one multiple). Returns the padded rows, the shape and the
    indices ``_unpermute`` takes back, and the padded rows per expert."""
    max_rows = -(-(rows.shape[0] + num_local * alignment) // alignment) * alignment
    with torch.no_grad():
        indices, rows_per_expert, _ = generate_permute_indices(
            received_per_expert, num_local, ep, max_rows, alignment,
            use_cpu=rows.device.type == "cpu",  # its other path is a Triton GPU kernel
        )
    # Index -1 (padding) reads this appended zero row; _unpermute writes it and drops it.
    rows = torch.vstack((rows, rows.new_zeros(rows.shape[-1])))
    return rows[indices], rows.shape, indices, rows_per_expert


def routed_experts(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    group: dist.ProcessGroup | None,
    score_before_experts: bool,
    precision: Precision,
) -> torch.Tensor:
    """``y [T, H]`` (dtype of ``x``): ``sum_j topk_w[t, j] * W2_e (silu(W1_e x_t) * W3_e x_t)``
    over ``e = topk_idx[t, j]`` (global expert ids), or with ``score_before_experts`` the
    score applied to the expert input instead; computed as stock TorchTitan does.

    ``topk_w`` is fp32; ``w1, w3 [E_local, I, H]`` and ``w2 [E_local, H, I]`` are plain
    local tensors; expert ``e`` lives on rank ``e // E_local`` of ``group`` (None: one
    rank, no communication). Differentiable with respect to ``x``, ``topk_w``, ``w1``,
    ``w2`` and ``w3``. With a group, expert ids outside ``[0, E)`` raise ``ValueError``
    where the splits reach the host; on one rank nothing reaches the host and they are
    not checked (stock does not check them either). See :func:`unsupported_reason` for where it runs.
    """
    check_inputs(x, topk_idx, topk_w, w1, w2, w3)
    recipe = _recipe(precision)
    if recipe is None:
        raise ValueError(f"precision {precision.name!r} has no stock grouped-GEMM recipe")
    num_tokens, top_k = topk_idx.shape
    num_local = w1.shape[0]
    ep = 1 if group is None else dist.get_world_size(group)
    num_experts = ep * num_local

    # TokenReorderer: counts per expert and the stable sort by expert. The counts are
    # taken with scatter_add rather than histc (CUDA-only for integers); ids outside
    # [0, E) land in an extra last bin.
    flat_idx = topk_idx.reshape(-1).long()
    bins = torch.where((flat_idx >= 0) & (flat_idx < num_experts), flat_idx, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, bins, torch.ones_like(bins))
    sorted_slots = torch.argsort(flat_idx, stable=True)

    # MoE.forward: the expert input rows, scored in fp32 if asked.
    rows = x[sorted_slots // top_k]
    if score_before_experts:
        sorted_scores = topk_w.reshape(-1)[sorted_slots]
        rows = (rows.to(torch.float32) * sorted_scores.reshape(-1, 1)).to(x.dtype)

    # ExpertParallel._token_dispatch.
    received_per_expert = counts[:num_experts]
    if group is not None:
        received_per_expert, send_splits, recv_splits = _exchange_counts(counts, num_local, group, ep)
        rows = all_to_all_single_autograd(rows, recv_splits, send_splits, group)
    padded, padded_shape, indices, rows_per_expert = _pad_expert_major(
        rows, received_per_expert, num_local, ep, _ALIGNMENT[recipe]
    )

    out = _run_experts(w1, w2, w3, padded, rows_per_expert, recipe)

    # ExpertParallel._token_combine.
    out = _unpermute(out, padded_shape, indices)
    if group is not None:
        out = all_to_all_single_autograd(out, send_splits, recv_splits, group)

    # MoE.forward: unsort, then sum the k rows of each token (weighted in fp32 by the
    # scores unless they were applied to the input).
    unsorted = torch.zeros((num_tokens * top_k, x.shape[1]), dtype=out.dtype, device=out.device)
    unsorted[sorted_slots] = out
    unsorted = unsorted.view(num_tokens, top_k, x.shape[1])
    if score_before_experts:
        return unsorted.sum(dim=1)
    return torch.bmm(topk_w.reshape(num_tokens, 1, top_k), unsorted.float()).to(x.dtype).squeeze(1)


def unsupported_reason(
    device: torch.device, dtype: torch.dtype, precision: Precision, ep_within_node: bool
) -> str | None:
    """None where :func:`routed_experts` runs ``precision`` for experts computing in
    ``dtype`` on ``device``, else a sentence saying why not.

    It runs wherever stock TorchTitan runs the same job: any floating-point dtype, bf16
    on the CPU and on any CUDA GPU, ``fp8`` / ``fp8_bwd`` on CUDA SM90 and SM100 (the
    GPUs torch's ``_scaled_grouped_mm`` serves) with torchao's MoE training importable,
    MX precisions on SM100 with torchao's SM100 kernels. Where stock cannot run a
    precision it is refused, never run in another one. ``ep_within_node`` does not
    matter here: the all-to-all goes through the process group's own backend.
    """
    recipe = _recipe(precision)
    if recipe is None:
        return f"precision {precision.name!r} has no stock grouped-GEMM recipe"
    if not dtype.is_floating_point:
        return f"expert inputs must be floating point; got {dtype}"
    if device.type in _FOR_LOOP_DEVICES:
        if recipe != "bf16":
            return (
                f"precision {precision.name!r} needs torchao's scaled grouped GEMMs, which are "
                f"CUDA kernels; on {device.type} stock TorchTitan runs its experts unquantized only"
            )
        return None
    if device.type != "cuda":
        return f"runs on CPU and CUDA devices only; got {device.type}"
    if recipe == "bf16":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if recipe.startswith("mxfp8"):
        if major != 10:
            return (
                f"precision {precision.name!r}: stock TorchTitan's MX grouped-MM converter needs "
                f"SM100 and this GPU is SM{major}{minor}; running it in bf16 instead would change "
                "its numerics"
            )
    elif major not in (9, 10):
        return (
            f"precision {precision.name!r} needs torch._scaled_grouped_mm (torchao's fp8 rowwise "
            f"grouped GEMM), which runs on SM90 and SM100 only; this GPU is SM{major}{minor}"
        )
    try:
        from torchao.prototype.moe_training import scaled_grouped_mm
    except Exception as e:  # torchao absent, or its kernels failing to import with this Triton
        return (
            f"precision {precision.name!r} needs torchao's MoE training (torchao <= 0.16), "
            f"which failed to import: {e!r}"
        )
    if recipe.startswith("mxfp8") and not scaled_grouped_mm._SM100_KERNELS_AVAILABLE:
        return (
            f"precision {precision.name!r} needs torchao's SM100 MXFP8 kernels, which this "
            "torchao build lacks"
        )
    return None

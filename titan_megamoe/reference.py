"""Pure-PyTorch implementation of the MoE operator: the numerical specification.

Written to be obviously right, not fast. Every other backend is tested against it.

Semantics, per EP rank (``ep`` ranks, ``E = ep * E_local`` experts, expert ``e`` on rank
``e // E_local``)::

    y[t] = sum_j  topk_w[t, j] * W2_e (silu(W1_e x_t) * (W3_e x_t)),   e = topk_idx[t, j]

or, with ``score_before_experts``, the score scales the expert input instead::

    y[t] = sum_j  W2_e (silu(W1_e (w x_t)) * (W3_e (w x_t))),            w = topk_w[t, j]

Numerics (what the fused kernels must reproduce):
- every GEMM accumulates in fp32; its operands are first quantized and dequantized in
  the precision's format for that GEMM family (``titan_megamoe.precision``): along K in
  the format's activation blocks (1 x 128 for fp8, 1 x 32 for mxfp8) and weight blocks;
- a row that crosses the link travels in the format of the GEMM that reads it on
  arrival, quantized once at its source (``to_link``): the expert input rows in the
  forward format (GEMM1), the rows of ``dy`` in the dgrad format (``dy W2``); that GEMM
  reads them as they arrived, without quantizing again. In the backward the same rows
  also feed the weight-gradient GEMMs: they travel quantized when those are quantized
  too, and in the activation dtype when the weight gradients are native (each GEMM
  then quantizes them as it reads them, to the same values), unless the precision's
  native weight gradients read what crossed (``wgrad_from_link``: ``fp8_wgrad_bf16``):
  then the rows travel quantized and the weight gradients read them dequantized and
  rounded to the activation dtype;
- the weight-gradient GEMMs contract over an expert's rows (in receive order: by source
  rank, then the source's sort order), so their operands are quantized along the rows,
  in 128 x 1 (fp8) or 32 x 1 (mxfp8) blocks counted from the expert's first row. The
  expert inputs and ``dy`` are requantized from the values that arrived (measured
  against fp32 on random data, 30B-A3B and 235B-A22B shapes: dw1 7.1% instead of 6.6%
  when requantized from bf16 kept for it, dw2 6.8% instead of 6.3%; the bf16 rows would
  double what the backward sends); ``h``, ``da`` and ``db`` are computed where they are
  used and quantized from the activation dtype;
- in the backward, ``dy`` reaches the experts as its token's row, unscaled; where the
  score weights the output, the expert multiplies ``dy W2`` and (for dW2) ``h`` by it in
  the accumulation dtype, and the score's gradient ``<out, dy>`` is ``<h, dy W2>`` with
  the dgrad GEMM's product and ``h`` unrounded (the forward's output rows are not kept);
- the tensors a kernel stores between GEMMs (the scaled input, the SwiGLU output ``h``,
  the expert output rows, ``da``/``db`` in the backward) are rounded to the activation
  dtype; the output rows and ``dx`` go back over the link in that dtype;
- the k expert rows of a token are reduced in fp32 in slot order j = 0..k-1.

Communication goes through ``torch.distributed.all_to_all_single`` (gloo or NCCL); rows
travel expert-major, so each rank receives, per source rank, its local experts' rows in
expert order.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_megamoe.precision import AMAX_FLOOR, E4M3_MAX, UE8M0_EXP_MAX, UE8M0_EXP_MIN, Format, Precision

def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error ``|actual - expected| / |expected|``, the measure every
    tolerance of the project is stated in (NaN in ``actual`` gives NaN)."""
    diff = (actual.double() - expected.double()).norm()
    return (diff / expected.double().norm().clamp_min(1e-30)).item()


def max_row_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest relative error of one row, ``max_r |a_r - e_r| / |e_r|`` over the last
    dimension: a global norm hides a single wrong row, this does not. A row whose expected
    norm is 0 counts its absolute error (NaN in ``actual`` gives NaN)."""
    a, e = actual.double().flatten(0, -2), expected.double().flatten(0, -2)
    diff, norm = (a - e).norm(dim=-1), e.norm(dim=-1)
    return torch.where(norm > 0, diff / norm.clamp_min(1e-300), diff).max().item() if a.numel() else 0.0


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the accumulation dtype: fp32, or the tensor's own if wider (gradcheck)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# ---------------------------------------------------------------------------------------
# Formats: quantize then dequantize, so that an fp32 GEMM sees exactly the stored values.
# ---------------------------------------------------------------------------------------


def quantize_blocks(t: torch.Tensor, block: tuple[int, int], power_of_two: bool):
    """``t [..., rows, cols]`` as e4m3 values and one fp32 scale per ``block`` of its last
    two dimensions (edge blocks may be partial): ``t ~= q * scale``. The scale is
    ``amax / 448`` (``amax`` floored at ``AMAX_FLOOR``), or with ``power_of_two`` the power
    of two rounded up from it (UE8M0, RCEIL); an all-zero block gets scale 1. Values are
    multiplied by the block's *multiplier*, ``448 / amax`` (the exact reciprocal of a
    power-of-two scale), and rounded to e4m3: one multiplication per element, as
    DeepSeek-V3's and torchao's quantizers do, rather than a division.

    Returns ``(q [..., rows, cols] float8_e4m3fn, scales [..., ceil(rows / br), ceil(cols / bc)]
    fp32)``: what the kernels' row-quantize helper stores (and, for ``[experts, N, K]``
    weights, the block scales the GEMMs read).
    """
    *lead, rows, cols = t.shape
    br, bc = block
    pad_r, pad_c = (-rows) % br, (-cols) % bc
    padded = F.pad(t.float(), (0, pad_c, 0, pad_r))
    blocks = padded.view(*lead, (rows + pad_r) // br, br, (cols + pad_c) // bc, bc)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    if power_of_two:
        # ceil(log2(amax / 448)), exactly: amax = m * 2^E with m in [0.5, 1) and
        # 448 = 0.875 * 2^9, so it is E - 9, plus one when m > 0.875.
        mantissa, exponent = torch.frexp(amax)
        exponent = (exponent - 9 + (mantissa > 0.875).int()).clamp(UE8M0_EXP_MIN, UE8M0_EXP_MAX)
        scale = torch.where(amax > 0, torch.exp2(exponent), torch.ones_like(amax))
        multiplier = torch.where(amax > 0, torch.exp2(-exponent), torch.ones_like(amax))
    else:
        # Tensor operands: on CUDA, torch divides by a Python number as a multiplication by
        # its rounded reciprocal, and `number / tensor` is a reciprocal times the number.
        e4m3_max = amax.new_full((), E4M3_MAX)
        floored = amax.clamp_min(AMAX_FLOOR)
        scale = torch.where(amax > 0, floored / e4m3_max, torch.ones_like(amax))
        multiplier = torch.where(amax > 0, e4m3_max / floored, torch.ones_like(amax))
    q = round_to_e4m3(blocks * multiplier).to(torch.float8_e4m3fn)
    q = q.view(*lead, rows + pad_r, cols + pad_c)[..., :rows, :cols]
    return q, scale.view(*lead, scale.shape[-4], scale.shape[-2])


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 ``v`` (``|v| <= 448``, or one rounding above) rounded to the nearest e4m3 value,
    ties to even, still in fp32: the cast to e4m3 after it is then exact on every device
    (the same values must come out of the spec on CPUs and GPUs, whose casts were seen to
    disagree)."""
    _, exponent = torch.frexp(v)  # v = m * 2^exponent, 0.5 <= |m| < 1
    # Three mantissa bits: spacing 2^(exponent - 4); subnormals (below 2^-6) keep 2^-9.
    step = torch.exp2((exponent - 4).clamp_min(-9).to(torch.float32))
    return torch.round(v / step) * step


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`, in fp32."""
    rows, cols = q.shape[-2:]
    expanded = scales.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return q.float() * expanded[..., :rows, :cols]


def quantize_operand(t: torch.Tensor, fmt: Format, is_weight: bool) -> torch.Tensor:
    """A GEMM operand ``[rows, K]`` as the kernel sees it, in the accumulation dtype:
    quantized in ``fmt`` (weights in its weight blocks, other operands in its activation
    blocks) and dequantized again."""
    if not fmt.quantized:
        return _acc(t)
    block = fmt.block(is_weight)
    q, scales = quantize_blocks(t, block, fmt.power_of_two)
    return dequantize_blocks(q, scales, block)


def gemm(a: torch.Tensor, b: torch.Tensor, fmt: Format, b_is_weight: bool, a_arrived: bool = False) -> torch.Tensor:
    """``a @ b.T`` in fp32 with both operands ``[*, K]`` quantized along K in ``fmt``;
    ``a_arrived``: ``a`` holds rows as they crossed the link, already in ``fmt``."""
    return (_acc(a) if a_arrived else quantize_operand(a, fmt, is_weight=False)) @ quantize_operand(b, fmt, b_is_weight).T


def to_link(rows: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Rows ``[*, K]`` as they cross the link for a GEMM in ``fmt``: quantized once, at
    the source, along K (then held dequantized, in the accumulation dtype); unchanged
    when ``fmt`` is native."""
    return quantize_operand(rows, fmt, is_weight=False) if fmt.quantized else rows


# ---------------------------------------------------------------------------------------
# Layout: where each (token, slot) row goes, and what each rank receives.
# ---------------------------------------------------------------------------------------


@dataclass
class DispatchLayout:
    """Routing of one rank's rows, agreed with every peer through a count exchange."""

    send_order: torch.Tensor
    """Flat slot ids ``t * k + j`` sorted by global expert (stable): the order rows leave in."""
    send_splits: list[int]
    """Rows sent to each rank."""
    recv_splits: list[int]
    """Rows received from each rank."""
    recv_expert: torch.Tensor
    """Local expert of each received row (rows arrive by source rank, then expert)."""
    tokens_per_local_expert: torch.Tensor
    """Rows received per local expert, summed over source ranks (int64)."""


def _ep_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def dispatch_layout(
    topk_idx: torch.Tensor, num_local_experts: int, group: dist.ProcessGroup | None
) -> DispatchLayout:
    ep = _ep_size(group)
    num_experts = ep * num_local_experts
    flat_idx = topk_idx.reshape(-1).long()
    outside = (flat_idx < 0) | (flat_idx >= num_experts)
    bad = flat_idx[outside][:1]
    send_order = torch.argsort(flat_idx, stable=True)
    sent_per_expert = torch.bincount(flat_idx[~outside], minlength=num_experts)
    # Each rank tells every peer, beside its counts, whether it holds an id outside the
    # group's experts (and the first one), so that every rank raises in the same call
    # instead of its peers waiting for rows it will never send.
    held = torch.stack([torch.tensor(bad.numel(), device=flat_idx.device), bad.sum()])
    sent = torch.cat([sent_per_expert.view(ep, num_local_experts), held.expand(ep, 2)], dim=1)
    if group is None:
        received = sent
    else:
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)
    holders = received[:, num_local_experts].nonzero().flatten().tolist()
    if holders:
        source = holders[0]
        raise ValueError(
            f"topk_idx holds expert id {received[source, num_local_experts + 1].item()}, outside [0, {num_experts}) "
            f"({ep} EP ranks x {num_local_experts} local experts)"
            + (f", on EP rank {source} (every rank of the group raises this)" if ep > 1 else "")
        )
    recv_by_rank = received[:, :num_local_experts]
    recv_per_expert = recv_by_rank.reshape(-1)
    local_ids = torch.arange(num_local_experts, device=topk_idx.device).repeat(ep)
    return DispatchLayout(
        send_order=send_order,
        send_splits=sent_per_expert.view(ep, num_local_experts).sum(1).tolist(),
        recv_splits=recv_by_rank.sum(1).tolist(),
        recv_expert=torch.repeat_interleave(local_ids, recv_per_expert),
        tokens_per_local_expert=recv_by_rank.sum(0),
    )


def _exchange(
    rows: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    if group is None:
        return rows
    out = rows.new_empty((sum(recv_splits),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    return out


def _dispatch(rows: torch.Tensor, layout: DispatchLayout, group) -> torch.Tensor:
    """Rows in send order -> rows on their experts' ranks."""
    return _exchange(rows, layout.send_splits, layout.recv_splits, group)


def _combine(rows: torch.Tensor, layout: DispatchLayout, group) -> torch.Tensor:
    """Rows on the experts' ranks -> rows back on their source rank, in send order."""
    return _exchange(rows, layout.recv_splits, layout.send_splits, group)


def _unsort(rows: torch.Tensor, layout: DispatchLayout, num_tokens: int, top_k: int) -> torch.Tensor:
    """Rows in send order -> ``[T, k, ...]`` by (token, slot)."""
    out = rows.new_empty((num_tokens * top_k,) + tuple(rows.shape[1:]))
    out[layout.send_order] = rows
    return out.view((num_tokens, top_k) + tuple(rows.shape[1:]))


def _expert_input(x: torch.Tensor, topk_w: torch.Tensor, layout: DispatchLayout,
                  top_k: int, score_before_experts: bool) -> torch.Tensor:
    rows = x[layout.send_order // top_k]
    if score_before_experts:
        scores = topk_w.reshape(-1)[layout.send_order].unsqueeze(1)
        rows = (_acc(rows) * scores).to(x.dtype)
    return rows


# ---------------------------------------------------------------------------------------
# The operator.
# ---------------------------------------------------------------------------------------


def _gate_up(xe, w1e, w3e, fmt: Format, dtype: torch.dtype, arrived_in_format: bool):
    """GEMM1 of one expert on its rows: the pre-activations ``a``, ``b`` (accumulation
    dtype) and the SwiGLU output ``h`` (rounded to ``dtype``). ``arrived_in_format``: the
    rows crossed the link already in ``fmt``."""
    a = gemm(xe, w1e, fmt, True, a_arrived=arrived_in_format)
    b = gemm(xe, w3e, fmt, True, a_arrived=arrived_in_format)
    return a, b, (F.silu(a) * b).to(dtype)


def moe_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    group: dist.ProcessGroup | None,
    score_before_experts: bool,
    precision: Precision,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``y [T, H]`` (dtype of x) and the rows received per local expert (int64)."""
    fmt = precision.forward
    num_tokens, top_k = topk_idx.shape
    layout = dispatch_layout(topk_idx, w1.shape[0], group)

    recv_x = _dispatch(to_link(_expert_input(x, topk_w, layout, top_k, score_before_experts), fmt), layout, group)
    recv_out = torch.empty(recv_x.shape, dtype=x.dtype, device=x.device)
    for e in range(w1.shape[0]):
        rows = (layout.recv_expert == e).nonzero().squeeze(1)
        h = _gate_up(recv_x[rows], w1[e], w3[e], fmt, x.dtype, True)[2]
        recv_out[rows] = gemm(h, w2[e], fmt, True).to(x.dtype)

    out = _acc(_unsort(_combine(recv_out, layout, group), layout, num_tokens, top_k))
    if score_before_experts:
        y = out.sum(dim=1)
    else:
        y = (_acc(topk_w).unsqueeze(2) * out).sum(dim=1)
    return y.to(x.dtype), layout.tokens_per_local_expert


def moe_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    group: dist.ProcessGroup | None,
    score_before_experts: bool,
    precision: Precision,
    saved_gemm1: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dx, d_topk_w, dw1, dw2, dw3)`` of ``moe_forward`` given ``dy``.

    The dispatch and the first GEMM are recomputed from the inputs (forward format).
    ``saved_gemm1``: the forward kept GEMM1's pre-activations in x's dtype (the operator's
    ``save_gemm1``), so the SwiGLU backward reads them rounded to it. Quantized, the
    rounding matters: it moves ``[da | db]`` across e4m3 rounding boundaries.
    """
    prec = precision
    num_tokens, top_k = topk_idx.shape
    layout = dispatch_layout(topk_idx, w1.shape[0], group)
    slot_scores = _acc(topk_w.reshape(-1)[layout.send_order].unsqueeze(1))
    token_of_row = layout.send_order // top_k

    # The formats the rows cross the link in (see the module docstring).
    x_link, dy_link = prec.backward_link
    expert_input = _expert_input(x, topk_w, layout, top_k, score_before_experts)
    recv_x = _dispatch(to_link(expert_input, x_link), layout, group)
    # What reaches each expert output row: its token's dy row, unscaled (so that a token's
    # row is quantized once); where the score weights the output, the expert applies it
    # to ``dy W2`` and, for dW2, to h, in the accumulation dtype.
    recv_grad = _dispatch(to_link(dy[token_of_row], dy_link), layout, group)
    recv_score = None if score_before_experts else _dispatch(slot_scores, layout, group)

    recv_dx = torch.empty(recv_x.shape, dtype=x.dtype, device=x.device)
    # Where the score weights the output, its gradient <out, dy> is taken as <h, dy W2>
    # with the backward's own dgrad product (the forward's output rows are gone by then).
    recv_score_grad = torch.empty(recv_x.shape[0], 1, dtype=torch.float32, device=x.device)
    dw1, dw2, dw3 = (_acc(torch.zeros_like(w)) for w in (w1, w2, w3))
    for e in range(w1.shape[0]):
        rows = (layout.recv_expert == e).nonzero().squeeze(1)
        xe, ge = recv_x[rows], recv_grad[rows]
        a, b, h = _gate_up(xe, w1[e], w3[e], prec.forward, x.dtype, x_link.quantized)
        if saved_gemm1:
            a, b = _acc(a.to(x.dtype)), _acc(b.to(x.dtype))
            h = (F.silu(a) * b).to(x.dtype)
        sig = torch.sigmoid(a)

        dh = gemm(ge, w2[e].T, prec.dgrad, True, a_arrived=dy_link.quantized)
        h_wgrad = h
        if not score_before_experts:
            recv_score_grad[rows] = (F.silu(a) * b * dh).sum(dim=1, keepdim=True).float()
            dh = dh * recv_score[rows]
            h_wgrad = (F.silu(a) * b * recv_score[rows]).to(x.dtype)
        da = (dh * b * sig * (1 + a * (1 - sig))).to(x.dtype)
        db = (dh * a * sig).to(x.dtype)
        if not prec.wgrad.quantized:
            # Native weight gradients read the rows in x's dtype (dequantized into it where
            # they crossed quantized).
            xe, ge = xe.to(x.dtype), ge.to(x.dtype)
        dw2[e] = gemm(ge.T, h_wgrad.T, prec.wgrad, False)
        dw1[e] = gemm(da.T, xe.T, prec.wgrad, False)
        dw3[e] = gemm(db.T, xe.T, prec.wgrad, False)
        recv_dx[rows] = (gemm(da, w1[e].T, prec.dgrad, True) + gemm(db, w3[e].T, prec.dgrad, True)).to(x.dtype)

    d_in = _acc(_unsort(_combine(recv_dx, layout, group), layout, num_tokens, top_k))
    if score_before_experts:
        # The expert input was w * x: its gradient splits into x's and w's.
        dx = (_acc(topk_w).unsqueeze(2) * d_in).sum(dim=1)
        d_topk_w = (d_in * _acc(x).unsqueeze(1)).sum(dim=2)
    else:
        dx = d_in.sum(dim=1)
        d_topk_w = _unsort(_combine(recv_score_grad, layout, group), layout, num_tokens, top_k).squeeze(2)
    return (
        dx.to(x.dtype),
        d_topk_w.to(topk_w.dtype),
        dw1.to(w1.dtype),
        dw2.to(w2.dtype),
        dw3.to(w3.dtype),
    )

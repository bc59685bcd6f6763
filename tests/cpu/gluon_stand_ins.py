"""What the Gluon kernels compute, in torch, for the interpreter tests of the host code
around them: Gluon does not run under the Triton interpreter, so these stand in for the
launchers, computing each kernel's contract from the same arguments (and checking what
the kernel would wait for has arrived). The kernels themselves are checked against fp32
on a GPU (``tests/gpu/test_gluon_gemm_gpu.py``)."""

import torch

from titan_megamoe.kernels.quantize import quantize_rows
from titan_megamoe.kernels.sync import EPOCH
from titan_megamoe.reference import dequantize_blocks


def _fp32(t: torch.Tensor, scales: torch.Tensor | None, block: tuple[int, int]) -> torch.Tensor:
    """An operand in fp32: as it is, or e4m3 times its scales."""
    return t.float() if scales is None else dequantize_blocks(t, scales, block)


def swiglu_grad_gemm(dy, w2t, layout, chunks, outs, tiles, *, saved_m, score_before_experts, row_align,
                     dy_scale=None, w2t_scale=None, b_k_major=True, power_of_two=False, programs=None):
    """``kernels.gluon.sm90.swiglu_grad_gemm``: the rows of the tiles below the saved rows'
    end (``schedule.ExpertTiles.saved_end``), each expert's padding rows zeros, every
    chunk they come from at the call's epoch."""
    base, count = layout.local_base.long().cpu(), layout.local_rows.long().cpu()
    block_base = layout.block_base.long().cpu()
    saved_rows, bm = outs.preact.shape[0], layout.block_m
    span = torch.where(base + count <= saved_rows, (count + bm - 1) // bm * bm,
                       (saved_rows - base).clamp_min(0) // saved_m * saved_m)
    virtual_end = int(torch.where(span > 0, block_base + span, 0).max())
    dy_f = _fp32(dy, dy_scale, (1, 128))
    w = _fp32(w2t, w2t_scale, (128, 128))
    if not b_k_major:
        w = w.transpose(1, 2)
    inter = w.shape[1]
    experts = w.shape[0]
    for e in range(experts):
        owned = torch.arange(int(count[e] + row_align - 1) // row_align * row_align)
        owned = owned[block_base[e] + owned < virtual_end]
        if owned.numel() == 0:
            continue
        _check_arrived(chunks, layout, e, owned, experts)
        rows = base[e] + owned
        live = (owned < count[e])[:, None]
        d = dy_f[rows] @ w[e].T
        g, u = outs.preact[rows.clamp_max(saved_rows - 1)].float().split(inter, dim=1)
        sig = torch.sigmoid(g)
        silu = g * sig
        h = silu * u
        parts = (h * d).view(-1, inter // tiles.block_n, tiles.block_n).sum(-1)
        score = torch.ones(rows.shape) if score_before_experts else outs.score[rows].float()
        dh = d * score[:, None]
        da = torch.where(live, dh * u * sig * (1 + g * (1 - sig)), 0.0)
        db = torch.where(live, dh * silu, 0.0)
        dab = torch.cat([da, db], dim=1).to(outs.dab.dtype)
        outs.dab[rows] = dab
        outs.h_wgrad[rows] = torch.where(live, h * score[:, None], 0.0).to(outs.h_wgrad.dtype)
        outs.score_parts[rows] = torch.where(live, parts, outs.score_parts[rows])
        if outs.dab_q is not None:
            q, scales = quantize_rows(dab, 128, power_of_two)
            outs.dab_q[rows] = q
            outs.dab_scales[rows] = scales


def _check_arrived(chunks, layout, e: int, owned: torch.Tensor, experts: int) -> None:
    """Every chunk (the layout's blocks of rows, per source) that rows ``owned`` of local
    expert ``e`` come from holds the call's epoch."""
    epoch = int(chunks.state[EPOCH.value])
    for s in range(chunks.ep):
        seg = int(chunks.src_offset.view(chunks.ep, experts)[s, e])
        n = int(chunks.src_rows.view(chunks.ep, experts)[s, e])
        reached = owned[(owned >= seg) & (owned < seg + n)]
        for c in ((reached - seg) // layout.block_m).unique().tolist():
            at = chunks.chunk_ready + (s * experts + e) * chunks.max_chunks + c
            assert int(chunks.flags[at]) == epoch, f"chunk {c} of source {s}, expert {e} had not arrived"


def gate_up_gemm(x, w1, w3, layout, chunks, outs, tiles, *, act_dtype, x_scale=None, w1_scale=None, w3_scale=None,
                 power_of_two=False, programs=None):
    """``kernels.gluon.sm90.gate_up_gemm``: ``h`` of every received row (rounded to
    ``act_dtype``; quantized per 128 columns with scales), the saved rows' pre-activations,
    every chunk the rows come from at the call's epoch."""
    base, count = layout.local_base.long().cpu(), layout.local_rows.long().cpu()
    x_f = _fp32(x, x_scale, (1, 128))
    w1_f, w3_f = _fp32(w1, w1_scale, (128, 128)), _fp32(w3, w3_scale, (128, 128))
    experts, inter, _ = w1.shape
    saved_rows = 0 if outs.preact is None else outs.preact.shape[0]
    for e in range(experts):
        live = torch.arange(int(count[e]))
        if live.numel() == 0:
            continue
        _check_arrived(chunks, layout, e, live, experts)
        rows = base[e] + live
        g, u = x_f[rows] @ w1_f[e].T, x_f[rows] @ w3_f[e].T
        h = (g * torch.sigmoid(g) * u).to(act_dtype)
        if outs.h_scales is None:
            outs.h[rows] = h.to(outs.h.dtype)
        else:
            q, scales = quantize_rows(h.float(), 128, power_of_two)
            outs.h[rows] = q
            outs.h_scales[rows] = scales
        saved = rows < saved_rows
        if saved.any():
            outs.preact[rows[saved]] = torch.cat([g, u], dim=1)[saved].to(outs.preact.dtype)

"""The operator's input contract, checked by every path that runs a MoE layer's routed
experts (the operator's backends and the layers' stock path alike)."""

import torch


def check_inputs(x, topk_idx, topk_w, w1, w2, w3) -> None:
    """The operator's inputs agree in shape, dtype and device (shapes only: nothing here
    waits for the device); raises naming the bad one."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden]; got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(
            f"topk_idx must be [{num_tokens}, top_k]; got shape {tuple(topk_idx.shape)}"
        )
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be int32 or int64; got {topk_idx.dtype}")
    if topk_w.shape != topk_idx.shape or topk_w.dtype != torch.float32:
        raise ValueError(
            f"topk_w must be float32 of shape {tuple(topk_idx.shape)}; "
            f"got {topk_w.dtype} of shape {tuple(topk_w.shape)}"
        )
    if w1.dim() != 3 or w1.shape[2] != hidden:
        raise ValueError(f"w1 must be [local_experts, inter, {hidden}]; got {tuple(w1.shape)}")
    experts, inter, _ = w1.shape
    for name, w, shape in (("w3", w3, (experts, inter, hidden)), ("w2", w2, (experts, hidden, inter))):
        if w.shape != shape:
            raise ValueError(f"{name} must have shape {shape}; got {tuple(w.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor; got {x.dtype}")
    if len({w.dtype for w in (w1, w2, w3)}) != 1 or w1.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"w1, w2 and w3 must share one dtype, x's ({x.dtype}) or float32 (master weights that "
                         f"the kernels quantize); got {w1.dtype}, {w2.dtype} and {w3.dtype}")
    if len({t.device for t in (x, topk_idx, topk_w, w1, w2, w3)}) != 1:
        raise ValueError("x, topk_idx, topk_w, w1, w2 and w3 must be on one device")

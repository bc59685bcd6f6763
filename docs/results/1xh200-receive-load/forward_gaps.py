"""Forward-only calls of the fused op; GPU idle time between kernels, by receive_load."""
import json, os, sys, time
import torch
from titan_megamoe import fused
from titan_megamoe.settings import OperatorSettings

T, H, I, E, K = 16384, 2048, 768, 128, 8
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
w = torch.softmax(torch.randn(T, K, device="cuda", generator=g), 1)
w1, w3 = (torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16, generator=g) / 45 for _ in range(2))
w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) / 28
out = {}
for load in (0.0, 0.6, 0.0, 0.6):
    s = OperatorSettings(precision="bf16", backend="fused", capacity_tokens_per_rank=2 * T, receive_load=load)
    for _ in range(3):
        fused.moe_forward(x, idx, w, w1, w2, w3, None, False, s)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fused.moe_forward(x, idx, w, w1, w2, w3, None, False, s)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 20 * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fused.moe_forward(x, idx, w, w1, w2, w3, None, False, s)
        torch.cuda.synchronize()
    ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA], key=lambda e: e.time_range.start)
    gaps = {}
    for a, b in zip(ev, ev[1:]):
        gap = b.time_range.start - a.time_range.end
        key = f"{a.name[:30]} -> {b.name[:30]}"
        gaps.setdefault(key, []).append(gap)
    top = sorted(((sum(v) / len(v), k, len(v)) for k, v in gaps.items()), reverse=True)[:6]
    print(f"load {load}: {wall:.3f} ms per forward (wall)")
    for mean, k, n in top:
        print(f"   {mean:8.1f} us  x{n}  {k}")
    fused.release_buffers()

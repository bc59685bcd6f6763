"""Triton wgrad_kernel vs torch's blockwise scaled_mm per expert, one launch each, fp8 token-major operands."""
import torch, triton
import torch.nn.functional as F
from torch.nn.functional import ScalingType
from titan_megamoe.kernels.wgrad import wgrad_kernel
torch.manual_seed(0)
dev = "cuda"
def q_tok(t):  # [C, KT] fp32 -> e4m3, scales [C, KT/128]
    C, K = t.shape
    b = t.view(C, K // 128, 128); s = b.abs().amax(-1).clamp(min=1e-12) / 448.0
    return (b / s[..., None]).to(torch.float8_e4m3fn).view(C, K), s.contiguous()
def timed(fn, n=10):
    fn(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(n): fn()
    e1.record(); torch.cuda.synchronize(); return e0.elapsed_time(e1) / n
ROWS = 131072
print("shape, experts x tokens, triton ms (TFLOP/s), scaled_mm loop ms (TFLOP/s), rel diff")
for name, M, N in (("30B dW13", 1536, 2048), ("30B dW2", 2048, 768), ("235B dW13", 3072, 4096), ("235B dW2", 4096, 1536)):
    for E in (128, 64, 32, 16):
        Ke = ROWS // E; KT = ROWS
        a, sa = q_tok(torch.randn(M, KT, device=dev)); b, sb = q_tok(torch.randn(N, KT, device=dev))
        bs = (torch.arange(E + 1, device=dev, dtype=torch.int32) * (Ke // 128))
        out_t = torch.empty(E, M, N, device=dev, dtype=torch.bfloat16)
        tri = lambda: wgrad_kernel[(triton.cdiv(N, 128), triton.cdiv(M, 64), E)](
            a, sa, b, sb, out_t, out_t, bs, M=M, N=N, SPLIT_M=0, KT=KT, TOKEN_BLOCK=128, BLOCK_M=64, BLOCK_N=128,
            BLOCK_K=128, MX_DOT=0, UPCAST_DOT=False, num_warps=4, num_stages=3)
        out_c = torch.empty(E, M, N, device=dev, dtype=torch.bfloat16)
        def cut():
            sat, sbt = sa.t().contiguous(), sb.t().contiguous()
            for e in range(E):
                k0, k1 = e * Ke, (e + 1) * Ke
                out_c[e].copy_(F.scaled_mm(a[:, k0:k1], b[:, k0:k1].t(), sat[k0 // 128:k1 // 128].t(), ScalingType.BlockWise1x128,
                                           sbt[k0 // 128:k1 // 128].t(), ScalingType.BlockWise1x128, output_dtype=torch.bfloat16))
        flops = 2 * M * N * ROWS
        tt, tc = timed(tri), timed(cut)
        diff = ((out_t.float() - out_c.float()).norm() / out_c.float().norm()).item()
        print(f"{name}, {E} x {Ke}, {tt:.3f} ({flops/tt/1e9:.0f}), {tc:.3f} ({flops/tc/1e9:.0f}), {diff:.1e}", flush=True)

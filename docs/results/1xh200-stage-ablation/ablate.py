"""Stage ablations of the backward's first kernel and GEMM2/dgrad, with stage_switches.patch applied to 9c05d7c:
    torchrun --nproc_per_node=1 ablate.py 30B-A3B 16384 bf16,fp8 0,17,34,3,12,15 [comm_sms]
MEGAMOE_EXP bits: 1 no dy W2, 2 no SwiGLU epilogue, 4 no waits, 8 no dispatch (with 4), 16 no GEMM2/dgrad mainloop, 32 combine rows stored in receive order."""
import json, os, sys, time
from collections import defaultdict
from pathlib import Path
import torch, torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, "scripts")
from profile_layer import inputs
from titan_megamoe.ops import mega_moe
from titan_megamoe.settings import OperatorSettings

shape, tokens = sys.argv[1], int(sys.argv[2])
precisions = sys.argv[3].split(",")
exps = [int(e) for e in sys.argv[4].split(",")]
comm = int(sys.argv[5]) if len(sys.argv) > 5 else 0
torch.cuda.set_device(0)
dist.init_process_group("nccl")
x, *rest = inputs(shape, tokens, 0, 1)
x = x.requires_grad_(True)
dy = torch.randn_like(x)
out = Path("outputs") / f"ablate_{shape}_{tokens}_{comm}.jsonl"
out.parent.mkdir(exist_ok=True)
for prec in precisions:
    settings = OperatorSettings(precision=prec, backend="fused", capacity_tokens_per_rank=tokens, comm_sms=comm, save_gemm1=True)
    for exp in exps:
        os.environ["MEGAMOE_EXP"] = str(exp)
        t0 = time.time()
        def call():
            y, _ = mega_moe(x, *rest, None, score_before_experts=False, settings=settings)
            y.backward(dy)
        call(); torch.cuda.synchronize(); compile_s = time.time() - t0
        for _ in range(2): call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10): call()
            torch.cuda.synchronize()
        k = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k[e.name[:40]] += e.device_time / 10 / 1e3
        top = {n: round(v, 3) for n, v in sorted(k.items(), key=lambda kv: -kv[1]) if v > 0.05}
        print(f"{prec} exp={exp} comm={comm} (first call {compile_s:.0f}s) total {sum(k.values()):.3f}: {top}", flush=True)
        with out.open("a") as f:
            f.write(json.dumps({"precision": prec, "exp": exp, "comm": comm, "kernels": dict(k)}) + "\n")
dist.destroy_process_group()

"""How the fused kernels share the GPU with a collective running on another stream.

    torchrun --nproc_per_node=N scripts/sm_sharing.py --shape 30B-A3B --tokens 16384 --reserved-sms 0,1,16

In training, FSDP all-gathers the next layer's weights and reduce-scatters the last
layer's gradients on streams of their own while a layer computes. The fused kernels are
persistent: one program per SM, each running until the last tile is taken, and a program
holds its SM's registers whole, so a kernel launched meanwhile on another stream starts
only when one of them ends, and a kernel that holds SMs when they start keeps some of
their programs waiting (the call's last step waits for every program).
``reserved_sms`` leaves SMs free for such kernels.

For each ``--reserved-sms`` value the script times, with the CUDA events of each stream,
over ``--iters`` calls of forward + backward (GEMM1 saved, random routing):

- ``layer``: the call alone;
- ``collective``: the collective alone;
- ``during``: the collective launched while the call runs (after the host has issued the
  call); its time from launch to end, and the call's;
- ``first``: the collective launched just before the call; the call's time, and the
  collective's.

The collective: with several ranks, an all-gather of ``--gather-mib`` MiB per rank over
all of them (NCCL, as FSDP's); on one GPU, where NCCL moves data without kernels, a
one-program kernel that holds an SM for ``--stand-in-us`` microseconds
(``torch.cuda._sleep``). It also checks that every value computes the same output and
gradients as ``reserved_sms`` 0, bit for bit. Prints a table and writes
``sm_sharing.json``.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from titan_megamoe.ops import mega_moe
from titan_megamoe.settings import OperatorSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import SHAPES, nonnegative_int, positive_float, positive_int  # noqa: E402
from profile_layer import start_rank  # noqa: E402


def sms_list(text: str) -> list[int]:
    values = text.split(",")
    for value in values:
        if not value.isdigit():
            raise argparse.ArgumentTypeError(f"{value!r} is not a number of SMs (an integer >= 0)")
    return [int(v) for v in values]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="30B-A3B", choices=list(SHAPES))
    p.add_argument("--tokens", type=positive_int, default=16384, help="tokens per rank")
    p.add_argument("--reserved-sms", type=sms_list, default=[0, 1, 16],
                   help="comma-separated reserved_sms values to compare (default 0,1,16)")
    p.add_argument("--gather-mib", type=positive_int, default=512,
                   help="several ranks: MiB each rank contributes to the all-gather (default 512)")
    p.add_argument("--stand-in-us", type=positive_float, default=1000.0,
                   help="one GPU: how long the stand-in kernel holds its SM, in microseconds (default 1000)")
    p.add_argument("--warmup", type=nonnegative_int, default=3)
    p.add_argument("--iters", type=positive_int, default=10)
    p.add_argument("--out", default="outputs/sm_sharing")
    return p.parse_args(argv)


def stand_in(us: float):
    """A one-program kernel of about ``us`` microseconds (calibrated here)."""
    cycles = 1_000_000
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        per_us = cycles / (start.elapsed_time(end) * 1e3)
    cycles = int(us * per_us)
    return lambda: torch.cuda._sleep(cycles)


def all_gather(mib: int, world: int):
    part = torch.empty(mib * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
    whole = torch.empty(world * part.numel(), dtype=part.dtype, device="cuda")
    return lambda: dist.all_gather_into_tensor(whole, part)


def timed(call, collective, side: torch.cuda.Stream, mode: str) -> tuple[float | None, float | None]:
    """``(call ms, collective ms from its launch on stream ``side``)`` of one run in ``mode``;
    None where the mode leaves one out."""
    ready = torch.cuda.Event()
    call_start, call_end, coll_start, coll_end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
        torch.cuda.synchronize()
    ready.record()  # before the call: the collective never waits for any of it

    def launch_collective():
        side.wait_event(ready)
        with torch.cuda.stream(side):
            coll_start.record()
            collective()
            coll_end.record()

    if mode in ("collective", "first"):
        launch_collective()
    if mode != "collective":
        call_start.record()
        call()
        call_end.record()
    if mode == "during":
        launch_collective()
    torch.cuda.synchronize()
    call_ms = call_start.elapsed_time(call_end) if mode != "collective" else None
    coll_ms = coll_start.elapsed_time(coll_end) if mode != "layer" else None
    return call_ms, coll_ms


def main():
    args = parse_args()
    rank, world, group, (x, *rest) = start_rank("sm_sharing", args.shape, args.tokens)
    x = x.requires_grad_(True)
    weights = rest[2:]
    for w in weights:
        w.requires_grad_(True)
    dy = torch.randn_like(x)
    if world > 1:
        collective = all_gather(args.gather_mib, world)
        what = f"all-gather of {args.gather_mib} MiB per rank over {world} ranks (NCCL)"
    else:
        collective = stand_in(args.stand_in_us)
        what = f"stand-in: one program holding an SM for {args.stand_in_us:g} us"

    results, reference, side = [], None, torch.cuda.Stream()
    for reserved in args.reserved_sms:
        settings = OperatorSettings(precision="bf16", backend="fused", capacity_tokens_per_rank=args.tokens,
                                    reserved_sms=reserved, save_gemm1=True)

        def call():
            for t in (x, *weights):
                t.grad = None
            y, _ = mega_moe(x, *rest, group, score_before_experts=False, settings=settings)
            y.backward(dy)
            return y

        outputs = [call().detach().clone(), x.grad.clone(), *(w.grad.clone() for w in weights)]
        if reference is None:
            reference = outputs
        identical = all(torch.equal(a, b) for a, b in zip(outputs, reference))
        row = {"reserved_sms": reserved, "identical_to_first": identical}
        for mode in ("layer", "collective", "during", "first"):
            for _ in range(args.warmup):
                timed(call, collective, side, mode)
            runs = [timed(call, collective, side, mode) for _ in range(args.iters)]
            for i, name in ((0, "call_ms"), (1, "collective_ms")):
                values = [r[i] for r in runs if r[i] is not None]
                if values:
                    row[f"{mode}_{name}"] = statistics.median(values)
        results.append(row)

    if rank == 0:
        print(f"[sm_sharing] {torch.cuda.get_device_name()} x{world}, {args.shape}, {args.tokens:,} tokens/rank, "
              f"bf16 fwd+bwd, GEMM1 saved; collective: {what}; medians of {args.iters} (ms)")
        print(f"| reserved_sms | layer alone | collective alone | during: layer / collective | "
              f"first: layer / collective | same results as {args.reserved_sms[0]} |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in results:
            print(f"| {r['reserved_sms']} | {r['layer_call_ms']:.2f} | {r['collective_collective_ms']:.2f} | "
                  f"{r['during_call_ms']:.2f} / {r['during_collective_ms']:.2f} | "
                  f"{r['first_call_ms']:.2f} / {r['first_collective_ms']:.2f} | "
                  f"{'yes' if r['identical_to_first'] else 'NO'} |")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(), "world": world, "shape": args.shape, "tokens": args.tokens,
                "collective": what, "iters": args.iters, "warmup": args.warmup}
        (out / "sm_sharing.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
        print(f"[sm_sharing] wrote {out / 'sm_sharing.json'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

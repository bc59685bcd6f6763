"""Host time of ``kernels.launch`` per steady launch, with the launch itself stubbed out.

    python scripts/launch_overhead.py [--iters N] [--new-tensors K] [--out DIR]

A kernel of 95 parameters (40 tensors, 23 integers, 32 constexprs: the size of the fused
operator's largest), launched as the operator launches it: the same buffers, integers and
constexprs each time and ``--new-tensors`` tensors of the call's own. Rows: ``launch`` as
it runs (the kernel's recent launches tried first), and ``launch`` keying every argument
(its recent launches forgotten before each). Runs on any host (no GPU: the compiled kernel
is a stub); prints a table and writes ``DIR/launch_overhead.json``.
"""

import argparse
import inspect
import json
import time
from pathlib import Path

import torch

from titan_megamoe.kernels import launch as launching

TENSORS, INTEGERS, CONSTEXPRS = 40, 23, 32


def _stub_kernel():
    """A stand-in JIT kernel of TENSORS + INTEGERS + CONSTEXPRS parameters whose compiled
    form does nothing."""
    names = [f"t{i}" for i in range(TENSORS)] + [f"i{i}" for i in range(INTEGERS)]
    names += [f"C{i}: 'tl.constexpr'" for i in range(CONSTEXPRS)]
    scope = {}
    exec(f"def fn({', '.join(names)}): pass", scope)

    class Param:
        def __init__(self, p):
            self.is_constexpr = "constexpr" in str(p.annotation)

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: None

    class Kernel:
        fn = scope["fn"]
        params = [Param(p) for p in inspect.signature(scope["fn"]).parameters.values()]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: Compiled()

    return Kernel()


def time_launches(iters: int, new_tensors: int, forget: bool) -> float:
    """Microseconds of host time per launch."""
    kernel = _stub_kernel()
    buffers = [torch.empty(64) for _ in range(TENSORS - new_tensors)]
    integers = [16 * i for i in range(INTEGERS)]
    constexprs = {f"C{i}": 2048 + i for i in range(CONSTEXPRS)}
    calls = [[torch.empty(64) for _ in range(new_tensors)] for _ in range(iters + 2)]
    for own in calls[:2]:  # the first compiles, the second finds the compiled kernel
        launching.launch(kernel, (1,), *own, *buffers, *integers, **constexprs)
    start = time.perf_counter()
    for own in calls[2:]:
        if forget:
            launching._RECENT.pop(kernel, None)
        launching.launch(kernel, (132,), *own, *buffers, *integers, **constexprs)
    return (time.perf_counter() - start) / iters * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--new-tensors", type=int, default=8, help=f"the call's own tensors, of {TENSORS}")
    p.add_argument("--out", default="outputs/launch_overhead")
    args = p.parse_args(argv)
    if not 0 < args.iters or not 0 <= args.new_tensors <= TENSORS:
        p.error(f"--iters {args.iters} must be > 0 and --new-tensors {args.new_tensors} in 0..{TENSORS}")
    launching.INTERPRET = False  # the launch path a GPU takes, to a stub
    launching._current_device = lambda: 0
    rows = {"launch": time_launches(args.iters, args.new_tensors, forget=False),
            "launch with no recent launch to try (every argument keyed, the launch recorded)": time_launches(args.iters, args.new_tensors, forget=True)}
    print(f"| {TENSORS + INTEGERS + CONSTEXPRS} arguments, {args.new_tensors} new tensors per launch | us per launch |")
    print("| --- | --- |")
    for label, us in rows.items():
        print(f"| {label} | {us:.1f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch_overhead.json").write_text(json.dumps({"args": vars(args), "us_per_launch": rows}, indent=1))
    print(f"wrote {out / 'launch_overhead.json'}")


if __name__ == "__main__":
    main()

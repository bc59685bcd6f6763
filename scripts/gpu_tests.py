"""The GPU suite (``tests/gpu``) in groups that each finish within a CI job's time limit.

    python scripts/gpu_tests.py [--groups kernels,fused_one,...] [--side-by-side N]
                                [--timeout S] [--out DIR] [--list]

Every test of ``tests/gpu`` belongs to exactly one group (``GROUPS``: a test module, or
one of its test functions; a module's functions that no group names go to the group that
names the module). Each group is one pytest process under ``--timeout`` seconds; up to
``--side-by-side`` of them share the GPU at once (three have run side by side on one 80 GB
GPU; more is not measured). Writes each group's log (``DIR/<group>.log``) and
``DIR/gpu_tests.json``, prints a table (group, seconds, passed / failed / skipped, whether
the limit stopped it) and exits non-zero if a group failed or was stopped. ``--list``
prints each group's pytest arguments and runs nothing.

The test times the groups follow are in docs/perf-history.md (v47, v49, v50): on one H100 the
largest group, fused_rest, took about 430 s.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SUITE = "tests/gpu"

GROUPS = {
    "kernels": ["test_gluon_gemm_gpu.py", "test_kernels_gpu.py", "test_failures_gpu.py",
                "test_float32_jobs_gpu.py", "test_fused_training_gpu.py", "test_reference_gpu.py"],
    "host": ["test_host_gpu.py"],
    "fused_one": ["test_fused_gpu.py::test_one_gpu"],
    "fused_rest": ["test_fused_gpu.py"],
    "virtual_routings": ["test_virtual_ranks.py::test_virtual_ranks"],
    "virtual_rest": ["test_virtual_ranks.py"],
}
"""Group name -> the modules (every function no other group names) and functions it runs."""

SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors|deselected)")


def collect(suite: str = SUITE) -> list[str]:
    """The suite's test ids (``module::function[params]``, module relative to the suite)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", suite],
                         cwd=ROOT, capture_output=True, text=True)
    ids = [line.split("/", 2)[-1] for line in out.stdout.splitlines() if line.startswith(f"{suite}/")]
    if out.returncode != 0 or not ids:
        raise RuntimeError(f"pytest could not collect {suite} (rc {out.returncode}):\n{out.stdout[-2000:]}"
                           f"{out.stderr[-2000:]}")
    return ids


def assign(test_ids: list[str], groups: dict[str, list[str]] = GROUPS) -> dict[str, list[str]]:
    """Each group's pytest arguments (``tests/gpu/module::function``, each once): a test goes
    to the group naming its function, else to the group naming its module. Raises naming a
    test no group takes, or a group entry that matches no test."""
    owner = {}
    for name, entries in groups.items():
        for entry in entries:
            if entry in owner:
                raise ValueError(f"{entry} is in groups {owner[entry]} and {name}")
            owner[entry] = name
    chosen = {name: [] for name in groups}
    used = set()
    for test_id in test_ids:
        function = test_id.split("[", 1)[0]
        module = function.split("::", 1)[0]
        entry = function if function in owner else module
        if entry not in owner:
            raise ValueError(f"{SUITE}/{test_id} is in no group of scripts/gpu_tests.py: add its module or function")
        used.add(entry)
        arg = f"{SUITE}/{function}"
        if arg not in chosen[owner[entry]]:
            chosen[owner[entry]].append(arg)
    stale = sorted(set(owner) - used)
    if stale:
        raise ValueError(f"group entries that match no test of {SUITE}: {', '.join(stale)}")
    return chosen


def run_group(name: str, args: list[str], timeout_s: int, out: Path) -> dict:
    """One group as one pytest process; its log ``out/<name>.log`` and its counts."""
    log = out / f"{name}.log"
    start = time.monotonic()
    with open(log, "w") as f:
        # A session of its own, so that the limit stops the ranks a test spawned as well.
        proc = subprocess.Popen([sys.executable, "-m", "pytest", *args, "-q", "-rs", "--durations=20",
                                 "-p", "no:cacheprovider"], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc, stopped = proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, stopped = None, True
    seconds = time.monotonic() - start
    counts = {}
    lines = log.read_text().splitlines()
    if lines and not stopped:
        counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
                  for n, kind in SUMMARY.findall(lines[-1])}
    result = {"group": name, "seconds": round(seconds, 1), "rc": rc, "stopped_by_limit": stopped, **counts}
    print(f"[gpu_tests] {name}: {'stopped by the limit' if stopped else f'rc {rc}'} after {seconds:.0f} s "
          f"{counts}", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of: {', '.join(GROUPS)}")
    p.add_argument("--side-by-side", type=int, default=1, help="groups sharing the GPU at once (default 1)")
    p.add_argument("--timeout", type=int, default=540, help="seconds each group may run (default 540)")
    p.add_argument("--out", default="outputs/gpu_tests", help="folder for the logs and gpu_tests.json")
    p.add_argument("--list", action="store_true", help="print each group's pytest arguments and run nothing")
    args = p.parse_args(argv)
    names = [g for g in args.groups.split(",") if g]
    unknown = [g for g in names if g not in GROUPS]
    if unknown:
        p.error(f"unknown groups {', '.join(unknown)}; the groups are {', '.join(GROUPS)}")
    if args.side_by_side < 1 or args.timeout < 1:
        p.error(f"--side-by-side {args.side_by_side} and --timeout {args.timeout} must be positive")
    if not args.list and not torch.cuda.is_available():
        p.error("needs a CUDA GPU: without one every test of tests/gpu skips (tests/cpu is the CPU suite)")
    chosen = assign(collect())
    if args.list:
        for name in names:
            print(f"{name}: {' '.join(chosen[name])}")
        return 0
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.side_by_side) as pool:
        results = list(pool.map(lambda n: run_group(n, chosen[n], args.timeout, out), names))
    (out / "gpu_tests.json").write_text(json.dumps(results, indent=1))
    print("| group | seconds | passed | failed | skipped | stopped by the limit |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['group']} | {r['seconds']} | {r.get('passed', 0)} | {r.get('failed', 0) + r.get('error', 0)} | "
              f"{r.get('skipped', 0)} | {'yes' if r['stopped_by_limit'] else 'no'} |")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

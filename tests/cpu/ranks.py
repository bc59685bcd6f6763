"""Run a function on N ranks in fresh processes, with a deadline.

A rank's exception fails the calling test with that rank's traceback; a rank that
hangs (a missed collective) fails it after ``timeout_s`` instead of blocking CI.
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cpu_compat


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, backend: str, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        cpu_compat.apply()
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done: leave without the interpreter's teardown. Under load, a C++ thread of the
    # distributed stack is sometimes destroyed still joinable at exit ("terminate called
    # without an active exception", SIGABRT) after the rank has finished its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int = 2, *args, timeout_s: float = 600.0, backend: str = "gloo") -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo on the CPU, or
    nccl with rank i on GPU i)."""
    context = mp.start_processes(
        _entry,
        args=(world_size, _free_port(), backend, fn, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    # join() returns False whenever one rank ends while others still run.
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks in {timeout_s:.0f} s")


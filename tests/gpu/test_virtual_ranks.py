"""EP = 4 and 8 on one GPU: virtual ranks (``symm.VirtualGroup``), each with its own
buffers, its own stream and 1 / ep of the SMs, running the fused forward and backward at
the Qwen3-30B-A3B expert shapes. Every (token, slot) row each rank gets back in its
combine buffer, the output and every gradient are checked against the fp32 reference
computed over all ranks' tokens, with random and skewed routing, a rank that receives
nothing and a rank with no tokens. In mxfp8 the rows, the output and the data gradients
are checked against the mxfp8 spec and the weight gradients against fp32: the spec
rounds them along the tokens in blocks that follow the receive layout, which differs
between one rank and many.

Each rank's calls are made from a thread of its own (each layout waits for every peer's).
Receive windows are sized by the load (``receive_load``, at its default twice the mean);
skewed routing brings rank 0 more rows than that, and every call then runs them in
further rounds, with no wait on the host; one case keeps buffers sized for any routing.
Every token routed to rank 0's experts runs in rounds too, and the windows then grow for
later calls. A bad expert id on one rank poisons every rank (NaN outputs), the next call
raises on every rank, and the group stays in step."""

import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from ranks import run_ranks

from titan_megamoe.precision import get_precision
from titan_megamoe.reference import max_row_error, relative_error
from titan_megamoe.settings import DEFAULT_RECEIVE_LOAD

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
TOLERANCE = 1e-2
"""bf16 against fp32, global relative error (DESIGN.md, Tolerances)."""
ROW_TOLERANCE = 5e-2
"""bf16 against fp32, the worst single row: a bf16 row rounds at ~4e-3 per element;
a missing or doubled slot moves a row by more than 1 / top_k. Also a quantized row
against its same-precision spec."""
QUANTIZED_TOLERANCE = 8e-2
"""A quantized precision against fp32, global relative error (DESIGN.md, Tolerances)."""


def _routing(kind: str, rank: int, ep: int, num_tokens: int, g: torch.Generator) -> torch.Tensor:
    scores = torch.rand(num_tokens, EXPERTS, generator=g, device="cuda")
    local = EXPERTS // ep
    if kind == "skewed":  # most slots on rank 0's experts, the rest spread thin
        scores[:, :local] += 0.8
    elif kind == "all_to_rank0":  # every slot on rank 0's experts
        scores[:, :local] += 2.0
    elif kind == "last_rank_starves":  # nobody routes to the last rank
        scores[:, EXPERTS - local:] -= 2.0
    return scores.topk(TOP_K, dim=1).indices


TOKENS = {"random": lambda r: 2048 + 37 * r, "skewed": lambda r: 1024, "last_rank_starves": lambda r: 1500,
          "empty_rank": lambda r: 0 if r == 1 else 1200, "all_to_rank0": lambda r: 1024}


def _problem(kind: str, ep: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    weights = [torch.randn(EXPERTS, *shape, generator=g, device="cuda") / shape[1] ** 0.5
               for shape in ((INTER, HIDDEN), (HIDDEN, INTER), (INTER, HIDDEN))]
    w1, w2, w3 = (w.bfloat16() for w in weights)
    ranks = []
    for r in range(ep):
        n = TOKENS[kind](r)
        x = torch.randn(n, HIDDEN, generator=g, device="cuda").bfloat16()
        idx = _routing("random" if kind == "empty_rank" else kind, r, ep, n, g)
        w = torch.softmax(torch.randn(n, TOP_K, generator=g, device="cuda"), dim=1)
        dy = torch.randn(n, HIDDEN, generator=g, device="cuda").bfloat16()
        ranks.append((x, idx, w, dy))
    return (w1, w2, w3), ranks


def _slot_rows(x, idx, w1, w2, w3, precision: str) -> torch.Tensor:
    """fp32 expert output of every (token, slot) row, ``[T * k, H]``, h rounded to bf16
    as the kernels store it; quantized, the spec's (each row a token of its own, routed
    to its slot's expert alone with weight 1)."""
    flat = idx.reshape(-1)
    if precision != "bf16":
        from titan_megamoe import reference

        rows = x.repeat_interleave(TOP_K, 0)
        ones = torch.ones(rows.shape[0], 1, device="cuda")
        out, _ = reference.moe_forward(rows, flat[:, None], ones, w1, w2, w3, None, False, get_precision(precision))
        return out.float()
    out = torch.empty(flat.numel(), HIDDEN, device="cuda")
    xs = x.float().repeat_interleave(TOP_K, 0)
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero().squeeze(1)
        a = xs[rows] @ w1[e].float().T
        b = xs[rows] @ w3[e].float().T
        h = (torch.nn.functional.silu(a) * b).bfloat16().float()
        out[rows] = h @ w2[e].float().T
    return out


@contextlib.contextmanager
def _load_kernels_only(loaded: dict):
    """Kernel launches inside compile and load their kernels without running them, into
    ``loaded`` (name -> compiled kernel).

    Loading a module can wait for the GPU to go idle (CUDA's lazy-loading hazard for
    kernels that wait on each other): a kernel loaded at its first launch while another
    virtual rank's kernel spins would never start. One such pass loads every kernel first.
    """
    from triton.runtime.jit import JITFunction

    from titan_megamoe.kernels import launch as launching

    class Unkept(dict):
        """Keeps no compiled kernel: every launch of the pass goes through ``load_only``."""

        def __setitem__(self, key, value):
            pass

    launch = JITFunction.run

    def load_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        kernel._init_handles()
        loaded[f"{self.__name__}/{len(loaded)}"] = kernel
        return kernel

    JITFunction.run = load_only
    compiled, launching._COMPILED = launching._COMPILED, Unkept()
    recent, launching._RECENT = launching._RECENT, {}
    try:
        yield
    finally:
        JITFunction.run = launch
        launching._COMPILED, launching._RECENT = compiled, recent


def _reserve_local_memory(loaded: dict) -> None:
    """Size the context's per-thread local memory for the largest frame among ``loaded``
    now, while the device is idle. CUDA grows it at the first launch of a kernel whose
    frame (register spills) is larger than any launched before, and growing waits for the
    device to go idle: with virtual ranks, for another rank's kernel that waits for this
    one."""
    import ctypes

    frame = max(4 * kernel.n_spills for kernel in loaded.values())
    print("kernels (registers, local bytes): " + ", ".join(
        f"{name} ({kernel.n_regs}, {4 * kernel.n_spills})" for name, kernel in loaded.items()), flush=True)
    if frame == 0:
        return
    cuda = ctypes.CDLL("libcuda.so.1")
    stack_size_limit = 0  # CU_LIMIT_STACK_SIZE
    current = ctypes.c_size_t()
    assert cuda.cuCtxGetLimit(ctypes.byref(current), stack_size_limit) == 0
    if current.value < frame:
        assert cuda.cuCtxSetLimit(stack_size_limit, ctypes.c_size_t(frame)) == 0, frame


def _on_each_rank(group, call):
    """``[call(r) for each rank r]``, each from a thread of its own on the rank's stream."""

    def on_rank(r):
        with torch.cuda.stream(group.ranks[r].stream):
            return call(r)

    with ThreadPoolExecutor(max_workers=group.ep) as pool:
        return list(pool.map(on_rank, range(group.ep)))


def _synchronize() -> None:
    """Wait for every rank's stream; a stopped kernel raises with the ranks' records."""
    from titan_megamoe import fused

    try:
        torch.cuda.synchronize()
    except RuntimeError as error:
        raise RuntimeError(f"{error}; recorded: {fused.failures()}") from error


def _prepare(group, ranks, shards, settings) -> list:
    """Every rank's buffers, a reserve in the caching allocator and every kernel loaded,
    before any rank's kernels run; returns each rank's forward buffers."""
    from titan_megamoe import fused

    # Nothing may allocate device or pinned memory while a virtual rank's kernels wait for
    # another's (an allocation can synchronise the device): every buffer set first, and a
    # reserve in the caching allocator (which caches per stream) for what each rank's
    # calls take from it.
    for r, (x, idx, _, _) in enumerate(ranks):
        with torch.cuda.stream(group.ranks[r].stream):
            fused.prepare(x, idx, shards[r][0], group.ranks[r], settings)
            reserve = [torch.empty(4 << 30, dtype=torch.uint8, device="cuda")]
            reserve += [torch.empty(512 << 10, dtype=torch.uint8, device="cuda") for _ in range(64)]
            del reserve
    buffers = [fused._plan(x, idx, shards[r][0], group.ranks[r], settings).buffers
               for r, (x, idx, _, _) in enumerate(ranks)]
    loaded = {}
    # The pass launches no kernel: its calls' records are never written, and no later
    # call may read them for growth.
    resync = buffers[0].calls + 2
    with _load_kernels_only(loaded):
        for r, (x, idx, w, dy) in enumerate(ranks):
            with torch.cuda.stream(group.ranks[r].stream):
                dry = fused.moe_forward(x, idx, w, *shards[r], group.ranks[r], False, settings)
                fused.moe_backward(dy, x, idx, w, *shards[r], *dry[2:], group.ranks[r], False, settings)
    _synchronize()
    for b in buffers:
        b.resync_call = resync
    _reserve_local_memory(loaded)
    return buffers


def _run(ep: int, kind: str, seed: int, save_gemm1: bool, precision: str = "bf16",
         receive_load: float = DEFAULT_RECEIVE_LOAD, steps: int = 1, growing_steps: tuple[int, ...] = ()):
    """``steps`` forward + backward steps, each checked (``_check_step``); the launches of
    every step but ``growing_steps`` (whose forward grows the buffers, collectively, which
    synchronises) under ``set_sync_debug_mode("error")``."""
    from titan_megamoe.settings import OperatorSettings
    from titan_megamoe.symm import VirtualGroup

    (w1, w2, w3), ranks = _problem(kind, ep, seed)
    local = EXPERTS // ep
    capacity = max(x.shape[0] for x, *_ in ranks)
    settings = OperatorSettings(precision=precision, backend="fused", capacity_tokens_per_rank=capacity,
                                save_gemm1=save_gemm1, timeout_s=20.0, receive_load=receive_load)
    group = VirtualGroup(ep, torch.device("cuda"), name=f"virtual-{kind}-{seed}")
    shards = [tuple(w[r * local:(r + 1) * local] for w in (w1, w2, w3)) for r in range(ep)]
    buffers = _prepare(group, ranks, shards, settings)
    prepared_rows = buffers[0].recv.shape[0]
    print(f"EP {ep} {kind}: buffers prepared ({prepared_rows} receive rows), kernels loaded", flush=True)

    for step in range(steps):
        _check_step(ep, kind, save_gemm1, precision, group, ranks, shards, settings, (w1, w2, w3), buffers,
                    prepared_rows, step, strict=step not in growing_steps)
    return buffers, prepared_rows


@contextlib.contextmanager
def _no_synchronisation(strict: bool):
    """Inside, a call that synchronises the device raises (``strict``)."""
    if strict:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _check_step(ep, kind, save_gemm1, precision, group, ranks, shards, settings, weights, buffers, prepared_rows,
                step, strict: bool):
    """One forward and backward on every rank, launched with no synchronisation where
    ``strict``: the rows each rank got back, the output and every gradient against the
    reference."""
    from titan_megamoe import fused, reference

    w1, w2, w3 = weights
    local = EXPERTS // ep
    window = buffers[0].window
    with _no_synchronisation(strict):
        forward = _on_each_rank(group, lambda r: fused.moe_forward(*ranks[r][:3], *shards[r], group.ranks[r],
                                                                   False, settings))
    print(f"EP {ep} {kind} step {step}: forwards launched", flush=True)
    _synchronize()
    most = max(b.records.read_ring(b.calls, timeout_s=1.0, stop=lambda: False).most for b in buffers)
    rows = {b.recv.shape[0] for b in buffers}
    print(f"EP {ep} {kind} step {step}: a rank received up to {most} rows, {-(-most // window)} window(s) of "
          f"{window} rows (the call ran {buffers[0].rounds} rounds); receive rows {prepared_rows} -> {rows}",
          flush=True)
    assert len(rows) == 1, rows
    assert fused.record_waits()[0] == 0, "the host waited for the device"
    combine_rows = [b.combine for (_, b) in sorted(
        ((k, b) for k, b in fused._BUFFERS.items() if k[0] == group.ranks[0].group_name),
        key=lambda kb: kb[1].shape.rank)]
    checked_rows = []
    for r, (x, idx, w, _) in enumerate(ranks):
        n = x.shape[0] * TOP_K
        expected = _slot_rows(x, idx, w1, w2, w3, precision)
        got = combine_rows[r][:n].float()
        checked_rows.append((relative_error(got, expected) if n else 0.0, max_row_error(got, expected)))
    with _no_synchronisation(strict):
        backward = _on_each_rank(group, lambda r: fused.moe_backward(
            ranks[r][3], *ranks[r][:3], *shards[r], *forward[r][2:], group.ranks[r], False, settings))
    _synchronize()

    # The fp32 reference over every rank's tokens with every expert local; quantized, the
    # spec's output and data gradients beside it.
    fp32 = get_precision("bf16")
    x_all, idx_all, w_all, dy_all = (torch.cat(parts) for parts in zip(*ranks))
    weights32 = [w.float() for w in (w1, w2, w3)]
    y_ref, counts_ref = reference.moe_forward(x_all.float(), idx_all, w_all, *weights32, None, False, fp32)
    grads_ref = reference.moe_backward(dy_all.float(), x_all.float(), idx_all, w_all, *weights32, None,
                                       False, fp32)
    quantized = precision != "bf16"
    if quantized:
        spec = get_precision(precision)
        y_spec, _ = reference.moe_forward(x_all, idx_all, w_all, w1, w2, w3, None, False, spec)
        grads_spec = reference.moe_backward(dy_all, x_all, idx_all, w_all, w1, w2, w3, None, False, spec,
                                           save_gemm1)
        y_ref, grads_ref = y_spec, grads_spec[:2] + grads_ref[2:]
    start = 0
    for r, (x, *_ ) in enumerate(ranks):
        mine = slice(start, start + x.shape[0])
        start += x.shape[0]
        shard = slice(r * local, (r + 1) * local)
        y, counts = forward[r][:2]
        dx, dw_score, dw1, dw2, dw3 = backward[r]
        pairs = {"y": (y, y_ref[mine]), "dx": (dx, grads_ref[0][mine]), "d_topk_w": (dw_score, grads_ref[1][mine]),
                 "dw1": (dw1, grads_ref[2][shard]), "dw2": (dw2, grads_ref[3][shard]),
                 "dw3": (dw3, grads_ref[4][shard])}
        err_rows, worst_row = checked_rows[r]
        print(f"EP {ep} {kind} save={save_gemm1} rank {r} ({x.shape[0]} tokens, {int(counts.sum())} rows in): "
              f"(token, slot) rows {err_rows:.1e} worst row {worst_row:.1e}; "
              + ", ".join(f"{k} {relative_error(a, b) if a.numel() else 0.0:.1e}" for k, (a, b) in pairs.items()))
        assert worst_row < ROW_TOLERANCE and err_rows < TOLERANCE, (ep, kind, r, "combine rows")
        assert torch.equal(counts, counts_ref[shard]), (ep, kind, r, "tokens per expert")
        for name, (got, want) in pairs.items():
            assert torch.isfinite(got).all(), (ep, kind, r, name)
            if want.numel() == 0 or want.abs().max() == 0:
                assert got.abs().max() == 0 if got.numel() else True, (ep, kind, r, name)
                continue
            weight_gradient = name.startswith("dw")
            bound = QUANTIZED_TOLERANCE if quantized and weight_gradient else TOLERANCE
            assert relative_error(got, want) < bound, (ep, kind, r, name)
            if name in ("y", "dx"):
                assert max_row_error(got, want) < ROW_TOLERANCE, (ep, kind, r, name, "worst row")


def _run_bad_ids(ep: int, bad_rank: int, seed: int) -> None:
    """One rank's ``topk_idx`` holds an id past the last expert (at its last token), the
    others' are valid: every rank's forward, each from its own thread, returns NaN; no
    stream faults, no failure is recorded, no rank's receive buffer (poisoned) gets a row;
    every rank's next forward raises ValueError naming that rank's id and where it is,
    and the forward after matches the fp32 reference on every rank."""
    from titan_megamoe import fused, reference
    from titan_megamoe.precision import get_precision
    from titan_megamoe.settings import OperatorSettings
    from titan_megamoe.symm import VirtualGroup

    (w1, w2, w3), ranks = _problem("random", ep, seed)
    local = EXPERTS // ep
    capacity = max(x.shape[0] for x, *_ in ranks)
    settings = OperatorSettings(precision="bf16", backend="fused", capacity_tokens_per_rank=capacity,
                                timeout_s=20.0)
    group = VirtualGroup(ep, torch.device("cuda"), name=f"virtual-bad-ids-{seed}")
    shards = [tuple(w[r * local:(r + 1) * local] for w in (w1, w2, w3)) for r in range(ep)]
    buffers = _prepare(group, ranks, shards, settings)
    bad = [idx.clone() for _, idx, _, _ in ranks]
    token = bad[bad_rank].shape[0] - 1
    bad[bad_rank][token, TOP_K - 1] = 10**6
    for b in buffers:
        b.recv.fill_(float("nan"))
    torch.cuda.synchronize()

    poisoned = _on_each_rank(group, lambda r: fused.moe_forward(ranks[r][0], bad[r], ranks[r][2], *shards[r],
                                                                 group.ranks[r], False, settings)[0])
    _synchronize()
    assert all(torch.isnan(y.float()).all() for y in poisoned if y.numel()), "a poisoned call returned numbers"

    def forward(r):
        try:
            fused.moe_forward(*ranks[r][:3], *shards[r], group.ranks[r], False, settings)
        except ValueError as error:
            return str(error)
        return None

    messages = _on_each_rank(group, forward)
    for r, message in enumerate(messages):
        owner = "" if r == bad_rank else f"rank {bad_rank}'s "
        print(f"EP {ep} rank {r}: {message}", flush=True)
        assert message is not None, (r, "the next call did not raise")
        assert (f"{owner}topk_idx holds expert id {10**6}, outside [0, {EXPERTS}) ({ep} EP ranks x {local} local "
                f"experts), at token {token}, slot {TOP_K - 1}") in message, (r, message)
    assert fused.failures() == []
    assert all(torch.isnan(b.recv).all() for b in buffers), "a row was sent"

    forward = _on_each_rank(group, lambda r: fused.moe_forward(*ranks[r][:3], *shards[r], group.ranks[r], False,
                                                               settings))
    _synchronize()
    x_all, idx_all, w_all, _ = (torch.cat(parts) for parts in zip(*ranks))
    y_ref, _ = reference.moe_forward(x_all.float(), idx_all, w_all, *(w.float() for w in (w1, w2, w3)), None,
                                     False, get_precision("bf16"))
    start = 0
    for r, (x, *_) in enumerate(ranks):
        err = relative_error(forward[r][0], y_ref[start:start + x.shape[0]])
        start += x.shape[0]
        print(f"EP {ep} rank {r}: the next forward {err:.1e} from fp32", flush=True)
        assert err < TOLERANCE, (r, err)


def _bad_ids_case(rank: int, world: int, ep: int, bad_rank: int) -> None:
    _run_bad_ids(ep, bad_rank, seed=ep * 10 + bad_rank)


@pytest.mark.parametrize("ep, bad_rank", [(4, 2), (8, 0)])
def test_virtual_ranks_bad_expert_id(ep, bad_rank):
    run_ranks(_bad_ids_case, 1, ep, bad_rank, backend="nccl", timeout_s=300)


def _case(rank: int, world: int, ep: int, kind: str, precision: str = "bf16",
          receive_load: float = DEFAULT_RECEIVE_LOAD) -> None:
    _run(ep, kind, seed=ep * 10 + len(kind), save_gemm1=kind == "skewed", precision=precision,
         receive_load=receive_load)


@pytest.mark.parametrize("ep", [4, 8])
@pytest.mark.parametrize("kind", ["random", "skewed", "last_rank_starves", "empty_rank"])
def test_virtual_ranks(ep, kind):
    # A process per case: a stopped kernel ends the CUDA context, and each case's
    # buffers and per-stream caches go with its process.
    run_ranks(_case, 1, ep, kind, backend="nccl", timeout_s=300)


def test_virtual_ranks_sized_for_any_routing():
    """Receive buffers that hold every row any routing can bring: no forward grows them."""
    run_ranks(_case, 1, 8, "skewed", "bf16", 0.0, backend="nccl", timeout_s=300)


@pytest.mark.parametrize("ep, kind", [(4, "random"), (8, "skewed")])
def test_virtual_ranks_mxfp8(ep, kind):
    """mxfp8 at EP > 1, in the operand form the tile table picks (on Hopper: held in bf16)."""
    from titan_megamoe.fused_support import unsupported_reason

    reason = unsupported_reason(torch.device("cuda"), torch.bfloat16, get_precision("mxfp8"), True)
    if reason:
        pytest.skip(reason)
    run_ranks(_case, 1, ep, kind, "mxfp8", backend="nccl", timeout_s=300)


def _overflow_case(rank: int, world: int, ep: int) -> None:
    """Every slot on rank 0's experts: rank 0 receives ``ep`` times the mean, more than its
    window (twice the mean) holds, and every call runs the rows past it in further rounds,
    the host waiting for nothing; ``GROWTH_LAG`` (here 2) calls later every rank's buffers
    grow alike, and the calls after run in fewer rounds. Every step matches the reference."""
    from titan_megamoe.kernels import buffers as buffers_module

    buffers_module.GROWTH_LAG = 2
    buffers, prepared_rows = _run(ep, "all_to_rank0", seed=ep * 10 + 3, save_gemm1=True, steps=3, growing_steps=(1,))
    rows = {b.recv.shape[0] for b in buffers}
    print(f"EP {ep}: receive rows {prepared_rows} -> {rows}, {buffers[0].rounds} round(s) a call", flush=True)
    assert len(rows) == 1 and min(rows) > prepared_rows, "the buffers did not grow"
    assert buffers[0].rounds == 1, buffers[0].rounds


@pytest.mark.parametrize("ep", [4, 8])
def test_virtual_ranks_overflow_runs_in_rounds_then_grows(ep):
    run_ranks(_overflow_case, 1, ep, backend="nccl", timeout_s=300)

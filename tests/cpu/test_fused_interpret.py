"""The fused forward's and backward's Triton kernels at tiny shapes under the Triton
interpreter (one rank, CPU): output and every gradient against the reference backend,
both score modes, GEMM1 recomputed and saved, poisoned buffers, uneven and skewed
routing, determinism, the capacity check; rows past the receive window run in further
rounds (fp32 and fp8), then the window grows; failures that stop every rank (a peer that
never arrives); bad expert ids, which poison the buffers (NaN outputs, nothing sent) until
the host raises them, on every rank, at a later call; and the symmetric buffers' one-host
and same-size checks (gloo ranks).

The interpreter must be switched on before Triton kernels are defined, so each check
runs in a fresh process (``run_ranks``) started with ``TRITON_INTERPRET=1``.
"""

import pytest
import torch

from problems import assert_compiles_like_eager, poison_fused_buffers
from ranks import run_ranks

HIDDEN, INTER, EXPERTS, TOP_K = 32, 48, 8, 3


def _problem(num_tokens: int, routing: str, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    scores = torch.rand(num_tokens, EXPERTS, generator=g)
    if routing == "skewed":  # experts 5-7 get no rows, 0-2 most of them
        scores[:, :3] += 2.0
        scores[:, 5:] -= 2.0
    idx = scores.topk(TOP_K, dim=1).indices
    w = torch.softmax(torch.randn(num_tokens, TOP_K, generator=g), dim=1)
    w1 = (torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
    w3 = (torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5).to(dtype)
    return x, idx, w, w1, w2, w3


GRADIENTS = ("dx", "d_topk_w", "dw1", "dw2", "dw3")
CAPACITY = 40


def _settings(save_gemm1=False, **changes):
    from titan_megamoe.settings import OperatorSettings

    settings = OperatorSettings(precision="bf16", backend="fused", capacity_tokens_per_rank=CAPACITY,
                                save_gemm1=save_gemm1)
    return settings.replace(**changes)


def _check_against_reference(rank, world, dtype, tolerance):
    from titan_megamoe import fused, reference
    from titan_megamoe.kernels.configs import tile_config
    from titan_megamoe.precision import get_precision
    from titan_megamoe.settings import DEFAULT_SAVE_GEMM1_LOAD as DEFAULT

    bf16 = get_precision("bf16")

    # (tokens, routing, score before the experts, GEMM1 saved, rows saved as a multiple
    # of the mean): at a third of it, GEMM1 is saved for some rows and recomputed for others.
    # Each rank (a process of its own, for CI's two cores) checks every other case.
    cases = [(37, "random", False, False, DEFAULT), (37, "random", True, True, DEFAULT),
             (20, "skewed", False, True, DEFAULT), (20, "skewed", True, False, DEFAULT),
             (1, "random", False, False, DEFAULT), (37, "random", False, True, 0.34)]
    for num_tokens, routing, score_before, save, load in cases[rank::world]:
        x, idx, w, w1, w2, w3 = _problem(num_tokens, routing, seed=num_tokens, dtype=dtype)
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(99)).to(dtype)
        case = (num_tokens, routing, score_before, save, load)

        settings = _settings(save, save_gemm1_load=load)

        def fused_call():
            poison_fused_buffers()
            y, counts, *kept = fused.moe_forward(x, idx, w, w1, w2, w3, None, score_before, settings)
            saved_rows = kept[0].shape[0]
            assert saved_rows == (fused.saved_shapes(x, idx, w1, None, settings)[0][0] if save else 0)
            _check_record(fused._plan(x, idx, w1, None, settings).buffers, counts, case)
            grads = fused.moe_backward(dy, x, idx, w, w1, w2, w3, *kept, None, score_before, settings)
            return y, counts, grads, saved_rows

        y, counts, grads, saved_rows = fused_call()
        if load < 1:  # the routing's layout reaches past the saved rows
            align = tile_config("interpret", "native").row_align
            assert 0 < saved_rows < sum(-(-int(c) // align) * align for c in counts), case
        # The fp32 reference on the same (rounded) inputs.
        f32 = [t.float() for t in (x, w1, w2, w3)]
        y_ref, counts_ref = reference.moe_forward(f32[0], idx, w, *f32[1:], None, score_before, bf16)
        grads_ref = reference.moe_backward(dy.float(), f32[0], idx, w, *f32[1:], None, score_before, bf16)
        assert torch.equal(counts, counts_ref)
        for name, got, expected in zip(("y",) + GRADIENTS, (y,) + grads, (y_ref,) + grads_ref):
            assert got.dtype == (torch.float32 if name == "d_topk_w" else dtype), (case, name)
            assert torch.isfinite(got).all(), (case, name)
            err = reference.relative_error(got, expected)
            assert err < tolerance, (case, name, err)
        y_again, _, grads_again, _ = fused_call()
        for name, got, again in zip(("y",) + GRADIENTS, (y,) + grads, (y_again,) + grads_again):
            assert torch.equal(got, again), (case, name, "not deterministic")

    if rank == world - 1:
        _check_input_reuse(dtype, tolerance)
    (buffers,) = fused._BUFFERS.values()
    (grad,) = fused._GRAD_BUFFERS.values()
    held = buffers.symmetric_bytes + grad.symmetric_bytes
    assert fused.symmetric_bytes("bf16", capacity_tokens_per_rank=CAPACITY, hidden=HIDDEN) == held
    assert fused.symmetric_bytes("bf16", capacity_tokens_per_rank=CAPACITY + 1) == 0
    assert fused.symmetric_bytes("fp8", capacity_tokens_per_rank=CAPACITY, hidden=HIDDEN) == 0
    # The last call's layout: each expert's rows start on a multiple of row_align (its
    # padding below it), its tiles on a multiple of block_m of the virtual rows.
    bm, align = buffers.tiles.block_m, buffers.tiles.row_align
    assert align < bm
    rows = buffers.local_rows.tolist()
    for starts, step in ((buffers.local_base.tolist(), align), (buffers.block_base.tolist(), bm)):
        assert starts[0] == 0 and all(b % step == 0 for b in starts), (starts, step)
        assert all(b1 - b0 == -(-r // step) * step for b0, b1, r in zip(starts, starts[1:], rows)), (starts, rows)


def _check_record(buffers, counts, case):
    """The forward's received-rows record (written by its layout; the interpreter runs
    kernels as they launch) holds the rows it received, each expert's aligned, and each
    expert's; the host has waited for no record."""
    align = buffers.tiles.row_align
    received = sum(-(-int(c) // align) * align for c in counts)
    record = buffers.records.read_ring(buffers.calls, timeout_s=1.0, stop=lambda: False)
    assert record == (received, received, tuple(int(c) for c in counts)), (case, record)  # one rank: its own
    assert buffers.records.waits == 0, case


def _check_input_reuse(dtype, tolerance):
    """The backward reuses the received expert inputs only when its forward was the last
    call on the buffers: two forwards then two backwards resend them (and match the
    reference); a backward right after its forward does not (poisoned rows show)."""
    from titan_megamoe import fused, reference
    from titan_megamoe.precision import get_precision

    settings = _settings()
    problems = [_problem(37, "random", seed=1, dtype=dtype), _problem(20, "skewed", seed=2, dtype=dtype)]
    dys = [torch.randn(p[0].shape, generator=torch.Generator().manual_seed(i)).to(dtype) for i, p in enumerate(problems)]
    poison_fused_buffers()
    saved = [fused.moe_forward(*p, None, False, settings)[2:] for p in problems]
    for p, dy, kept in zip(problems, dys, saved):
        grads = fused.moe_backward(dy, *p, *kept, None, False, settings)
        f32 = [t.float() for t in (p[0], *p[3:])]
        expected = reference.moe_backward(dy.float(), f32[0], p[1], p[2], *f32[1:], None, False,
                                          get_precision("bf16"))
        for name, got, want in zip(GRADIENTS, grads, expected):
            assert reference.relative_error(got, want) < tolerance, ("interleaved", name)

    p, dy = problems[0], dys[0]
    kept = fused.moe_forward(*p, None, False, settings)[2:]
    poison_fused_buffers()
    grads = fused.moe_backward(dy, *p, *kept, None, False, settings)
    assert not torch.isfinite(grads[2]).all(), "the inputs were sent again"


@pytest.mark.parametrize(
    "dtype, tolerance",
    # The interpreter rounds fp32 -> bf16 by truncation, hence the looser bf16 bound here;
    # the GPU tests hold bf16 to 1e-2 against fp32 and to ~1e-3 against the reference.
    [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)],
)
def test_forward_and_backward_match_reference(dtype, tolerance, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_check_against_reference, 2, dtype, tolerance, timeout_s=600)


def _check_training_path(rank, world):
    """The op with backend fused under autograd, against the reference backend. The
    backward consumes the saved pre-activations; a second backward over the same graph
    recomputes GEMM1 and gets the same gradients."""
    from titan_megamoe.kernels.backward import preact_released
    from titan_megamoe.ops import mega_moe

    x, idx, w, w1, w2, w3 = _problem(23, "random", seed=5)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    results = {}
    for backend, save_gemm1 in (("reference", False), ("fused", False), ("fused", True)):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, w1, w2, w3)]
        settings = _settings(save_gemm1, backend=backend)
        y, _ = mega_moe(leaves[0], idx, leaves[1], *leaves[2:], None, score_before_experts=False,
                        settings=settings)
        y.backward(dy, retain_graph=True)
        results[backend, save_gemm1] = [y.detach()] + [t.grad for t in leaves]
        saved = y.grad_fn.saved_tensors[6]
        assert preact_released(saved) == save_gemm1, (backend, tuple(saved.shape))
        if save_gemm1:
            for t in leaves:
                t.grad = None
            y.backward(dy)
            results["fused", "again"] = [y.detach()] + [t.grad for t in leaves]
    for key in (("fused", False), ("fused", True), ("fused", "again")):
        for got, expected in zip(results[key], results["reference", False]):
            assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), key


def test_fused_backend_trains_through_the_op(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_check_training_path, 1, timeout_s=300)


def _check_failures_stop_every_rank(rank, world, receive_load):
    """Two virtual ranks; rank 1 never arrives. Rank 0's call fails at its deadline and
    raises; rank 1, arriving later, fails at its first wait because rank 0 failed, and
    raises too: neither returns a result. Every later call raises at once. Alike with
    receive buffers sized below every row any routing can bring (a call then runs in
    several rounds)."""
    from titan_megamoe import fused
    from titan_megamoe.symm import VirtualGroup

    x, idx, w, w1, w2, w3 = _problem(9, "random", seed=3)
    local = EXPERTS // 2
    group = VirtualGroup(2, torch.device("cpu"), name="late-peer")
    settings = _settings(timeout_s=0.2, receive_load=receive_load)
    shard = [(w1[r * local:(r + 1) * local], w2[r * local:(r + 1) * local], w3[r * local:(r + 1) * local])
             for r in range(2)]

    def call(r):
        return fused.moe_forward(x, idx, w, *shard[r], group.ranks[r], False, settings)

    timed_out = r"rank 0 timed out after 0.2 s waiting for COUNT_READY\[1\] \(value 0, expected 1\) at epoch 1"
    with pytest.raises(RuntimeError, match=timed_out + ".*no result of it was returned"):
        call(0)
    with pytest.raises(RuntimeError, match=r"rank 1 stopped at epoch 1 because rank 0 failed \(COUNT_READY\)"):
        call(1)
    for r in range(2):  # every later call says why, before launching anything
        with pytest.raises(RuntimeError, match="the process must restart"):
            call(r)
    assert len(fused.failures()) == 2


@pytest.mark.parametrize("receive_load", [0.0, 0.5])
def test_a_late_peer_fails_every_rank(receive_load, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_check_failures_stop_every_rank, 1, receive_load, timeout_s=300)


def _check_rounds_and_growth(rank, world):
    """A receive window below a call's rows (``receive_load`` under the mean): the call runs
    its rows through further rounds, with no wait on the host, and its output and
    gradients equal those of buffers that hold every routing (fp32; the weight gradients
    summed round by round). ``GROWTH_LAG`` calls later every buffer with a row per
    received row grows, the backward's too, said once in the log, and calls run in fewer
    rounds; a call that fits one window leaves them as they are."""
    import logging

    from titan_megamoe import fused, reference
    from titan_megamoe.kernels import buffers as buffers_module

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("titan_megamoe.kernels.buffers")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    buffers_module.GROWTH_LAG = 4

    problems = [_problem(1, "random", seed=7), _problem(37, "skewed", seed=8)]
    dys = [torch.randn(p[0].shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(problems)]

    def call(problem, dy, settings):
        kept = fused.moe_forward(*problem, None, False, settings)
        return [kept[0], *fused.moe_backward(dy, *problem, *kept[2:], None, False, settings)]

    full = _settings(True, save_gemm1_load=0.5, receive_load=0.0)
    expected = [call(p, dy, full) for p, dy in zip(problems, dys)]
    full_rows = fused._plan(*problems[0][:2], problems[0][3], None, full).buffers.recv.shape[0]

    sized = full.replace(receive_load=0.25)
    buffers = fused._plan(*problems[0][:2], problems[0][3], None, sized).buffers
    initial, rounds = buffers.recv.shape[0], buffers.rounds
    assert initial == buffers.shape.receive_rows(buffers.tiles) < full_rows and rounds > 2, (initial, rounds)

    def compare(got, want, what):
        for name, a, b in zip(("y",) + GRADIENTS, got, want):
            assert reference.relative_error(a, b) < 1e-6, (what, name, reference.relative_error(a, b))

    compare(call(problems[0], dys[0], sized), expected[0], "one window")
    grad = fused._GRAD_BUFFERS[id(buffers)]
    for _ in range(2):  # the skewed call's rows need several windows
        compare(call(problems[1], dys[1], sized), expected[1], "several rounds")
    assert buffers.recv.shape[0] == grad.recv_grad.shape[0] == initial and not messages
    assert buffers.records.waits == 0, "the host waited for the device"
    most = buffers.records.read_ring(buffers.calls, timeout_s=1.0, stop=lambda: False).most
    assert most > buffers.window, (most, buffers.window)
    # Growth reads the call GROWTH_LAG back: the fourth forward on reads an overflowing one.
    compare(call(problems[1], dys[1], sized), expected[1], "several rounds")
    grown = buffers.shape.grown_receive_rows(most, buffers.tiles)
    assert initial < most + buffers.tiles.block_m <= grown <= full_rows, (initial, most, grown)
    for t in (buffers.recv, buffers.recv_meta, buffers.h, grad.recv_grad, grad.recv_score):
        assert t.shape[0] == grown, tuple(t.shape)
    assert buffers.rounds < rounds
    assert len(messages) == 1 and f"brought a rank {most} rows, more than the receive window" in messages[0], messages
    recv = buffers.recv
    compare(call(problems[1], dys[1], sized), expected[1], "grown")
    compare(call(problems[0], dys[0], sized), expected[0], "grown")
    assert buffers.recv is recv and len(messages) == 1


def test_rows_past_the_window_run_in_rounds_then_the_buffers_grow(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_check_rounds_and_growth, 1, timeout_s=600)


def _bad_id_message(bad_id, token, slot, owner=""):
    return (rf"mega_moe fused: {owner}topk_idx holds expert id {bad_id}, outside \[0, {EXPERTS}\) \(1 EP ranks x "
            rf"{EXPERTS} local experts\), at token {token}, slot {slot}")


def _check_bad_expert_ids(rank, world, bad_id):
    """An expert id outside [0, E) at the first, a middle or the last token, among valid
    ids: the call sends no row (the receive buffer, poisoned, stays NaN), records no
    failure and returns NaN; the next call, here its backward, raises ValueError naming the
    id, the range and where it is, before it launches anything; and the call after runs and
    matches the reference."""
    from titan_megamoe import fused, reference
    from titan_megamoe.ops import mega_moe
    from titan_megamoe.precision import get_precision

    x, idx, w, w1, w2, w3 = _problem(9, "random", seed=3)
    settings = _settings()
    fused.prepare(x, idx, w1, None, settings)
    expected, _ = reference.moe_forward(x, idx, w, w1, w2, w3, None, False, get_precision("bf16"))
    tracked = w1.clone().requires_grad_()
    for token, slot in ((0, 0), (4, 1), (8, TOP_K - 1)):
        bad = idx.clone()
        bad[token, slot] = bad_id
        poison_fused_buffers()
        y, counts = mega_moe(x, bad, w, tracked, w2, w3, None, score_before_experts=False, settings=settings)
        assert torch.isnan(y).all() and not counts.any(), token
        buffers = fused._plan(x, idx, w1, None, settings).buffers
        assert torch.isnan(buffers.recv).all(), (token, "a row was sent")
        assert fused.failures() == [] and len(fused.pending_bad_ids()) == 1
        with pytest.raises(ValueError, match=_bad_id_message(bad_id, token, slot) + ", in the call before this one"):
            y.sum().backward()
        assert tracked.grad is None and fused.pending_bad_ids() == []
        y = fused.moe_forward(x, idx, w, w1, w2, w3, None, False, settings)[0]
        assert reference.relative_error(y, expected) < 1e-5, (token, "the next call")


@pytest.mark.parametrize("bad_id", [-1, -3, EXPERTS, 10**6, 2**40])
def test_bad_expert_ids_poison_and_the_next_call_raises(bad_id, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_check_bad_expert_ids, 1, bad_id, timeout_s=300)


def _check_bad_expert_ids_found_late(rank, world):
    """A host that finds the poison only calls later (its GPU behind it: here the poison
    words hidden from it for two calls) makes those calls on poisoned buffers: they
    compute nothing and return NaN, forward and backward (weight gradients 0); the first
    call that finds it raises, naming the call it came from, and the calls after run
    normally. Two later bad ids are raised one at a time."""
    from titan_megamoe import fused, reference
    from titan_megamoe.kernels.records import HostRecords
    from titan_megamoe.precision import get_precision

    x, idx, w, w1, w2, w3 = _problem(9, "random", seed=4)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    settings = _settings()
    bf16 = get_precision("bf16")
    expected = [reference.moe_forward(x, idx, w, w1, w2, w3, None, False, bf16)[0],
                *reference.moe_backward(dy, x, idx, w, w1, w2, w3, None, False, bf16)]
    bad = idx.clone()
    bad[6, 1] = -2
    seen = HostRecords.poisoned
    HostRecords.poisoned = lambda self: (0, 0)
    y, _, *kept = fused.moe_forward(x, bad, w, w1, w2, w3, None, False, settings)
    later = fused.moe_forward(x, idx, w, w1, w2, w3, None, False, settings)
    grads = fused.moe_backward(dy, x, idx, w, w1, w2, w3, *later[2:], None, False, settings)
    assert torch.isnan(y).all() and torch.isnan(later[0]).all() and not later[1].any()
    assert torch.isnan(grads[0]).all() and torch.isnan(grads[1]).all()
    assert all(not g.any() for g in grads[2:]), "a poisoned backward computed weight gradients"
    HostRecords.poisoned = seen
    buffers = fused._plan(x, idx, w1, None, settings).buffers
    first = buffers.calls - 2
    with pytest.raises(ValueError, match=_bad_id_message(-2, 6, 1) + rf", in call {first} \(3 calls back\)"):
        fused.moe_forward(x, idx, w, w1, w2, w3, None, False, settings)
    y, _, *kept = fused.moe_forward(x, idx, w, w1, w2, w3, None, False, settings)
    got = [y, *fused.moe_backward(dy, x, idx, w, w1, w2, w3, *kept, None, False, settings)]
    for name, a, b in zip(("y",) + GRADIENTS, got, expected):
        assert reference.relative_error(a, b) < 1e-5, name
    for slot in (0, 2):
        again = idx.clone()
        again[3, slot] = EXPERTS
        fused.moe_forward(x, again, w, w1, w2, w3, None, False, settings)
        with pytest.raises(ValueError, match=_bad_id_message(EXPERTS, 3, slot)):
            fused.moe_forward(x, idx, w, w1, w2, w3, None, False, settings)
    assert fused.failures() == []


def test_bad_expert_ids_found_late_raise_once_and_poison_the_calls_before(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_check_bad_expert_ids_found_late, 1, timeout_s=300)


def _check_bad_expert_ids_between_ranks(rank, world):
    """Two virtual ranks, the peer's side of the count exchange written into rank 0's flag
    buffer by hand (the interpreter runs one kernel at a time, so two ranks' calls cannot
    meet): rank 0 publishes its own first bad id, with its counts, into the peer's flag
    buffer and stores nothing into the peer's receive buffer; a bad id the peer publishes
    poisons rank 0 too, though its own ids are valid, and its next call raises, naming the
    peer, the id and where it is. Each time the call records no failure, and the next
    call, which meets the peer at the epoch past the poisoned one, runs."""
    from titan_megamoe import fused, reference
    from titan_megamoe.kernels.sync import EPOCH
    from titan_megamoe.precision import get_precision
    from titan_megamoe.symm import VirtualGroup

    x, idx, w, w1, w2, w3 = _problem(9, "random", seed=3)
    local = EXPERTS // 2
    group = VirtualGroup(2, torch.device("cpu"), name="bad-ids")
    settings = _settings(timeout_s=5.0)
    shard = [tuple(t[r * local:(r + 1) * local] for t in (w1, w2, w3)) for r in range(2)]
    for r in range(2):
        fused.prepare(x, idx, shard[r][0], group.ranks[r], settings)
    mine, peer = (fused._plan(x, idx, shard[r][0], group.ranks[r], settings).buffers for r in range(2))
    assert mine.rounds == 1
    layout = mine.flag_layout
    message = r"mega_moe fused: {}topk_idx holds expert id {}, outside \[0, 8\) \(2 EP ranks x 4 local experts\), at "

    def peer_arrives(bad_slot: int = 0, bad_value: int = 0) -> None:
        """The peer's stores of the next call into rank 0's flag buffer: no rows to send,
        its bad id (flat index + 1, or 0), then its COUNT_READY and COMBINE_READY."""
        epoch = int(mine.state[EPOCH.value]) + 1
        mine.flags[layout.counts + EXPERTS:layout.counts + 2 * EXPERTS] = 0
        mine.flags[layout.bad_ids + 2:layout.bad_ids + 4] = torch.tensor([bad_slot, bad_value])
        mine.flags[layout.count_ready + 1] = epoch
        mine.flags[layout.combine_ready + 1] = epoch

    def call(topk_idx):
        return fused.moe_forward(x, topk_idx, w, *shard[0], group.ranks[0], False, settings)

    # Rank 0's own bad id: published to the peer, named in rank 0's error.
    bad = idx.clone()
    bad[5, 2], bad[7, 0] = EXPERTS + 2, -4  # the negative one is reported first
    peer.recv.fill_(float("nan"))
    peer_arrives()
    assert torch.isnan(call(bad)[0]).all()
    assert peer.flags[layout.bad_ids:layout.bad_ids + 2].tolist() == [7 * TOP_K + 0 + 1, -4]
    assert torch.isnan(peer.recv).all(), "rank 0 sent rows to its peer"
    with pytest.raises(ValueError, match=message.format("", -4) + "token 7, slot 0"):
        call(idx)

    # The peer's bad id: rank 0 is poisoned too, and raises naming the peer's.
    peer_arrives(bad_slot=3 * TOP_K + 1 + 1, bad_value=10**6)
    assert torch.isnan(call(idx)[0]).all()
    assert peer.flags[layout.bad_ids:layout.bad_ids + 2].tolist()[0] == 0, "rank 0's ids are valid"
    with pytest.raises(ValueError, match=message.format("rank 1's ", 1000000) + "token 3, slot 1"):
        call(idx)
    assert fused.failures() == []

    # A clean call, every row of rank 0 on its own experts (the peer sends none).
    own = idx % local
    peer_arrives()
    y, counts = call(own)[:2]
    expected, counts_ref = reference.moe_forward(x, own, w, *shard[0], None, False, get_precision("bf16"))
    assert torch.equal(counts, counts_ref) and reference.relative_error(y, expected) < 1e-5


def test_bad_expert_ids_poison_every_rank(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_check_bad_expert_ids_between_ranks, 1, timeout_s=300)


def _check_refusals(rank, world):
    """What the buffers cannot serve is refused before anything launches: more tokens than
    the capacity, no capacity with EP > 1, a precision that mixes formats, an intermediate
    size that does not hold whole fp8 scale blocks; and buffers that carry quantized rows."""
    from titan_megamoe import fused, fused_support
    from titan_megamoe.kernels.buffers import ForwardBuffers, ForwardShape
    from titan_megamoe.kernels.configs import tile_config
    from titan_megamoe.precision import FP8_BLOCK, NATIVE, Precision
    from titan_megamoe.symm import VirtualGroup

    x, idx, w, w1, w2, w3 = _problem(9, "random", seed=3)
    small = _settings().replace(capacity_tokens_per_rank=8)
    with pytest.raises(ValueError, match="9 tokens exceed capacity_tokens_per_rank = 8"):
        fused.moe_forward(x, idx, w, w1, w2, w3, None, False, small)
    # No named precision mixes formats the kernels cannot run; an unnamed one is refused.
    mixed = Precision("bf16_fp8_dgrad_bf16_wgrad", NATIVE, FP8_BLOCK, NATIVE)
    reason = fused_support.unsupported_reason(x.device, x.dtype, mixed, ep_within_node=True)
    assert reason is not None and "precision 'bf16_fp8_dgrad_bf16_wgrad' mixes formats" in reason
    with pytest.raises(NotImplementedError, match=f"intermediate size {INTER} is not a multiple of 128"):
        fused.moe_forward(x, idx, w, w1, w2, w3, None, False, _settings(precision="fp8"))
    group = VirtualGroup(2, torch.device("cpu"))
    with pytest.raises(ValueError, match="capacity_tokens_per_rank = 0 with EP = 2"):
        fused.moe_forward(x, idx, w, w1[:4], w2[:4], w3[:4], group.ranks[0], False,
                          _settings().replace(capacity_tokens_per_rank=0))

    # A single rank without a capacity keeps one buffer set, sized for the latest call.
    unsized = _settings().replace(capacity_tokens_per_rank=0)
    for n in (9, 5, 9):
        fused.moe_forward(x[:n], idx[:n], w[:n], w1, w2, w3, None, False, unsized)
    sized_by_call = [b for key, b in fused._BUFFERS.items() if key[2].capacity_tokens_per_rank == 0]
    assert [b.shape.capacity_tokens_per_rank for b in sized_by_call] == [9]

    # Quantized rows: one allocation holds the e4m3 rows and their fp32 scales behind them.
    shape = ForwardShape(ep=1, rank=0, capacity_tokens_per_rank=9, top_k=TOP_K, local_experts=EXPERTS,
                         hidden=256, inter=INTER, dtype=torch.bfloat16, row_format=FP8_BLOCK)
    allocations = []

    def record(size, dtype):
        allocations.append((size, dtype))
        t = torch.zeros(size, dtype=dtype)
        return t, torch.tensor([t.data_ptr()])

    buffers = ForwardBuffers(shape, tile_config("interpret", "native"), torch.device("cpu"), record)
    rows = buffers.recv.shape[0]
    assert buffers.recv.dtype == torch.float8_e4m3fn and tuple(buffers.recv_scales.shape) == (rows, 2)
    assert allocations[0] == ((rows * 256 + rows * 2 * 4,), torch.uint8)
    assert buffers.recv_scales.data_ptr() - buffers.recv.data_ptr() == rows * 256


def test_refusals_and_buffer_sizes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_check_refusals, 1, timeout_s=300)


def _symmetric_buffers_need_agreement(rank, world):
    import socket

    import torch.distributed as dist

    from titan_megamoe import symm

    socket.gethostname = lambda: "node-a"
    with pytest.raises(ValueError, match="symmetric buffers over 2 ranks need CUDA devices"):
        symm.allocator(dist.group.WORLD, torch.device("cpu"), "same shape")
    with pytest.raises(ValueError, match="(?s)would size their symmetric buffers differently.*rank 1: 7 tokens"):
        symm.allocator(dist.group.WORLD, torch.device("cpu"), f"{5 + 2 * rank} tokens")
    socket.gethostname = lambda: f"node-{rank}"
    with pytest.raises(RuntimeError, match=r"EP group spans hosts \['node-0', 'node-1'\]"):
        symm.allocator(dist.group.WORLD, torch.device("cpu"), "same shape")


def test_symmetric_buffers_need_one_host_and_one_size():
    run_ranks(_symmetric_buffers_need_agreement, 2, timeout_s=300)


def _fused_under_activation_checkpointing(rank, world, mode):
    """A converted debug model trains the same on the fused backend as on the reference
    one under TorchTitan's full and selective AC. Full AC recomputes each layer's forward
    right before its backward (the backward reuses the received inputs); selective AC
    saves the operator's outputs, so the second layer's backward resends them."""
    import dataclasses

    import torchtitan.models.qwen3.infra.parallelize as qwen3
    from test_converter import debug_model, parse
    from torchtitan.distributed.activation_checkpoint import apply_ac

    from titan_megamoe.converter import MegaMoEConverter
    from titan_megamoe.reference import relative_error

    job = parse(f"--activation_checkpoint.mode={mode}", "--activation_checkpoint.selective_ac_option=op",
                "--mega_moe.backend=fused", "--mega_moe.capacity_tokens_per_rank=32")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = {}
    for backend in ("fused", "reference"):
        model = debug_model("qwen3", dim=64, n_heads=4, n_kv_heads=2, head_dim=16, moe_inter_dim=32,
                            vocab_size=256, moe={"num_experts": 8, "top_k": 2})
        converter = MegaMoEConverter(job, None)
        converter.settings = dataclasses.replace(converter.settings, backend=backend)
        converter.convert(model)
        apply_ac(model, job.activation_checkpoint, op_sac_save_list=qwen3._op_sac_save_list)
        model(tokens).square().mean().backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
    for name, expected in grads["reference"].items():
        assert relative_error(grads["fused"][name], expected) < 1e-4, name


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_fused_backend_under_activation_checkpointing(mode, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_fused_under_activation_checkpointing, 1, mode, timeout_s=600)


def _compiles_fullgraph(rank, world):
    """The fused backend's op, with its saved pre-activations, traces without graph
    breaks and computes what it computes eagerly."""
    assert_compiles_like_eager(_settings(save_gemm1=True), *_problem(23, "random", seed=4))


def test_fused_backend_compiles_fullgraph(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_compiles_fullgraph, 1, timeout_s=600)


def _quantized_problem(num_tokens: int, skewed: bool, seed: int):
    """``(x, idx, w, w1, w2, w3, dy)`` of a layer whose sizes hold whole blockwise-fp8 and MX
    blocks (hidden and intermediate 256, 4 experts, top-2), fp32; ``skewed``: most slots on
    expert 0."""
    hidden, inter, experts, top_k = 256, 256, 4, 2
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    scores = torch.rand(num_tokens, experts, generator=g)
    if skewed:
        scores[:, 0] += 2.0
    idx = scores.topk(top_k, dim=1).indices
    w = torch.softmax(torch.randn(num_tokens, top_k, generator=g), dim=1)
    w1, w3 = (torch.randn(experts, inter, hidden, generator=g) / hidden**0.5 for _ in range(2))
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return x, idx, w, w1, w2, w3, torch.randn(num_tokens, hidden, generator=g)


def _quantized_matches_reference(rank, world, precision, tile_changes):
    """The quantized forward (rows quantized once at the source, scaled GEMM1, h quantized
    in its epilogue, scaled GEMM2; fp8_bwd: the bf16 forward) and backward (dy quantized once per token, GEMM1
    recomputed scaled or read back, scaled ``dy W2``, ``[da | db]`` quantized in its
    epilogue, scaled dgrad, weight gradients requantized along the tokens;
    fp8_wgrad_bf16: weight gradients on the e4m3 rows that crossed, dequantized;
    mxfp8_wgrad_bf16: x and dy resent unquantized, quantized as GEMM1 and ``dy W2`` read
    them, bf16 weight gradients on the rows as they crossed) against the
    same-precision reference: the same quantized values, so only fp32 summation order
    (and an e4m3 rounding it may flip) separates them. fp32 activations: the interpreter
    rounds fp32 -> bf16 by truncation."""
    import dataclasses

    from titan_megamoe import fused, reference
    from titan_megamoe.kernels import configs
    from titan_megamoe.precision import get_precision

    spec = get_precision(precision)
    row = ("interpret", spec.forward.name)
    configs.TILE_CONFIGS[row] = dataclasses.replace(configs.TILE_CONFIGS[row], **tile_changes)
    gluon = tile_changes.get("gemm1_kernel") == "gluon"
    if gluon:
        # GEMM1 and the saved tiles of the backward's first kernel on the Gluon core: their
        # contracts in torch stand in for them, around the tl kernels' dispatches alone and
        # the tiles past the saved rows.
        import gluon_stand_ins

        from titan_megamoe.kernels import backward, forward

        core_calls = []
        forward.gate_up_gemm = lambda *args, **kw: core_calls.append(gluon_stand_ins.gate_up_gemm(*args, **kw))
        backward.swiglu_grad_gemm = lambda *args, **kw: core_calls.append(
            gluon_stand_ins.swiglu_grad_gemm(*args, **kw))
    # Skewed tokens, all on expert 0: more than one token block of the quantized weight
    # gradients (128 for fp8, 32 for MX) and than one receive block.
    token_block = spec.wgrad.activation_block[1] if spec.wgrad.quantized else 0
    many = max(token_block, configs.TILE_CONFIGS[row].block_m, 32) + 22
    # Each rank (a process of its own, for CI's two cores) checks half the cases, the
    # largest with the smallest.
    cases = ((many, "skewed", False, True), (24, "random", False, False), (1, "random", False, False),
             (17, "skewed", True, True))
    for num_tokens, routing, score_before, save in cases[rank::world]:
        settings = _settings(precision=precision, save_gemm1=save, capacity_tokens_per_rank=160)
        x, idx, w, w1, w2, w3, dy = _quantized_problem(num_tokens, routing == "skewed", seed=num_tokens)
        poison_fused_buffers()
        forward_calls = len(core_calls) if gluon else None
        y, counts, *kept = fused.moe_forward(x, idx, w, w1, w2, w3, None, score_before, settings)
        if gluon:
            assert len(core_calls) == forward_calls + 1, "GEMM1 did not run on the Gluon core"
        calls_before = len(core_calls) if gluon else None
        grads = fused.moe_backward(dy, x, idx, w, w1, w2, w3, *kept, None, score_before, settings)
        if gluon:  # the forward's GEMM1, and the backward's first kernel where GEMM1 was saved
            assert len(core_calls) == calls_before + save, "the Gluon first kernel ran where GEMM1 was not saved"
        y_ref, counts_ref = reference.moe_forward(x, idx, w, w1, w2, w3, None, score_before, spec)
        grads_ref = reference.moe_backward(dy, x, idx, w, w1, w2, w3, None, score_before, spec, save)
        case = (precision, tile_changes, num_tokens, routing, score_before, save)
        assert torch.equal(counts, counts_ref), case
        for name, got, want in zip(("y",) + GRADIENTS, (y,) + grads, (y_ref,) + grads_ref):
            assert torch.isfinite(got).all(), (case, name)
            err, worst = reference.relative_error(got, want), reference.max_row_error(got, want)
            print(f"{case} {name}: {err:.1e}, worst row {worst:.1e}", flush=True)
            assert err < 1e-2, (case, name, err)
            if name == "y":
                assert worst < 3e-2, (case, name, worst)


# mxfp8_wgrad_bf16 with its weights dequantized to bf16 (only the rows scaled in the MMA);
# mxfp8 with e4m3 weights: between them, every mxfp8 kernel in both weight forms; mxfp8
# with both operands upcast in the mainloop instead of handed to the scaled dot, its weight
# gradients on copies quantized along the tokens in the receive layout (blocks of 32 rows,
# experts 32-row aligned);
# and both MX precisions with every operand held in bf16 (the rows mxfp8_wgrad_bf16 resends
# unrounded rounded as the GEMMs read them); fp8 with GEMM1 and the backward's first kernel
# on the Gluon core (stood in for: the host's launches around them), in its 64-row tiles.
@pytest.mark.parametrize("precision, tile_changes",
                         [("fp8", {}), ("fp8_bwd", {}), ("fp8_wgrad_bf16", {}), ("mxfp8", {}),
                          ("fp8", {"gemm1_kernel": "gluon", "gemm1_n": 128, "grad1_kernel": "gluon",
                                   "grad1_saved_n": 128, "grad1_m": 64, "block_m": 64}),
                          ("mxfp8_wgrad_bf16", {"mx_dequantized_weights": 1}),
                          ("mxfp8", {"mx_upcast": 1, "mx_wgrad_dequantized": 1, "block_m": 32, "row_align": 32}),
                          ("mxfp8", {"mx_in_bf16": 1, "mx_wgrad_dequantized": 1, "block_m": 32, "row_align": 32}),
                          ("mxfp8_wgrad_bf16", {"mx_in_bf16": 1})])
def test_quantized_matches_reference(precision, tile_changes, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_quantized_matches_reference, 2, precision, tile_changes, timeout_s=900)


def _quantized_rounds_match_reference(rank, world):
    """fp8 with a receive window of 0.4 times the mean and a skewed routing: the call runs
    in rounds, its output and data gradients match the fp8 spec as one window's would, and
    its weight gradients (rows past the first window added from the rows as they crossed,
    not rounded along the tokens again: ``accumulate_wgrad``) match fp32 as closely as the
    spec does."""
    from titan_megamoe import fused, reference
    from titan_megamoe.precision import get_precision

    spec, fp32 = get_precision("fp8"), get_precision("bf16")
    x, idx, w, w1, w2, w3, dy = _quantized_problem(150, skewed=True, seed=3)
    settings = _settings(precision="fp8", save_gemm1=True, capacity_tokens_per_rank=160, receive_load=0.4)
    poison_fused_buffers()
    y, counts, *kept = fused.moe_forward(x, idx, w, w1, w2, w3, None, False, settings)
    grads = fused.moe_backward(dy, x, idx, w, w1, w2, w3, *kept, None, False, settings)
    buffers = fused._plan(x, idx, w1, None, settings).buffers
    most = buffers.records.read_ring(buffers.calls, timeout_s=1.0, stop=lambda: False).most
    assert most > buffers.window and buffers.rounds > 1, (most, buffers.window, buffers.rounds)
    got = (y,) + grads
    want_spec = (reference.moe_forward(x, idx, w, w1, w2, w3, None, False, spec)[0],
                 *reference.moe_backward(dy, x, idx, w, w1, w2, w3, None, False, spec, True))
    want_fp32 = (reference.moe_forward(x, idx, w, w1, w2, w3, None, False, fp32)[0],
                 *reference.moe_backward(dy, x, idx, w, w1, w2, w3, None, False, fp32))
    for name, a, b, c in zip(("y",) + GRADIENTS, got, want_spec, want_fp32):
        err_spec, err_fp32, spec_fp32 = (reference.relative_error(*pair) for pair in ((a, b), (a, c), (b, c)))
        print(f"fp8 in rounds {name}: {err_spec:.1e} from the spec, {err_fp32:.1e} from fp32 (the spec "
              f"{spec_fp32:.1e})", flush=True)
        assert torch.isfinite(a).all(), name
        if name.startswith("dw"):
            assert err_fp32 < max(spec_fp32, 1e-2) * 1.1, (name, err_fp32, spec_fp32)
        else:
            assert err_spec < 1e-2, (name, err_spec)


def test_quantized_rows_past_the_window_run_in_rounds(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_quantized_rounds_match_reference, 1, timeout_s=900)


def _float32_weights_match_reference(rank, world):
    """bf16 tokens with float32 weights, as a layer of float32 experts hands them over in
    a precision that reads the weights only quantized: every weight reaches the quantizers
    in float32 (no bf16 copy rounds it first), the weight gradients come back float32, and
    the outputs match the reference on the same inputs as closely as the same call on bf16
    weights does (the interpreter rounds to bf16 by truncation: 1-3e-2 either way). A
    precision with a bf16 weight GEMM refuses them, and ``auto`` then runs the reference."""
    import dataclasses

    from titan_megamoe import fused, ops, reference
    from titan_megamoe.kernels import backward, configs, forward
    from titan_megamoe.precision import get_precision

    hidden, inter, experts, top_k, num_tokens = 256, 256, 4, 2, 24
    precision, tile_changes = [("fp8", {}), ("mxfp8", {"mx_in_bf16": 1, "mx_wgrad_dequantized": 1, "block_m": 32,
                                                       "row_align": 32})][rank]
    spec = get_precision(precision)
    row = ("interpret", spec.forward.name)
    configs.TILE_CONFIGS[row] = dataclasses.replace(configs.TILE_CONFIGS[row], **tile_changes)
    quantized = []
    for module, name in ((forward, "quantize_weights"), (backward, "quantize_weights"),
                         (backward, "quantize_transposed")):
        def spy(weights, *args, _real=getattr(module, name), **kwargs):
            quantized.extend(w.dtype for w in weights)
            return _real(weights, *args, **kwargs)
        setattr(module, name, spy)
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.rand(num_tokens, experts, generator=g).topk(top_k, dim=1).indices
    w = torch.softmax(torch.randn(num_tokens, top_k, generator=g), dim=1)
    w1, w3 = (torch.randn(experts, inter, hidden, generator=g) / hidden**0.5 for _ in range(2))
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    dy = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    settings = _settings(precision=precision, save_gemm1=True, capacity_tokens_per_rank=160)
    errors = {}
    for weights in ("float32", "bf16 copies"):
        ws = (w1, w2, w3) if weights == "float32" else tuple(t.to(torch.bfloat16) for t in (w1, w2, w3))
        poison_fused_buffers()
        quantized.clear()
        y, counts, *kept = fused.moe_forward(x, idx, w, *ws, None, False, settings)
        grads = fused.moe_backward(dy, x, idx, w, *ws, *kept, None, False, settings)
        assert set(quantized) == {ws[0].dtype} and len(quantized) >= 5, (weights, quantized)  # forward 3, dgrad 2
        y_ref, _ = reference.moe_forward(x, idx, w, *ws, None, False, spec)
        grads_ref = reference.moe_backward(dy, x, idx, w, *ws, None, False, spec, True)
        assert y.dtype == torch.bfloat16 and [t.dtype for t in grads[2:]] == [ws[0].dtype] * 3
        for name, got, want in zip(("y",) + GRADIENTS, (y,) + grads, (y_ref,) + grads_ref):
            assert torch.isfinite(got).all(), (precision, weights, name)
            errors[weights, name] = reference.relative_error(got, want)
    for name in ("y",) + GRADIENTS:
        err, bf16_err = errors["float32", name], errors["bf16 copies", name]
        print(f"{precision} {name}: float32 weights {err:.1e}, bf16 copies {bf16_err:.1e}", flush=True)
        assert err < 4e-2 and err < 1.5 * bf16_err + 1e-3, (precision, name, err, bf16_err)

    bf16_weights = settings.replace(precision="fp8_bwd")  # its forward multiplies the weights in bf16
    with pytest.raises(NotImplementedError, match=r"float32 weights with bfloat16 tokens in precision 'fp8_bwd'"):
        ops.mega_moe(x, idx, w, w1, w2, w3, None, score_before_experts=False, settings=bf16_weights)
    y_auto, _ = ops.mega_moe(x, idx, w, w1, w2, w3, None, score_before_experts=False,
                             settings=bf16_weights.replace(backend="auto"))
    y_spec, _ = reference.moe_forward(x, idx, w, w1, w2, w3, None, False, get_precision("fp8_bwd"))
    assert torch.equal(y_auto, y_spec)
    with pytest.raises(ValueError, match=r"w1, w2 and w3 must share one dtype, x's \(torch.bfloat16\) or float32"):
        ops.mega_moe(x, idx, w, w1.half(), w2.half(), w3.half(), None, score_before_experts=False, settings=settings)


def test_float32_weights_with_bf16_tokens_quantize_from_float32(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_float32_weights_match_reference, 2, timeout_s=900)

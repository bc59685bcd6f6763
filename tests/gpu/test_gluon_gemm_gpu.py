"""The Gluon grouped GEMM core (``kernels.gluon.sm90``) on a Hopper GPU: every epilogue and
operand form against fp32 products of the same (dequantized) operands, on uneven
routings (experts without rows, with one row, with a tile and a row), outputs poisoned
(rows no expert owns must stay untouched), fewer programs than tiles (the stage ring's
phases wrap across tiles), and bit-for-bit repeatability."""

import pytest
import torch

from script_modules import load_script

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (the Gluon core is SM90's)",
)

ROW_TOLERANCE = 5e-2
"""Largest relative error of any one row (a global norm hides a bad row)."""

COUNTS = [0, 1, 127, 128, 129, 0, 300, 1024, 64, 2, 513, 0, 255, 77, 1, 700]
"""Rows per expert: none, one, a tile less one, a tile, a tile and one, ..."""


def _case(gemm_bench, gemm, precision, n, k):
    """A ``gemm_bench`` case of the given shape (its layer fields only label it)."""
    base = gemm_bench.gemm_case("30B-A3B", len(COUNTS), gemm, precision)
    return gemm_bench.GemmCase(base.gemm, "test", len(COUNTS), precision, n, k, base.two_b, base.b_k_major)


def _row_errors(out, ref, live):
    got, want = out[live].float(), ref[live]
    return (got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-6)


@pytest.mark.parametrize("gemm, precision, n, k, tiles, programs", [
    ("down", "bf16", 2048, 768, (256, 64, 4, 2), None),
    ("down", "bf16", 512, 384, (128, 64, 3, 1), 5),
    ("gate_up", "bf16", 768, 2048, (128, 64, 4, 2), None),
    ("gate_up", "bf16", 256, 512, (64, 64, 6, 2), 3),
    ("dy_w2", "bf16", 768, 2048, (256, 64, 4, 2), None),
    ("down", "fp8", 2048, 768, (128, 128, 5, 2), None),   # 6 K blocks: a chunk of 4 and one of 2
    ("down", "fp8", 512, 640, (128, 128, 4, 2), 3),        # 5 K blocks
    ("dgrad", "fp8", 256, 128, (128, 128, 3, 2), 2),       # 1 K block
    ("gate_up", "fp8", 1536, 2048, (128, 128, 5, 2), None),
])
def test_grouped_gemm_matches_fp32(gemm, precision, n, k, tiles, programs):
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import ExpertLayout, GemmTiles, grouped_gemm

    gemm_bench = load_script("gemm_bench")
    case = _case(gemm_bench, gemm, precision, n, k)
    block_n, block_k, stages, warpgroups = tiles
    gemm_tiles = GemmTiles(block_n, block_k, stages, mma_warpgroups=warpgroups)
    layout = ExpertLayout.from_counts(torch.tensor(COUNTS, device="cuda"), block_m=gemm_tiles.block_m, row_align=32)
    total = layout.rows + gemm_tiles.block_m
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    ops = gemm_bench.make_operands(case, total, torch.device("cuda"), generator)
    fp8 = precision == "fp8"

    def run():
        out = torch.full((total, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        grouped_gemm(ops.qa if fp8 else ops.a, ops.qb if fp8 else ops.b, out, layout,
                     gemm_tiles, b2=ops.b2,
                     a_scale=ops.a_scale, b_scale=ops.b_scale, b_k_major=case.b_k_major,
                     epilogue="swiglu" if case.two_b else "store", programs=programs)
        return out

    out = run()
    live = gemm_bench.live_rows(layout, total, out.device)
    assert not out[~live].isfinite().any(), "a row no expert owns was written"
    ref = gemm_bench.reference(case, ops, layout, quantized=fp8)
    error = gemm_bench.relative_error(out, ref, live)
    assert error <= gemm_bench.TOLERANCE[precision], error
    worst = _row_errors(out, ref, live).max().item()
    assert worst <= ROW_TOLERANCE, worst
    assert torch.equal(run().nan_to_num(), out.nan_to_num()), "two runs differ"


def test_grouped_gemm_refuses_what_it_cannot_run():
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import ExpertLayout, GemmTiles, grouped_gemm

    layout = ExpertLayout.from_counts(torch.tensor([3, 5], device="cuda"), block_m=128, row_align=32)
    a = torch.randn(layout.rows + 128, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(a.shape[0], 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        grouped_gemm(a, b.transpose(1, 2).contiguous().transpose(1, 2), out, layout, GemmTiles(256, 64, 3))
    with pytest.raises(ValueError, match="multiples of the tile"):
        grouped_gemm(a, b, out, layout, GemmTiles(256, 96, 3))
    with pytest.raises(ValueError, match="a tile is one block of the layout"):
        grouped_gemm(a, b, out, layout, GemmTiles(256, 64, 3, mma_warpgroups=1))


@pytest.mark.parametrize("precision, n, k, tiles", [
    ("bf16", 512, 384, (256, 64, 4, 2)),
    ("fp8", 512, 640, (128, 128, 5, 2)),
])
def test_grouped_gemm_combines_rows_to_their_origins(precision, n, k, tiles):
    """The combine epilogue (GEMM2's and dgrad's): each row goes to row ``origin %
    rows_per_rank`` of rank ``origin // rows_per_rank``'s copy of the output, here two copies
    of one allocation as two ranks' symmetric buffers would be, seen from rank 0."""
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import CombineRows, ExpertLayout, GemmTiles, grouped_gemm

    gemm_bench = load_script("gemm_bench")
    case = _case(gemm_bench, "down", precision, n, k)
    gemm_tiles = GemmTiles(*tiles[:3], mma_warpgroups=tiles[3])
    layout = ExpertLayout.from_counts(torch.tensor(COUNTS, device="cuda"), block_m=gemm_tiles.block_m, row_align=32)
    total = layout.rows + gemm_tiles.block_m
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    ops = gemm_bench.make_operands(case, total, torch.device("cuda"), generator)
    live = gemm_bench.live_rows(layout, total, torch.device("cuda"))
    rows_per_rank = int(live.sum())
    slots = torch.randperm(2 * rows_per_rank, generator=generator)[:rows_per_rank].to("cuda")
    origin = torch.full((total,), -1, dtype=torch.int32, device="cuda")  # rows no expert owns: never read
    origin[live] = slots.to(torch.int32)
    copies = torch.full((2 * rows_per_rank, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    mine = copies[:rows_per_rank]
    ptrs = torch.tensor([mine.data_ptr(), copies[rows_per_rank:].data_ptr()], device="cuda")
    fp8 = precision == "fp8"
    grouped_gemm(ops.qa if fp8 else ops.a, ops.qb if fp8 else ops.b, mine, layout, gemm_tiles,
                 a_scale=ops.a_scale, b_scale=ops.b_scale, combine=CombineRows(origin, ptrs, 0, rows_per_rank),
                 programs=7)
    ref = gemm_bench.reference(case, ops, layout, quantized=fp8)
    want = torch.full((2 * rows_per_rank, n), float("nan"), device="cuda")
    want[slots] = ref[live]
    written = ~want[:, 0].isnan()
    assert torch.equal(copies[:, 0].isnan(), ~written), "a slot no row came from was written, or one was missed"
    error = float((copies[written].float() - want[written]).norm() / want[written].norm())
    assert error <= gemm_bench.TOLERANCE[precision], error


def _token_operand(cols, block_start, counts, generator):
    """A token-major e4m3 operand ``[cols, tokens]`` and its scales ``[tokens / 128, cols]``
    (block-major) as the weight gradients' copies hold them: each expert's tokens from its
    first block, zeros past its rows; and the same in fp32, dequantized."""
    tokens = int(block_start[-1]) * 128
    values = torch.randn(cols, tokens, generator=generator) * 4
    for e, count in enumerate(counts):
        values[:, int(block_start[e]) * 128 + count:int(block_start[e + 1]) * 128] = 0
    q = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(tokens // 128, cols, generator=generator) + 0.5
    dequantized = q.float() * scales.t().repeat_interleave(128, dim=1)
    return q.cuda(), scales.cuda(), dequantized.cuda()


@pytest.mark.parametrize("impl", ["gluon", "tl"])
@pytest.mark.parametrize("m, n, split, counts, programs, out_dtype", [
    (256, 384, True, [0, 1, 127, 128, 129, 300, 0, 1024], None, torch.bfloat16),
    (1536, 2048, True, [900, 1100, 0, 1300, 64, 1024, 1, 2000], None, torch.bfloat16),
    (2048, 768, False, [513, 0, 255, 77, 1, 700, 128, 4096], 7, torch.bfloat16),
    (512, 256, True, [300, 0, 129, 1000], 3, torch.float32),
])
def test_token_grouped_gemm_matches_fp32(m, n, split, counts, programs, out_dtype, impl):
    """The weight gradients' GEMM, grouped along the tokens, in each implementation the tile
    table can name (``wgrad_kernel``): each expert's output is the fp32 product of its own
    token blocks of the dequantized operands; an expert without tokens gets zeros; outputs
    (bf16, or fp32 as float32 experts take them) poisoned first; two runs bit for bit;
    fewer programs than tiles (Gluon)."""
    import dataclasses
    from types import SimpleNamespace

    from titan_megamoe.kernels import backward
    from titan_megamoe.kernels.configs import tile_config
    from titan_megamoe.kernels.gluon.sm90.token_grouped_gemm import token_grouped_gemm
    from titan_megamoe.precision import FP8_BLOCK

    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    blocks = torch.tensor([-(-c // 128) for c in counts])
    block_start = torch.cat([torch.zeros(1, dtype=torch.int64), blocks.cumsum(0)]).to(torch.int32)
    a, a_scale, a_fp32 = _token_operand(m, block_start, counts, generator)
    b, b_scale, b_fp32 = _token_operand(n, block_start, counts, generator)
    experts = len(counts)

    def run():
        shape = (experts, m // 2, n) if split else (experts, m, n)
        outs = tuple(torch.full(shape, float("nan"), device="cuda", dtype=out_dtype)
                     for _ in range(2 if split else 1))
        if impl == "gluon":
            token_grouped_gemm(a, a_scale, b, b_scale, block_start.cuda(), outs, programs=programs)
        else:  # the tl kernel reads the scales column-major, with the tiles it ran before v43
            tiles = dataclasses.replace(tile_config("sm90", FP8_BLOCK.name), **load_script("gemm_bench").TL_WGRAD_TILES)
            layout = SimpleNamespace(shape=SimpleNamespace(local_experts=experts))
            backward._quantized_wgrad(layout, tiles, FP8_BLOCK, block_start.cuda(), (a, a_scale.t().contiguous()),
                                      (b, b_scale.t().contiguous()), outs)
        return torch.cat(outs, dim=1)

    out = run()
    for e in range(experts):
        tokens = slice(int(block_start[e]) * 128, int(block_start[e + 1]) * 128)
        ref = a_fp32[:, tokens] @ b_fp32[:, tokens].T
        if counts[e] == 0:
            assert torch.equal(out[e], torch.zeros_like(out[e])), f"expert {e} has no tokens and was not zeroed"
            continue
        error = float((out[e].float() - ref).norm() / ref.norm())
        # An fp32 output keeps what the fp8 MMAs accumulate (1.2e-4 measured); one rounded
        # to bf16 (2^-9 a value) would be about 1e-3 off.
        assert error <= (1e-2 if out_dtype == torch.bfloat16 else 5e-4), (e, error)
    assert torch.equal(run(), out), "two runs differ"


def _arrived(counts: torch.Tensor, epoch: int = 3):
    """The arrival words of one rank whose every chunk (128 rows of an expert) arrived in
    the call of ``epoch``: ``counts[e]`` rows of local expert ``e``, all from itself."""
    from titan_megamoe.kernels.gluon.sm90.arrivals import ChunkFlags
    from titan_megamoe.kernels.sync import EPOCH, STATE_WORDS

    state = torch.zeros(STATE_WORDS, dtype=torch.int64, device="cuda")
    state[EPOCH.value] = epoch
    max_chunks, chunk_ready = int(-(-counts.max() // 128)), 8
    flags = torch.full((chunk_ready + counts.numel() * max_chunks,), epoch, dtype=torch.int64, device="cuda")
    flags[:chunk_ready] = 0  # the words before CHUNK_READY: ABORT[rank] among them, none raised
    return ChunkFlags(flags, torch.zeros(1, dtype=torch.int64, device="cuda"), state,
                      torch.zeros(counts.numel(), dtype=torch.int32, device="cuda"), counts.to(torch.int32), rank=0,
                      ep=1, chunk_ready=chunk_ready, max_chunks=max_chunks)


@pytest.mark.parametrize("precision, w2_as_stored, score_before, saved_part, programs", [
    ("bf16", True, False, 1.0, None),   # the bf16 row's form: W2 as stored, an N-major B
    ("bf16", False, True, 1.0, None),
    ("fp8", False, False, 1.0, None),
    ("fp8", False, True, 1.0, 7),
    ("bf16", True, False, 0.5, 5),      # GEMM1 saved for some rows only: the tiles past them are the tl kernel's
    ("fp8", False, False, 0.5, None),
])
def test_swiglu_grad_gemm_matches_fp32(precision, w2_as_stored, score_before, saved_part, programs):
    """The backward's first GEMM on the core against fp32 of the same operands: ``[da | db]``
    (and its e4m3 copy), ``h_wgrad`` and the score-gradient parts of every saved row, zeros
    in each expert's padding rows, nothing written past them or past the saved rows' tiles;
    one source whose chunks have all arrived (``ChunkFlags``); twice bit for bit."""
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import ExpertLayout, GemmTiles
    from titan_megamoe.kernels.gluon.sm90.swiglu_grad_gemm import SwigluGradTensors, swiglu_grad_gemm
    from titan_megamoe.kernels.quantize import quantize_rows, quantize_weights
    from titan_megamoe.precision import get_precision
    from titan_megamoe.reference import dequantize_blocks

    hidden, inter, saved_m, align = 512, 384, 64, 32
    counts = torch.tensor(COUNTS, device="cuda")
    experts = len(COUNTS)
    layout = ExpertLayout.from_counts(counts, block_m=128, row_align=align)
    rows = layout.rows + 128
    generator = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    dy = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    w2t = (torch.randn(experts, inter, hidden, device="cuda", generator=generator) / hidden**0.5).bfloat16()
    preact = (2 * torch.randn(rows, 2 * inter, device="cuda", generator=generator)).bfloat16()
    score = torch.rand(rows, device="cuda", generator=generator)
    fp8 = precision == "fp8"
    fmt = get_precision("fp8").dgrad
    if fp8:
        dy_q, dy_scale = quantize_rows(dy, 128, fmt.power_of_two)
        ((w2t_q, w2t_scale),) = quantize_weights([w2t], fmt)
        dy_ref = dequantize_blocks(dy_q, dy_scale, (1, 128))
        w2t_ref = dequantize_blocks(w2t_q, w2t_scale, (128, 128))
    else:
        dy_q, dy_scale, w2t_q, w2t_scale = dy, None, w2t, None
        dy_ref, w2t_ref = dy.float(), w2t.float()
    w2_operand = w2t_q.transpose(1, 2).contiguous() if w2_as_stored else w2t_q
    base, local_rows = layout.local_base.long(), counts.long()
    # Saved rows: every row, or into the 1,024-row expert's: 64 rows of it (one tl tile)
    # and 10 more, so its first block is half the core's and half the tl kernel's.
    deep = COUNTS.index(1024)
    saved_rows = rows if saved_part == 1.0 else int(base[deep]) + saved_m + 10
    chunks = _arrived(counts)

    def run():
        nan = float("nan")
        outs = SwigluGradTensors(
            preact[:saved_rows], score, torch.full((rows, 2 * inter), nan, device="cuda", dtype=torch.bfloat16),
            torch.full((rows, inter), nan, device="cuda", dtype=torch.bfloat16),
            torch.full((rows, inter // 128), nan, device="cuda"),
            torch.full((rows, 2 * inter), nan, device="cuda").to(torch.float8_e4m3fn) if fp8 else None,
            torch.full((rows, 2 * inter // 128), nan, device="cuda") if fp8 else None)
        swiglu_grad_gemm(dy_q, w2_operand, layout, chunks, outs, GemmTiles(128, 128 if fp8 else 64, 4),
                         saved_m=saved_m, score_before_experts=score_before, row_align=align, dy_scale=dy_scale,
                         w2t_scale=w2t_scale, b_k_major=not w2_as_stored, power_of_two=fmt.power_of_two,
                         programs=programs)
        return outs

    outs = run()
    # The rows each tile stores: its expert's and their padding, in the tiles below the saved rows' end.
    row = torch.arange(rows, device="cuda")
    expert = torch.searchsorted(base, row, right=True) - 1
    within = row - base[expert]
    live = within < local_rows[expert]
    owned = within < (local_rows[expert] + align - 1) // align * align
    virtual = layout.block_base.long()[expert] + within
    saved_end = layout.block_base.long() + torch.where(base + local_rows <= saved_rows, 2**40,
                                                        (saved_rows - base).clamp_min(0) // saved_m * saved_m)
    stored_by_core = owned & (virtual < saved_end[expert])
    d = torch.zeros(rows, inter, device="cuda")
    for e in range(experts):
        mine = expert == e
        d[mine] = dy_ref[mine] @ w2t_ref[e].T
    g, u = preact.float().split(inter, dim=1)
    sig = torch.sigmoid(g)
    h = g * sig * u
    s = torch.ones_like(score) if score_before else score
    da = torch.where(live[:, None], d * s[:, None] * u * sig * (1 + g * (1 - sig)), 0.0)
    db = torch.where(live[:, None], d * s[:, None] * g * sig, 0.0)
    h_wgrad = torch.where(live[:, None], h * s[:, None], 0.0)
    parts = (h * d).view(rows, inter // 128, 128).sum(-1)

    def check(name, got, want, rows_checked):
        got, want = got[rows_checked].float(), want[rows_checked]
        assert got.isfinite().all(), f"{name}: a stored row is not finite"
        error = ((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-3)).max().item()
        assert error <= ROW_TOLERANCE, (name, error)

    check_rows = stored_by_core & live
    assert stored_by_core.any() and (~stored_by_core & owned).any() == (saved_part < 1.0)
    check("[da | db]", outs.dab, torch.cat([da, db], dim=1), check_rows)
    check("h_wgrad", outs.h_wgrad, h_wgrad, check_rows)
    check("score parts", outs.score_parts, parts, check_rows)
    padding = stored_by_core & ~live
    assert (outs.dab[padding] == 0).all() and (outs.h_wgrad[padding] == 0).all(), "padding rows not zeroed"
    assert not outs.dab[~stored_by_core].isfinite().any(), "a row the core does not own was written"
    assert not outs.h_wgrad[~stored_by_core].isfinite().any(), "a row the core does not own was written"
    if fp8:
        dequantized = dequantize_blocks(outs.dab_q[stored_by_core], outs.dab_scales[stored_by_core], (1, 128))
        check("[da | db] e4m3", dequantized, outs.dab[stored_by_core].float(), live[stored_by_core])
    again = run()
    assert torch.equal(again.dab.nan_to_num(), outs.dab.nan_to_num()), "two runs differ"
    assert torch.equal(again.score_parts.nan_to_num(), outs.score_parts.nan_to_num()), "two runs differ"


@pytest.mark.parametrize("precision, saved_part, programs", [
    ("bf16", 1.0, None),
    ("fp8", 1.0, None),
    ("fp8", 0.5, 7),
    ("bf16", 0.0, 5),   # nothing saved
])
def test_gate_up_gemm_matches_fp32(precision, saved_part, programs):
    """GEMM1 on the core against fp32 of the same operands: ``h`` of every received row
    (fp8: dequantized from its e4m3 and scales), the pre-activations of the saved rows,
    nothing written past each expert's rows or past the saved ones; one source whose
    chunks have all arrived; twice bit for bit."""
    from titan_megamoe.kernels.gluon.sm90.gate_up_gemm import GateUpTensors, gate_up_gemm
    from titan_megamoe.kernels.gluon.sm90.grouped_gemm import ExpertLayout, GemmTiles
    from titan_megamoe.kernels.quantize import quantize_rows, quantize_weights
    from titan_megamoe.precision import get_precision
    from titan_megamoe.reference import dequantize_blocks

    hidden, inter, align = 512, 384, 32
    counts = torch.tensor(COUNTS, device="cuda")
    experts = len(COUNTS)
    layout = ExpertLayout.from_counts(counts, block_m=128, row_align=align)
    rows = layout.rows + 128
    generator = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    x = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    w1, w3 = ((torch.randn(experts, inter, hidden, device="cuda", generator=generator) / hidden**0.5).bfloat16()
              for _ in range(2))
    fp8 = precision == "fp8"
    fmt = get_precision("fp8").forward
    if fp8:
        x_q, x_scale = quantize_rows(x, 128, fmt.power_of_two)
        (w1_q, w1_scale), (w3_q, w3_scale) = quantize_weights([w1, w3], fmt)
        x_ref = dequantize_blocks(x_q, x_scale, (1, 128))
        w1_ref, w3_ref = dequantize_blocks(w1_q, w1_scale, (128, 128)), dequantize_blocks(w3_q, w3_scale, (128, 128))
    else:
        x_q, x_scale, w1_q, w1_scale, w3_q, w3_scale = x, None, w1, None, w3, None
        x_ref, w1_ref, w3_ref = x.float(), w1.float(), w3.float()
    base = layout.local_base.long()
    saved_rows = rows if saved_part == 1.0 else int(saved_part * rows) // 64 * 64 + 10  # mid-tile
    chunks = _arrived(counts)

    def run():
        nan = float("nan")
        outs = GateUpTensors(
            torch.full((rows, inter), nan, device="cuda").to(torch.float8_e4m3fn if fp8 else torch.bfloat16),
            torch.full((rows, inter // 128), nan, device="cuda") if fp8 else None,
            torch.full((saved_rows, 2 * inter), nan, device="cuda", dtype=torch.bfloat16) if saved_part else None)
        gate_up_gemm(x_q, w1_q, w3_q, layout, chunks, outs, GemmTiles(128, 128 if fp8 else 64, 3 if fp8 else 4),
                     act_dtype=torch.bfloat16, x_scale=x_scale, w1_scale=w1_scale, w3_scale=w3_scale,
                     power_of_two=fmt.power_of_two, programs=programs)
        return outs

    outs = run()
    row = torch.arange(rows, device="cuda")
    expert = torch.searchsorted(base, row, right=True) - 1
    live = row - base[expert] < counts.long()[expert]
    g = torch.zeros(rows, inter, device="cuda")
    u = torch.zeros(rows, inter, device="cuda")
    for e in range(experts):
        mine = expert == e
        g[mine], u[mine] = x_ref[mine] @ w1_ref[e].T, x_ref[mine] @ w3_ref[e].T
    h_ref = g * torch.sigmoid(g) * u
    h = dequantize_blocks(outs.h, outs.h_scales, (1, 128)) if fp8 else outs.h.float()
    assert h[live].isfinite().all(), "a received row's h is not finite"
    error = ((h[live] - h_ref[live]).norm(dim=1) / h_ref[live].norm(dim=1).clamp_min(1e-3)).max().item()
    assert error <= ROW_TOLERANCE, error
    assert not h[~live].isfinite().any(), "a row no expert owns was written"
    if saved_part:
        saved = live[:saved_rows]
        pre = outs.preact.float()
        want = torch.cat([g, u], dim=1)[:saved_rows]
        error = ((pre[saved] - want[saved]).norm(dim=1) / want[saved].norm(dim=1).clamp_min(1e-3)).max().item()
        assert error <= ROW_TOLERANCE, ("preact", error)
        assert not pre[~saved].isfinite().any(), "a row no expert owns was saved"
    again = run()
    assert torch.equal(again.h.float().nan_to_num(), outs.h.float().nan_to_num()), "two runs differ"

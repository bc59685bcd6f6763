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
@pytest.mark.parametrize("m, n, split, counts, programs", [
    (256, 384, True, [0, 1, 127, 128, 129, 300, 0, 1024], None),
    (1536, 2048, True, [900, 1100, 0, 1300, 64, 1024, 1, 2000], None),
    (2048, 768, False, [513, 0, 255, 77, 1, 700, 128, 4096], 7),
])
def test_token_grouped_gemm_matches_fp32(m, n, split, counts, programs, impl):
    """The weight gradients' GEMM, grouped along the tokens, in each implementation the tile
    table can name (``wgrad_kernel``): each expert's output is the fp32 product of its own
    token blocks of the dequantized operands; an expert without tokens gets zeros; outputs
    poisoned first; two runs bit for bit; fewer programs than tiles (Gluon)."""
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
        outs = tuple(torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
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
        assert error <= 1e-2, (e, error)  # fp32 accumulation, bf16 output
    assert torch.equal(run(), out), "two runs differ"

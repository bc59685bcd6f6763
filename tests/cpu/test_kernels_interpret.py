"""The kernels' shared helpers under the Triton interpreter, at tiny shapes: the tile-GEMM
mainloop (blockwise fp8 and mxfp8 operands with their scales, unscaled fp32 and bf16, one
and two B operands, K and N tails), the block scales (every significand of a few binades),
the row and weight quantizers (bit for bit) and the received rows' dequantization, against
the reference's ``quantize_blocks`` / ``dequantize_blocks``; and the tile table's lookups.

The interpreter must be switched on before Triton kernels are defined, so each kernel
check runs in a fresh process (``run_ranks``) started with ``TRITON_INTERPRET=1``.
"""

import dataclasses

import pytest

from ranks import run_ranks

# fp32 accumulation over K <= 256 against float64: a few 1e-8.
TOLERANCES = {"fp8_block": 1e-6, "mxfp8": 1e-6, "float32": 1e-6, "bfloat16": 1e-6}


def _mainloop(rank, world, m, n, k, block_n, block_ks):
    from kernel_checks import check_mainloop

    check_mainloop("cpu", m, n, k, 16, block_n, block_ks, TOLERANCES, seed=m * n + k)


@pytest.mark.parametrize(
    "m, n, k, block_n, block_ks",
    [
        (16, 32, 256, 32, (16, 32, 64)),  # whole tiles and scale blocks
        (13, 150, 200, 32, (16, 32)),  # K and N tails: partial last K step, scale block and N tile
        (16, 300, 256, 256, (32,)),  # a tile across two weight scale blocks (per-column B scales)
    ],
)
def test_mainloop_matches_reference(m, n, k, block_n, block_ks, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_mainloop, 1, m, n, k, block_n, block_ks, timeout_s=300)


def _quantize(rank, world):
    from kernel_checks import check_quantize

    check_quantize("cpu", rows=37, cols=200, seed=0)  # 200: partial last block of 128 and of 32
    check_quantize("cpu", rows=11, cols=512, seed=1)


def test_quantize_rows_bit_exact(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_quantize, 1, timeout_s=300)


def _block_scales(rank, world):
    from kernel_checks import check_block_scales

    # Subnormal maxima, the two binades below AMAX_FLOOR (the RCEIL tie at 1.75 * 2^-119
    # among them), the floor's, 1 .. 2 and the largest binade.
    check_block_scales("cpu", exponent_fields=[0, 8, 9, 10, 127, 254])


def test_block_scales_for_every_significand(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_block_scales, 1, timeout_s=600)


def _quantize_weights(rank, world):
    from kernel_checks import check_quantize_weights

    check_quantize_weights("cpu", seed=2)


def test_quantize_weights_bit_exact(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_quantize_weights, 1, timeout_s=300)


def _dequantized_rows(rank, world):
    from kernel_checks import check_dequantized_rows

    check_dequantized_rows("cpu", seed=3)


def test_dequantized_rows(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_dequantized_rows, 1, timeout_s=300)


def test_tile_table_lookups(monkeypatch):
    from titan_megamoe.kernels import configs

    monkeypatch.setattr(configs, "INTERPRET", True)
    assert configs.arch_of(None) == configs.arch_of((9, 0)) == "interpret"
    assert configs.tile_config("interpret", "native") is configs.TILE_CONFIGS["interpret", "native"]
    monkeypatch.setattr(configs, "INTERPRET", False)
    assert configs.arch_of((9, 0)) == "sm90"
    assert configs.arch_of((10, 0)) == "sm100"
    assert configs.arch_of((12, 0)) is None
    assert configs.arch_of(None) is None
    assert configs.tile_config("sm90", "native").block_m == 128
    with pytest.raises(ValueError, match=r"architecture 'sm100' and format 'fp8_block'; rows: \(sm90, native\)"):
        configs.tile_config("sm100", "fp8_block")


def test_tile_rows_meet_the_kernels_constraints():
    """What the kernels assert at compile time, checked for every row of the table: a
    GPU row that breaks one fails only when its kernels first compile there."""
    from titan_megamoe.kernels import configs
    from titan_megamoe.precision import FORMATS

    for row, tiles in configs.TILE_CONFIGS.items():
        arch, fmt_name = row
        for field in ("gemm1_m", "grad1_m", "gemm2_m", "dgrad_m"):
            assert tiles.block_m % getattr(tiles, field) == 0, (row, field)
        # Precisions whose passes use two rows of one architecture read one receive layout.
        assert all((tiles.block_m, tiles.row_align) == (other.block_m, other.row_align)
                   for (a, _), other in configs.TILE_CONFIGS.items() if a == arch), row
        fmt = FORMATS[fmt_name]
        # Weights handed over dequantized feed a scaled MMA's bf16 B operand only; only MX
        # values are exact in bf16.
        assert not tiles.mx_dequantized_weights or fmt.scaled_mma, row
        assert not tiles.mx_in_bf16 or fmt.scaled_mma, row
        # Weights read as stored: unscaled operands.
        assert not (tiles.w2_as_stored or tiles.w13_as_stored_rows) or not fmt.quantized, row
        # Rows rounded along the tokens in the receive layout: a token block per program.
        assert not tiles.mx_wgrad_dequantized or (
            fmt.scaled_mma and tiles.row_align % fmt.activation_block[1] == 0), row
        if not fmt.quantized:
            continue
        scale_k = fmt.activation_block[1]
        # Epilogues store h and [da | db] in whole scale blocks; MX weights in bf16 are
        # rounded as they are transposed, whole blocks per tile.
        for field in ("gemm1_n", "grad1_n", "grad1_saved_n", "copy_cols"):
            assert getattr(tiles, field) % scale_k == 0, (row, field)
        # ... and the backward's first kernel stores them per epilogue part.
        assert tiles.grad1_saved_n // tiles.grad1_saved_parts % scale_k == 0, (row, "grad1_saved_parts")
        if fmt.scaled_mma:
            assert tiles.transpose_block % scale_k == 0, (row, "transpose_block")
        # A promoting mainloop's step stays inside one scale block (the weight gradients'
        # inside one token block); a scaled MMA's covers whole ones.
        for field in ("gemm1_k", "gemm2_k", "grad1_k", "dgrad_k", "wgrad_k"):
            step = getattr(tiles, field)
            assert (step % scale_k if fmt.scaled_mma else scale_k % step) == 0, (row, field)


def test_mx_operands_held_in_bf16():
    """A row with ``mx_in_bf16`` hands the kernels MX operands as unscaled bf16 values
    rounded in the format's blocks, other formats unchanged; it refuses the e4m3 forms
    beside it, and only power-of-two formats have a bf16 form."""
    from titan_megamoe.kernels import configs
    from titan_megamoe.precision import FP8_BLOCK, MXFP8, NATIVE

    tiles = dataclasses.replace(configs.TILE_CONFIGS["interpret", "mxfp8"], mx_in_bf16=1)
    held = tiles.operand_format(MXFP8)
    assert (held.element, held.quantized, held.row_scale_k, held.round_k, held.scaled_mma) == (
        "bf16", True, 0, 32, False)
    assert held.weight_block == MXFP8.weight_block and held.power_of_two
    assert tiles.operand_format(FP8_BLOCK) is FP8_BLOCK and tiles.operand_format(NATIVE) is NATIVE
    assert configs.TILE_CONFIGS["interpret", "mxfp8"].operand_format(MXFP8) is MXFP8
    with pytest.raises(ValueError, match="mx_upcast and mx_dequantized_weights"):
        dataclasses.replace(tiles, mx_upcast=1)
    with pytest.raises(ValueError, match="'fp8_block' has no exact bf16 form"):
        FP8_BLOCK.in_bf16()


def _gemm_bench_weight_gradients(rank, world):
    import torch
    from kernel_checks import blockwise_scaled_mm_stand_in
    from script_modules import load_script

    gemm_bench = load_script("gemm_bench")
    gemm_bench.scaled_mm = blockwise_scaled_mm_stand_in  # torch's runs on GPUs only
    case = gemm_bench.GemmCase("wgrad_w13", "test", 3, "fp8", 128, 0, False, True, m=256)
    assert case.flops(205) == 2 * 205 * 256 * 128
    ops = gemm_bench.make_token_operands(case, torch.tensor([5, 0, 200]), torch.device("cpu"),
                                         torch.Generator().manual_seed(0))
    want = gemm_bench.wgrad_reference(ops)
    for impl in ("tl", "torch"):
        outs = tuple(torch.full((3, 128, 128), float("nan"), dtype=torch.bfloat16) for _ in range(2))
        gemm_bench.wgrad_impl(impl, case, ops, outs)()
        got = torch.cat(outs, dim=1).float()
        assert torch.equal(got[1], torch.zeros_like(got[1])), (impl, "an expert without rows")
        for e in (0, 2):
            error = float((got[e] - want[e]).norm() / want[e].norm())
            assert error < 1e-2, (impl, e, error)


def test_gemm_bench_weight_gradients_match_its_reference(monkeypatch):
    """``scripts/gemm_bench.py``'s weight-gradient case (its token-major operands, its fp32
    reference) against two of its implementations: the ``tl`` kernel and torch's
    blockwise-scaled matmul (a CPU stand-in); the Gluon one runs on a GPU only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_gemm_bench_weight_gradients, 1, timeout_s=600)

"""The kernels' shared helpers under the Triton interpreter, at tiny shapes: the tile-GEMM
mainloop (blockwise fp8 and mxfp8 operands with their scales, unscaled fp32 and bf16, one
and two B operands, K and N tails) and the row quantizer (bit for bit), against the
reference's ``quantize_blocks`` / ``dequantize_blocks``; and the tile table's lookups.

The interpreter must be switched on before Triton kernels are defined, so each kernel
check runs in a fresh process (``run_ranks``) started with ``TRITON_INTERPRET=1``.
"""

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


def _quantize_weights(rank, world):
    from kernel_checks import check_quantize_weights

    check_quantize_weights("cpu", seed=2)


def test_quantize_weights_bit_exact(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_ranks(_quantize_weights, 1, timeout_s=300)


def test_tile_table_lookups(monkeypatch):
    from titan_megamoe.kernels import configs

    monkeypatch.setattr(configs, "INTERPRET", True)
    assert configs.arch_of(None) == configs.arch_of((9, 0)) == "interpret"
    assert configs.tile_config("interpret", "native") is configs.TILE_CONFIGS["interpret", "native"]
    monkeypatch.setattr(configs, "INTERPRET", False)
    assert configs.arch_of((9, 0)) == "sm90"
    assert configs.arch_of((10, 0)) is None
    assert configs.arch_of(None) is None
    assert configs.tile_config("sm90", "native").block_m == 128
    with pytest.raises(ValueError, match=r"architecture 'sm100' and format 'mxfp8'; rows: \(sm90, native\)"):
        configs.tile_config("sm100", "mxfp8")

"""The kernels' shared helpers on a GPU at real sizes (a Qwen3-30B-A3B gate/up GEMM shape and
one with K and N tails), fresh random inputs, poisoned outputs: the tile-GEMM mainloop
(blockwise fp8 and mxfp8 with their scales, bf16, one and two B operands), the block
scales, the row and the weight quantizers and the weight gradients' row copies (bit for
bit), against the reference's ``quantize_blocks`` / ``dequantize_blocks``."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOLERANCES = {"fp8_block": 5e-4, "mxfp8": 5e-4, "bfloat16": 1e-5}
"""Relative error against float64 products of the same (dequantized) operands. bf16: what
fp32 accumulation over K = 2048 leaves, with a margin. fp8: Hopper's fp8 MMA adds with
fewer accumulator bits than fp32 (why each scale block is promoted on its own); measured
1.3e-4 on H200."""


@pytest.mark.parametrize("m, n, k", [(512, 1536, 2048), (300, 1000, 1000)])
def test_mainloop_matches_reference(m, n, k):
    from kernel_checks import check_mainloop

    check_mainloop(
        "cuda", m, n, k, 128, 128, (32, 64, 128), TOLERANCES,
        seed=torch.seed() % 2**31, num_warps=8, num_stages=2,
    )


@pytest.mark.parametrize("rows, cols", [(4099, 2048), (1000, 2088)])
def test_quantize_rows_bit_exact(rows, cols):
    from kernel_checks import check_quantize

    check_quantize("cuda", rows, cols, seed=torch.seed() % 2**31)


def test_block_scales_for_every_significand():
    """Block scales and multipliers for every significand in binades across the range, on
    the GPU, whose fp32 division (the seed of ``448 / amax``) is approximate."""
    from kernel_checks import check_block_scales

    check_block_scales("cuda", exponent_fields=[0, 1, 8, 9, 10, 11, 64, 126, 127, 128, 190, 253, 254])


def test_quantize_weights_bit_exact():
    from kernel_checks import check_quantize_weights

    check_quantize_weights("cuda", seed=torch.seed() % 2**31)


def test_dequantized_rows_bit_exact():
    from kernel_checks import check_dequantized_rows

    check_dequantized_rows("cuda", seed=torch.seed() % 2**31)

"""The kernels' shared helpers on a GPU at real sizes (a Qwen3-30B-A3B gate/up GEMM shape and
one with K and N tails), fresh random inputs, poisoned outputs: the tile-GEMM mainloop
(blockwise fp8 and mxfp8 with their scales, bf16, one and two B operands), the block
scales, the row and the weight quantizers and the weight gradients' row copies (bit for
bit), against the reference's ``quantize_blocks`` / ``dequantize_blocks``; the weight
gradients' GEMM over an operand past int32 offsets."""

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


def test_weight_gradients_over_an_operand_past_int32_offsets():
    """The weight-gradient GEMM over a token-major operand of more than 2^31 elements (N
    columns of every token a routing can bring: 235B-A22B at EP 8 holds 4,096 x 1.05 M), an
    expert's tokens at its far end, where an int32 offset would wrap outside the operand;
    the expert between them all zeros. Against float64 products of the dequantized
    operands."""
    import triton

    from titan_megamoe.kernels.configs import tile_config
    from titan_megamoe.kernels.launch import launch
    from titan_megamoe.kernels.wgrad import wgrad_kernel
    from titan_megamoe.reference import relative_error

    tiles = tile_config("sm90", "fp8_block")
    m, n, block = 128, 4096, 128
    kt = (2**31 // n // block + 16) * block
    blocks = kt // block
    assert n * kt > 2**31
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    first, last = slice(0, block), slice(kt - block, kt)
    a = torch.zeros(m, kt, dtype=torch.float8_e4m3fn, device="cuda")
    b = torch.zeros(n, kt, dtype=torch.float8_e4m3fn, device="cuda")
    for t in (a, b):
        for tokens in (first, last):
            t[:, tokens] = torch.randn(t.shape[0], block, generator=g, device="cuda").to(torch.float8_e4m3fn)
    a_scales = torch.rand(m, blocks, generator=g, device="cuda") + 0.5
    b_scales = torch.rand(n, blocks, generator=g, device="cuda") + 0.5
    # Expert 0: the first token block; expert 1: every block between; expert 2: the last.
    block_start = torch.tensor([0, 1, blocks - 1, blocks], dtype=torch.int32, device="cuda")
    out = torch.full((3, m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch(wgrad_kernel, (triton.cdiv(n, tiles.wgrad_n), triton.cdiv(m, tiles.wgrad_m), 3),
           a, a_scales, b, b_scales, out, out, block_start,
           M=m, N=n, SPLIT_M=0, KT=kt, TOKEN_BLOCK=block, BLOCK_M=tiles.wgrad_m, BLOCK_N=tiles.wgrad_n,
           BLOCK_K=tiles.wgrad_k, MX_DOT=0, UPCAST_DOT=False, num_warps=tiles.wgrad_warps,
           num_stages=tiles.wgrad_stages)
    for expert, tokens in ((0, first), (2, last)):
        kb = tokens.start // block
        a_e = a[:, tokens].double() * a_scales[:, kb, None].double()
        b_e = b[:, tokens].double() * b_scales[:, kb, None].double()
        err = relative_error(out[expert].double(), a_e @ b_e.T)
        assert err < 1e-2, (expert, err)
    assert torch.equal(out[1], torch.zeros_like(out[1]))

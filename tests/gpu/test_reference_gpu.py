"""The reference backend on GPUs with NCCL: 1 and 2 ranks, bf16 and fp32, against the
float64 formula (the CPU suite checks the same on gloo)."""

import pytest
import torch

from problems import check_ep_rank
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16_TOLERANCE = 1e-2
FP32_TOLERANCE = 1e-5


def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, BF16_TOLERANCE), (torch.float32, FP32_TOLERANCE)])
@pytest.mark.parametrize("score_before", [False, True])
def test_one_gpu(dtype, tolerance, score_before):
    run_ranks(check_ep_rank, 1, "skewed", score_before, "bf16", tolerance, "cuda", dtype,
              backend="nccl", timeout_s=300)


@pytest.mark.parametrize("routing", ["random", "skewed", "first_rank_only"])
@pytest.mark.parametrize("score_before", [False, True])
def test_two_gpus_bf16(routing, score_before):
    _two_gpus()
    run_ranks(check_ep_rank, 2, routing, score_before, "bf16", BF16_TOLERANCE, "cuda", torch.bfloat16,
              backend="nccl", timeout_s=300)


def test_two_gpus_fp32():
    _two_gpus()
    run_ranks(check_ep_rank, 2, "random", False, "bf16", FP32_TOLERANCE, "cuda", torch.float32,
              backend="nccl", timeout_s=300)

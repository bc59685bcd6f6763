#!/usr/bin/env bash
# The layer A/B (scripts/bench_layer.py) on every GPU of this machine, or on two gloo
# ranks on the CPU when there is no GPU. Arguments go to bench_layer.py; by default it runs
# 30B-A3B and 235B-A22B at 4,096 and 16,384 tokens/rank, stock eager, stock compiled and
# mega_moe, forward + backward, 20 iterations. The fused forward alone, e.g.:
#   ./scripts/bench_layer.sh --backend fused --forward-only
# On the CPU use small rows: --shapes debug --tokens 64 --backend reference
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NPROC=$(python -c 'import torch; print(torch.cuda.device_count() or 2)')
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --nproc_per_node="$NPROC" --rdzv_backend c10d --rdzv_endpoint=localhost:0 \
    scripts/bench_layer.py "$@"

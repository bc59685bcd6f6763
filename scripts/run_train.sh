#!/usr/bin/env bash
# Launch TorchTitan 0.2.2 training the way TorchTitan's own run_train.sh does
# (scripts/run_train_torchtitan03.sh launches TorchTitan 0.3.0's config functions).
#
#   CONFIG_FILE=train_configs/debug_moe_mega_moe.toml NGPU=2 ./scripts/run_train.sh [--section.key value ...]
#
# CONFIG_FILE  TOML to train with; a path relative to the current directory or to the repo root
#              (default: train_configs/debug_moe_mega_moe.toml)
# NGPU         processes (GPUs) on this node (default: 8)
# LOG_RANK     comma-separated local ranks whose output is shown (default: 0)
# Extra arguments override TOML fields, e.g. --training.steps 10 --model.converters=mega_moe
#
# Training needs NGPU NVIDIA GPUs visible to torch: with fewer it stops at once, saying so.
# "run_train.sh --check-gpus" does that check alone (ab_train.sh, before its first run).
set -euo pipefail

# Resolve the TOML before leaving the caller's directory.
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_moe_mega_moe.toml}
if [[ -f "$CONFIG_FILE" ]]; then
    CONFIG_FILE=$(realpath "$CONFIG_FILE")
fi
NGPU=${NGPU:-8}
LOG_RANK=${LOG_RANK:-0}

if ! [[ $NGPU =~ ^[1-9][0-9]*$ ]]; then
    echo "run_train: NGPU=$NGPU is not valid; expected a number of GPUs (an integer > 0)" >&2
    exit 1
fi
# TorchTitan trains on CUDA only; without this check torchrun's ranks die in a CUDA traceback.
read -r VISIBLE TORCH_VERSION < <(python -c 'import torch; print(torch.cuda.device_count(), torch.__version__)')
if (( VISIBLE < NGPU )); then
    if (( VISIBLE == 0 )); then
        echo "run_train: training needs NVIDIA GPUs: NGPU=$NGPU asks for $NGPU, torch $TORCH_VERSION" \
            "sees none (torch.cuda.device_count() = 0). Without GPUs, ./scripts/bench_layer.sh" \
            "runs a small CPU layer A/B." >&2
    else
        echo "run_train: training needs NVIDIA GPUs: NGPU=$NGPU asks for $NGPU, torch $TORCH_VERSION" \
            "sees $VISIBLE; run with NGPU=$VISIBLE or fewer." >&2
    fi
    exit 1
fi
if [[ ${1:-} == --check-gpus ]]; then
    exit 0
fi

# The TOMLs name repo-relative assets (the tokenizer) and TorchTitan imports titan_megamoe from here.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

. scripts/transport_env.sh

set -x
torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint=localhost:0 \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@"

#!/usr/bin/env bash
# Launch TorchTitan 0.3.0 training the way TorchTitan's own run_train.sh does: a config
# function of a config module (scripts/run_train.sh launches TorchTitan 0.2.2's TOMLs).
#
#   CONFIG=qwen3_30b_a3b_4l_mega_moe NGPU=2 ./scripts/run_train_torchtitan03.sh [--section.key value ...]
#
# CONFIG    config function to train with (default: debug_moe_mega_moe)
# MODULE    the module that defines it (default: titan_megamoe.torchtitan03.config_registry;
#           any importable module, e.g. one of the user's own)
# NGPU      processes (GPUs) on this node (default: 8)
# LOG_RANK  comma-separated local ranks whose output is shown (default: 0)
# Extra arguments override fields of the config, e.g. --training.steps 10
#
# Training needs NGPU NVIDIA GPUs visible to torch (checked as run_train.sh checks them) and
# TorchTitan 0.3.0.
set -euo pipefail

CONFIG=${CONFIG:-debug_moe_mega_moe}
MODULE=${MODULE:-titan_megamoe.torchtitan03.config_registry}
export NGPU=${NGPU:-8}
LOG_RANK=${LOG_RANK:-0}
REPO=$(realpath "$(dirname "${BASH_SOURCE[0]}")/..")

"$REPO/scripts/run_train.sh" --check-gpus
cd "$REPO"
python -c 'import sys; from titan_megamoe import titan_version; titan_version.require("0.3", sys.argv[1])' \
    scripts/run_train_torchtitan03.sh

. scripts/transport_env.sh

set -x
torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint=localhost:0 \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m torchtitan.train --module "$MODULE" --config "$CONFIG" "$@"

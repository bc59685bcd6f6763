#!/usr/bin/env bash
# Train one TOML twice, as written (with the mega_moe converter) and stock ("mega_moe"
# removed from [model] converters, everything else equal), then compare the two runs.
# AB_STOCK_BF16=1 adds a third run, stock_bf16, for TOMLs with a torchao FP8 converter.
#
#   CONFIG_FILE=train_configs/qwen3_30b_a3b_4l_mega_moe.toml NGPU=2 ./scripts/ab_train.sh [overrides]
#
# CONFIG_FILE  TOML whose [model] converters contain "mega_moe" (required)
# NGPU         processes (GPUs) per run (default: 8), LOG_RANK as for run_train.sh
# AB_OUT       output folder (default: outputs/ab/<toml stem>-<timestamp>)
# AB_WINDOW    steps averaged for step time and throughput, FIRST-LAST (default: 6-20; the
#              runs must train at least LAST steps)
# AB_STOCK_BF16  1: after the other two, also train stock_bf16 (the TOML without "mega_moe"
#              and without every "quantize.*" converter: stock TorchTitan in bf16) and take
#              the report's speedups and loss differences against it; 0: two runs (default)
# Extra arguments override TOML fields in every run.
#
# Writes <AB_OUT>/{mega_moe,stock}.toml (what ran), {mega_moe,stock}.log, ab.md, ab.json, loss.png;
# with AB_STOCK_BF16=1 also stock_bf16.toml and stock_bf16.log.
set -euo pipefail

: "${CONFIG_FILE:?set CONFIG_FILE to a TOML with \"mega_moe\" in [model] converters}"
AB_STOCK_BF16=${AB_STOCK_BF16:-0}
if [[ $AB_STOCK_BF16 != [01] ]]; then
    echo "ab_train: AB_STOCK_BF16=$AB_STOCK_BF16 is not valid: 1 adds the stock_bf16 run, 0 (default) does not" >&2
    exit 1
fi
REPO=$(realpath "$(dirname "${BASH_SOURCE[0]}")/..")
# Like run_train.sh: a path relative to the current directory or to the repo root.
if [[ -f "$CONFIG_FILE" ]]; then
    CONFIG_FILE=$(realpath "$CONFIG_FILE")
elif [[ -f "$REPO/$CONFIG_FILE" ]]; then
    CONFIG_FILE="$REPO/$CONFIG_FILE"
else
    echo "ab_train: no such TOML: $CONFIG_FILE" >&2
    exit 1
fi
# Refuse a machine without NGPU GPUs before writing anything.
"$REPO/scripts/run_train.sh" --check-gpus
STEM=$(basename "$CONFIG_FILE" .toml)
AB_OUT=$(realpath -m "${AB_OUT:-$REPO/outputs/ab/$STEM-$(date +%Y%m%d-%H%M%S)}")
AB_WINDOW=${AB_WINDOW:-6-20}
mkdir -p "$AB_OUT"

cp "$CONFIG_FILE" "$AB_OUT/mega_moe.toml"
python "$REPO/scripts/ab_stock_toml.py" "$CONFIG_FILE" "$AB_OUT/stock.toml"
if [[ $AB_STOCK_BF16 == 1 ]]; then
    python "$REPO/scripts/ab_stock_toml.py" --drop-quantize "$CONFIG_FILE" "$AB_OUT/stock_bf16.toml"
fi

AB_SCRIPT=ab_train
launch_run() {  # name [overrides]: <AB_OUT>/<name>.toml
    local name=$1
    shift
    CONFIG_FILE="$AB_OUT/$name.toml" "$REPO/scripts/run_train.sh" --job.dump_folder "$AB_OUT/$name" "$@"
}
# shellcheck source=scripts/ab_runs.sh
source "$REPO/scripts/ab_runs.sh"
ab_runs_and_report "$@"

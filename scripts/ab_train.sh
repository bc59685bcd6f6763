#!/usr/bin/env bash
# Train one TOML twice, as written (with the mega_moe converter) and stock ("mega_moe"
# removed from [model] converters, everything else equal), then compare the two runs.
#
#   CONFIG_FILE=train_configs/qwen3_30b_a3b_4l_mega_moe.toml NGPU=2 ./scripts/ab_train.sh [overrides]
#
# CONFIG_FILE  TOML whose [model] converters contain "mega_moe" (required)
# NGPU         processes (GPUs) per run (default: 8), LOG_RANK as for run_train.sh
# AB_OUT       output folder (default: outputs/ab/<toml stem>-<timestamp>)
# AB_WINDOW    steps averaged for step time and throughput, FIRST-LAST (default: 6-20)
# Extra arguments override TOML fields in both runs.
#
# Writes <AB_OUT>/{mega_moe,stock}.toml (what ran), {mega_moe,stock}.log, ab.md, ab.json, loss.png.
set -euo pipefail

: "${CONFIG_FILE:?set CONFIG_FILE to a TOML with \"mega_moe\" in [model] converters}"
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

train() {  # name; runs <AB_OUT>/<name>.toml, logs to <AB_OUT>/<name>.log
    local name=$1
    shift
    local log="$AB_OUT/$name.log"
    echo "ab_train: $name run, log $log"
    if ! CONFIG_FILE="$AB_OUT/$name.toml" "$REPO/scripts/run_train.sh" \
            --job.dump_folder "$AB_OUT/$name" "$@" 2>&1 | tee "$log"; then
        echo "ab_train: the $name run failed; last lines of $log:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
}

# mega_moe first: the run more likely to fail fails before the stock run is spent.
train mega_moe "$@"
train stock "$@"

python "$REPO/scripts/ab_report.py" --stock "$AB_OUT/stock.log" --mega-moe "$AB_OUT/mega_moe.log" \
    --window "$AB_WINDOW" --out "$AB_OUT"

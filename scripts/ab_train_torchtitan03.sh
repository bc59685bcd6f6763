#!/usr/bin/env bash
# Train one TorchTitan 0.3.0 config twice, as written (with MegaMoEConverter) and stock (the
# same config with TorchTitan's own routed experts: the override
# titan_megamoe.torchtitan03.overrides.stock_routed_experts), then compare the two runs.
# AB_STOCK_BF16=1 adds a third run, stock_bf16, without torchao's grouped-experts converters.
# (scripts/ab_train.sh does the same for TorchTitan 0.2.2's TOMLs.)
#
#   CONFIG=qwen3_30b_a3b_4l_mega_moe NGPU=2 ./scripts/ab_train_torchtitan03.sh [overrides]
#
# CONFIG, MODULE  config function whose model lists MegaMoEConverter, and the module that
#              defines it, as for run_train_torchtitan03.sh (CONFIG required)
# NGPU         processes (GPUs) per run (default: 8), LOG_RANK as for run_train_torchtitan03.sh
# AB_OUT       output folder (default: outputs/ab/<CONFIG>-<timestamp>)
# AB_WINDOW    steps averaged for step time and throughput, FIRST-LAST (default: 6-20; the
#              runs must train at least LAST steps)
# AB_STOCK_BF16  1: after the other two, also train stock_bf16 and take the report's speedups
#              and loss differences against it; 0: two runs (default)
# Extra arguments override config fields in every run.
#
# Writes <AB_OUT>/{mega_moe,stock}.args (the arguments each run got), {mega_moe,stock}.log,
# ab.md, ab.json, loss.png; with AB_STOCK_BF16=1 also stock_bf16.args and stock_bf16.log.
set -euo pipefail

: "${CONFIG:?set CONFIG to a config function whose model lists MegaMoEConverter}"
export CONFIG
export MODULE=${MODULE:-titan_megamoe.torchtitan03.config_registry}
AB_STOCK_BF16=${AB_STOCK_BF16:-0}
if [[ $AB_STOCK_BF16 != [01] ]]; then
    echo "ab_train_torchtitan03: AB_STOCK_BF16=$AB_STOCK_BF16 is not valid: 1 adds the stock_bf16 run, 0 (default)" \
        "does not" >&2
    exit 1
fi
REPO=$(realpath "$(dirname "${BASH_SOURCE[0]}")/..")
# Refuse a machine without NGPU GPUs, and a config without mega_moe, before writing anything.
"$REPO/scripts/run_train.sh" --check-gpus
(cd "$REPO" && python - "$MODULE" "$CONFIG" <<'PY'
import importlib
import sys

from titan_megamoe import titan_version

titan_version.require("0.3", "scripts/ab_train_torchtitan03.sh")
from titan_megamoe.torchtitan03.overrides import mega_moe_layers

module, name = sys.argv[1:]
if not mega_moe_layers(getattr(importlib.import_module(module), name)()):
    sys.exit(f"ab_train_torchtitan03: {module}.{name}: its model lists no MegaMoEConverter, so its stock twin "
             "would be the same run")
PY
)
AB_OUT=$(realpath -m "${AB_OUT:-$REPO/outputs/ab/$CONFIG-$(date +%Y%m%d-%H%M%S)}")
AB_WINDOW=${AB_WINDOW:-6-20}
mkdir -p "$AB_OUT"

STOCK=titan_megamoe.torchtitan03.overrides.stock_routed_experts

AB_SCRIPT=ab_train_torchtitan03
launch_run() {  # name [overrides]: the config, or its stock twin; arguments kept in <AB_OUT>/<name>.args
    local name=$1
    shift
    local -a args=(--dump_folder "$AB_OUT/$name")
    case $name in
        stock) args+=(--override.imports "$STOCK") ;;
        stock_bf16) args+=(--override.imports "$STOCK={\"drop_quantize\": true}") ;;
    esac
    args+=("$@")
    printf '%q ' "MODULE=$MODULE" "CONFIG=$CONFIG" "${args[@]}" > "$AB_OUT/$name.args"
    "$REPO/scripts/run_train_torchtitan03.sh" "${args[@]}"
}
# shellcheck source=scripts/ab_runs.sh
source "$REPO/scripts/ab_runs.sh"
ab_runs_and_report "$@"

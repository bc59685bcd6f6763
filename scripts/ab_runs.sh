# Sourced by ab_train.sh (TorchTitan 0.2.2) and ab_train_torchtitan03.sh (0.3.0): the A/B's
# runs, in order, and its report. The sourcing script sets REPO, AB_OUT, AB_WINDOW,
# AB_STOCK_BF16 and AB_SCRIPT (its name, for messages), and defines `launch_run NAME
# [overrides]`, which trains run NAME (mega_moe, stock or stock_bf16) to stdout.

ab_run() {  # name [overrides]: launch_run's output, teed to <AB_OUT>/<name>.log
    local name=$1
    shift
    local log="$AB_OUT/$name.log"
    echo "$AB_SCRIPT: $name run, log $log"
    if ! launch_run "$name" "$@" 2>&1 | tee "$log"; then
        echo "$AB_SCRIPT: the $name run failed; last lines of $log:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
}

ab_runs_and_report() {  # [overrides]: every run gets them
    # mega_moe first: the run more likely to fail fails before the stock run is spent.
    ab_run mega_moe "$@"
    ab_run stock "$@"
    local also=()
    if [[ $AB_STOCK_BF16 == 1 ]]; then
        ab_run stock_bf16 "$@"
        also=(--also "stock_bf16=$AB_OUT/stock_bf16.log" --baseline stock_bf16)
    fi
    python "$REPO/scripts/ab_report.py" --stock "$AB_OUT/stock.log" --mega-moe "$AB_OUT/mega_moe.log" \
        --window "$AB_WINDOW" --out "$AB_OUT" "${also[@]}"
}

#!/usr/bin/env bash
# The layer A/B (scripts/bench_layer.py) on every GPU of this machine, or, with no GPU, a
# small A/B on two gloo ranks on the CPU (its first lines say what it runs instead, and which
# of the variants asked for it leaves out, as they need a GPU): a check that mega_moe computes
# what stock computes, whose timings say nothing about GPU speed. Each run writes its files
# into a new folder of --out (default outputs/bench_layer), named by its start time.
# Arguments go to bench_layer.py (--help lists them); by default it runs 30B-A3B and
# 235B-A22B at 4,096 and 16,384 tokens/rank, stock eager, stock compiled and mega_moe,
# forward + backward, 20 iterations. The fused forward alone, e.g.:
#   ./scripts/bench_layer.sh --backend fused --forward-only
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# bench_layer.py checks the arguments, then starts its ranks under torchrun itself.
exec python scripts/bench_layer.py "$@"

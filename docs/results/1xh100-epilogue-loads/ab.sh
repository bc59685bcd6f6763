#!/usr/bin/env bash
# ab.sh: swiglu epilogue loads two parts ahead + wgrad TMA-store epilogue: new vs old (HEAD)
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/info.txt
SA=docs/results/1xh100-grad1-schedules/standalone.py
prof() { local name=$1; shift; s=$(date +%s)
  timeout 110 torchrun --nproc_per_node 1 scripts/profile_layer.py --tokens 16384 --backward --save-gemm1 --iters 10 --out $OUT/$name "$@" > $OUT/$name.log 2>&1
  echo "$name rc $? $(( $(date +%s)-s )) s"; grep -iE "swiglu_grad|token_grouped|per call" $OUT/$name.log | head -6; }
sa() { NAME=sw_$1 SKIP_GEMM=1 STAGES="4" timeout 100 python $SA 2>&1 | grep -v Warn | tail -4; }
gb() { timeout 100 python scripts/gemm_bench.py --layers 30B-A3B --local-experts 128 --gemms wgrad_w13,wgrad_w2 --precisions fp8 --impls gluon --out $OUT/gb_$1 > $OUT/gb_$1.log 2>&1; echo "gb $1 rc $?"; grep -E "wgrad" $OUT/gb_$1.log | tail -4; }
s=$(date +%s)
timeout 220 python -m pytest tests/gpu/test_gluon_gemm_gpu.py -k "swiglu or token_grouped" -q -p no:cacheprovider > $OUT/pytest.log 2>&1
echo "pytest rc $? $(( $(date +%s)-s )) s"; tail -3 $OUT/pytest.log
sa new; gb new
prof new_30_fp8 --shape 30B-A3B --precision fp8
git stash -q && echo "stashed: $(git status --short | grep -c '^ M')"
sa old; gb old
prof old_30_fp8 --shape 30B-A3B --precision fp8
git stash pop -q && git status --short | head -3

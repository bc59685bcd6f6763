#!/usr/bin/env bash
# ab.sh: the backward's first kernel with its saved pre-activations copied asynchronously into
# shared memory (the working tree, preact_async_copy.patch applied) against HEAD (6c2e834)
set -uo pipefail
OUT=${OUT:-ab_out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/info.txt
SA=docs/results/1xh100-grad1-schedules/standalone.py
prof() { local name=$1; shift; s=$(date +%s)
  timeout 100 torchrun --nproc_per_node 1 scripts/profile_layer.py --tokens 16384 --backward --save-gemm1 --iters 10 --out /tmp/$name "$@" > $OUT/$name.log 2>&1
  echo "$name rc $? $(( $(date +%s)-s )) s"; grep -iE "swiglu_grad|per call" $OUT/$name.log | head -3; }
sa() { NAME=sw_$1 SKIP_GEMM=1 STAGES="4" timeout 100 python $SA 2>&1 | grep -v Warn | tail -4; }
s=$(date +%s)
timeout 150 python -m pytest tests/gpu/test_gluon_gemm_gpu.py -k "swiglu or one_gpu" "tests/gpu/test_fused_gpu.py::test_one_gpu[fp8]" "tests/gpu/test_fused_gpu.py::test_one_gpu[bf16]" -q -p no:cacheprovider > $OUT/pytest.log 2>&1
echo "pytest rc $? $(( $(date +%s)-s )) s"; tail -2 $OUT/pytest.log
sa new; prof new_30_fp8 --shape 30B-A3B --precision fp8; prof new_30_bf16 --shape 30B-A3B --precision bf16
git stash -q && echo "stashed: $(git status --short | grep -c '^ M')"
sa old; prof old_30_fp8 --shape 30B-A3B --precision fp8; prof old_30_bf16 --shape 30B-A3B --precision bf16
git stash pop -q && git status --short | head -5

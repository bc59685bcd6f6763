#!/usr/bin/env bash
# ab3.sh : swiglu epilogue with [da|db] stashed in shared memory (+ swizzled staging): new vs old
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/info.txt
SA=docs/results/1xh100-grad1-schedules/standalone.py
prof() { local name=$1; shift; s=$(date +%s)
  timeout 120 torchrun --nproc_per_node 1 scripts/profile_layer.py --tokens 16384 --backward --save-gemm1 --iters 10 --out $OUT/$name "$@" > $OUT/$name.log 2>&1
  echo "$name rc $? $(( $(date +%s)-s )) s"; grep -iE "swiglu_grad|per call" $OUT/$name.log | head -6; }
sa() { NAME=sw_$1 SKIP_GEMM=1 STAGES="$2" timeout 150 python $SA 2>&1 | grep -v Warn | tail -8; }
s=$(date +%s)
timeout 200 python -m pytest tests/gpu/test_gluon_gemm_gpu.py -k swiglu -q -p no:cacheprovider > $OUT/pytest_swiglu.log 2>&1
echo "pytest rc $? $(( $(date +%s)-s )) s"; tail -3 $OUT/pytest_swiglu.log
sa new "4 5"
prof new_30_fp8 --shape 30B-A3B --precision fp8 --tiles "" grad1_saved_stages=5
prof new_30_bf16 --shape 30B-A3B --precision bf16
cp kernels/gluon/sm90/epilogue.py /tmp/epi.py
sed -i 's/SwizzledSharedLayout([48], 1, 4, \[1, 0\])/SwizzledSharedLayout(1, 1, 1, [1, 0])/' kernels/gluon/sm90/epilogue.py
grep -n "^ST.*LAYOUT =" kernels/gluon/sm90/epilogue.py
sa nosw "4"
cp /tmp/epi.py kernels/gluon/sm90/epilogue.py
git stash -q && echo "stashed: $(git status --short | grep -c '^ M')"
sa old "4 5"
prof old_30_fp8 --shape 30B-A3B --precision fp8 --tiles "" grad1_saved_stages=5
prof old_30_bf16 --shape 30B-A3B --precision bf16
git stash pop -q && git status --short | head -3

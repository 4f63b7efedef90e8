#!/usr/bin/env bash
# run 21: issue 46.2 again, as in-process A/B segments of one Trainer run (part 6), so that the pairs share
# one process's GPU state; the environment first. Wheels in .whl are not needed.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{ date -u +%FT%TZ; python3 --version; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,pstate,clocks.sm,clocks.max.sm --format=csv; nvidia-smi --query-compute-apps=pid,used_memory --format=csv; nproc; echo "commit ${VW_BENCH_COMMIT:-?}"; } > $OUT/environment.txt 2>&1
cat $OUT/environment.txt
OUT=$OUT BUDGET=${BUDGET:-380} bash benchmarks/run_gpu.sh --full part6 > $OUT/part6.log 2>&1; echo "part6 rc=$?"
tail -n 30 $OUT/part6.log

#!/usr/bin/env bash
# run 22, 2026-12-08 00:17 UTC (the command given to the GPU machine): the environment, then part 6, the Trainer workload as
# in-process A/B segments, up to 28 pairs within SEG_DEADLINE=290 s (about 23 fit).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p $OUT
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; nvidia-smi --query-compute-apps=pid,used_memory --format=csv; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; nproc; } > $OUT/environment.txt 2>&1
cat $OUT/environment.txt
VW_BENCH_COMMIT=$VW_BENCH_COMMIT SEG_PAIRS=28 SEG_DEADLINE=290 OUT=$OUT BUDGET=320 bash benchmarks/run_gpu.sh --full part6 > $OUT/part6.log 2>&1; echo rc=$?
tail -n 25 $OUT/part6.log

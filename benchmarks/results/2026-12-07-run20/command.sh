#!/usr/bin/env bash
# run 20, two calls on one machine after issue 43's shrink: `bench` (the scrape budgets beside
# nvitop-exporter, 8 ranks on 8 simulated GPUs, RSS against an NVML-only process) and `rank` (the training
# process's direct cost, then the GPU test suite). Wheels travel in .whl.
set -u
stage=${1:?bench or rank}
S=$(date +%s); say() { echo "[run20 $stage $(( $(date +%s) - S ))s] $*"; }
PY=python3
need=$($PY -c 'import importlib.util as u; print(" ".join(m for m in ("nvitop", "nvitop_exporter", "psutil", "pytest", "yaml", "pluggy", "iniconfig", "packaging", "pygments") if u.find_spec(m) is None))')
say "missing: $need"
for n in $need; do w=$n; [ "$n" = yaml ] && w=pyyaml
  for f in .whl/${w}-*.whl; do $PY -m pip install -q --no-deps --target /tmp/site "$f" 2>&1 | tail -1; done; done
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT/$stage"; O=$OUT/$stage
{ date -u +%FT%TZ; $PY --version; $PY -c "import torch; print(torch.__version__)"; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,pstate --format=csv; nproc; echo "commit ${VW_BENCH_COMMIT:-?}"; } > $O/environment.txt 2>&1
cat $O/environment.txt
if [ "$stage" = bench ]; then
  say "scrape"
  timeout 270 $PY benchmarks/scrape.py --ranks 1,8 --idle-seconds 3 --busy-seconds 3 --concurrency 10 --concurrent-seconds 5 --mixed-clients 0 --out $O/scrape.json > $O/scrape.log 2>&1; echo "scrape rc=$?"; grep -i "target\|budget" $O/scrape.log | tail -n 20
  say "scale 8x8"
  timeout 90 $PY benchmarks/scrape_scale.py --gpus 8 --ranks 8 --out $O/scale-8x8.json > $O/scale.log 2>&1; echo "scale rc=$?"; tail -n 6 $O/scale.log
  say "NVML-only RSS, three fresh processes"
  for i in 1 2 3; do $PY -c 'import pynvml, time; pynvml.nvmlInit(); time.sleep(1); f = open("/proc/self/status").read(); print({k: v.strip() for k, v in (l.split(":", 1) for l in f.splitlines()) if k in ("VmRSS", "RssAnon", "RssFile")})'; done > $O/nvml_only_rss.txt 2>&1; cat $O/nvml_only_rss.txt
  say "rss_floor"
  timeout 110 $PY benchmarks/rss_floor.py --repeats 1 --settle 3 --out $O/rss_floor.json > $O/rss_floor.log 2>&1; echo "rss rc=$?"; tail -n 14 $O/rss_floor.log
else
  say "direct cost"
  BUDGET=${BUDGET:-240} OUT=$O bash benchmarks/run_gpu.sh --full direct > $O/direct.log 2>&1; echo "direct rc=$?"; tail -n 25 $O/direct.log
  say "GPU tests"
  timeout 240 $PY -m pytest -m gpu tests/gpu -q -rfEs -p no:cacheprovider > $O/pytest-gpu.txt 2>&1; echo "pytest rc=$?"; tail -n 8 $O/pytest-gpu.txt
fi
say done

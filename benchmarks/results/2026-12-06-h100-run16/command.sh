#!/usr/bin/env bash
# run 16, in two calls: `bench` (the least Python server beside ours, the scrape beside nvitop-exporter, RSS
# step by step) and `suite` (the GPU tests). Run 15's shape; the wheels travel in .whl.
set -u
stage=${1:?bench or suite}
S=$(date +%s); say() { echo "[run16 $stage $(( $(date +%s) - S ))s] $*"; }
PY=python3
need=$($PY -c 'import importlib.util as u; print(" ".join(m for m in ("nvitop", "nvitop_exporter", "psutil", "pytest", "yaml", "pluggy", "iniconfig", "packaging", "pygments") if u.find_spec(m) is None))')
say "missing: $need"
for n in $need; do w=$n; [ "$n" = yaml ] && w=pyyaml
  for f in .whl/${w}-*.whl; do case "$f" in *cp3*-cp3*) $PY -c "import sys; sys.exit(0 if f'cp{sys.version_info[0]}{sys.version_info[1]}' in '$f' else 1)" || continue;; esac
    $PY -m pip install -q --no-deps --target /tmp/site "$f" 2>&1 | tail -1; done; done
export PYTHONPATH=$PWD:/tmp/site
mkdir -p "$OUT/$stage"; O=$OUT/$stage
{ date -u +%FT%TZ; $PY --version; $PY -c "import torch; print(torch.__version__)"; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,pstate --format=csv; nproc; echo "commit ${VW_BENCH_COMMIT:-?}"; } > $O/environment.txt 2>&1
cat $O/environment.txt
if [ "$stage" = bench ]; then
  say "scrape_floor"
  timeout 130 $PY benchmarks/scrape_floor.py --repeats 2 --scrapes 60 --out $O/scrape_floor.json > $O/scrape_floor.log 2>&1; echo "floor rc=$?"; tail -n 12 $O/scrape_floor.log
  say "scrape"
  timeout 270 $PY benchmarks/scrape.py --ranks 1,8 --idle-seconds 3 --busy-seconds 3 --concurrency 10 --concurrent-seconds 5 --mixed-clients 0 --out $O/scrape.json > $O/scrape.log 2>&1; echo "scrape rc=$?"; grep target $O/scrape.log
  say "rss_floor"
  timeout 120 $PY benchmarks/rss_floor.py --repeats 1 --settle 3 --out $O/rss_floor.json > $O/rss_floor.log 2>&1; echo "rss rc=$?"; tail -n 14 $O/rss_floor.log
else
  say "gpu suite"
  timeout 560 $PY -m pytest -m gpu tests/gpu -q -rfEs -p no:cacheprovider > $O/pytest-gpu.txt 2>&1; echo "pytest rc=$?"; tail -n 12 $O/pytest-gpu.txt
fi
say done

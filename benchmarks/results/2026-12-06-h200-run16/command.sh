#!/usr/bin/env bash
# run 16: after the leaner loop (epoll, cached answer heads, request route/Accept, refreshing flag): the callback GPU tests, the floor, the scrape benchmark beside nvitop-exporter
set -u
S=$(date +%s); say() { echo "[run16 $(( $(date +%s) - S ))s] $*"; }
PY=python3
$PY - <<'P' > /tmp/need.txt
import importlib.util as u
print(" ".join(m for m in ("nvitop", "nvitop_exporter", "psutil", "pytest", "yaml", "pluggy", "iniconfig", "packaging", "pygments") if u.find_spec(m) is None))
P
need=$(cat /tmp/need.txt); say "missing: $need"
for n in $need; do w=$n; [ "$n" = yaml ] && w=pyyaml
  for f in .whl/${w}-*.whl; do case "$f" in *cp3*-cp3*) $PY -c "import sys,re; sys.exit(0 if f'cp{sys.version_info[0]}{sys.version_info[1]}' in '$f' else 1)" || continue;; esac
    $PY -m pip install -q --no-deps --target /tmp/site "$f" 2>&1 | tail -1; done; done
export PYTHONPATH=$PWD:/tmp/site
{ date -u +%FT%TZ; $PY --version; $PY -c "import torch; print(torch.__version__)"; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,pstate --format=csv; nproc; git log --oneline -1 2>/dev/null || echo "${VW_COMMIT:-?}"; } > $OUT/environment.txt 2>&1
cat $OUT/environment.txt
say "gpu suite"
timeout 150 $PY -m pytest -m gpu tests/gpu/test_gpu_callbacks.py -q -rfEs -p no:cacheprovider > $OUT/pytest-gpu.txt 2>&1; echo "pytest rc=$?"; tail -n 8 $OUT/pytest-gpu.txt
say "scrape_floor"
timeout 120 $PY benchmarks/scrape_floor.py --repeats 2 --scrapes 60 --out $OUT/scrape_floor.json > $OUT/scrape_floor.log 2>&1; echo "floor rc=$?"; tail -n 12 $OUT/scrape_floor.log
say "scrape"
timeout 260 $PY benchmarks/scrape.py --ranks 1,8 --idle-seconds 3 --busy-seconds 3 --concurrency 10 --concurrent-seconds 5 --mixed-clients 0 --out $OUT/scrape.json > $OUT/scrape.log 2>&1; echo "scrape rc=$?"; grep target $OUT/scrape.log
say done

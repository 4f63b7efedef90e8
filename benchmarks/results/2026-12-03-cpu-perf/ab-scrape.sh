#!/bin/bash
# The paired runs behind RESULTS.md's 2026-12-03 CPU section: A = the tree at 842cee4 (before issue 19) with
# this branch's benchmarks/scrape.py copied in, B = this branch (cfd1a58), alternating A B A B.
#   BASE=/path/to/842cee4-tree NEW=/path/to/this-tree OUT=/some/dir bash ab-scrape.sh
for i in 1 2; do
  for v in A B; do
    if [ $v = A ]; then R=$BASE; else R=$NEW; fi
    (cd "$R" && PYTHONPATH="$R" nice -n 5 ${PY:-python3} benchmarks/scrape.py --device cpu --ranks 1,8 --scrapes 100 \
      --rate 10 --idle-seconds 3 --concurrency 10 --concurrent-seconds 5 --out "$OUT/scrape-$v$i.json")
  done
done

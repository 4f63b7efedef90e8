#!/bin/bash
# paired A B A B A B: A = the tree at 534eb6e (interval 1 s default), B = h-direct (2 s default)
PY=/work/main/.venv/bin/python
cd /tmp/direct-ab
for i in 1 2 3; do
  for v in A B; do
    if [ $v = A ]; then root=/tmp/direct-A; else root=/work/wt-direct; fi
    echo "=== pair $i $v $(date -u +%T)" >> log.txt
    (cd $root && PYTHONPATH=$root nice -n 10 $PY benchmarks/overhead.py --device cpu --simulate --workloads direct \
      --direct-seconds 30 --direct-parts-seconds 20 --step-calls 200000 --out /tmp/direct-ab/direct-$i-$v.json) >> log.txt 2>&1
  done
done
echo "=== done $(date -u +%T)" >> log.txt

#!/bin/bash
# The paired runs behind the issue 19 server-side work (branch h-srvperf): A = the tree at 6d7f0cb (a worker
# thread per request) with B's benchmarks/scrape.py copied in, B = eec1b72 (the event loop answers a scrape of a
# current render itself), alternating A B A B on the project's 2-core shared CPU machine, simulated GPU.
#   BASE=/path/to/6d7f0cb-tree NEW=/path/to/eec1b72-tree OUT=/some/dir bash ab-scrape.sh
for i in 1 2; do
  for v in A B; do
    if [ $v = A ]; then R=$BASE; else R=$NEW; fi
    (cd "$R" && PYTHONPATH="$R" nice -n 10 ${PY:-python3} benchmarks/scrape.py --simulate --ranks 1,8 --idle-seconds 3 \
      --paced-scrapes 150 --busy-seconds 5 --concurrent-seconds 5 --mixed-seconds 3 --out "$OUT/scrape-$v$i.json")
  done
done

#!/usr/bin/env bash
# One-shot GPU run: the GPU test suite and the benchmarks, every result under $OUT.
#
#   OUT=/some/dir bash benchmarks/run_gpu.sh --quick all      # ~6 min: the whole pipeline, small figures
#   OUT=/some/dir bash benchmarks/run_gpu.sh --full part1     # ~9.5 min: pytest -m gpu, direct cost, launch-bound pairs
#   OUT=/some/dir bash benchmarks/run_gpu.sh --full part2     # ~8 min: transformer pairs, scrape
#   OUT=/some/dir bash benchmarks/run_gpu.sh --full part3     # ~2 min: fragmentation
#   OUT=/some/dir bash benchmarks/run_gpu.sh --full part5     # ~9.5 min: issue 46: the walks, Trainer pairs, GPM
#   OUT=/some/dir bash benchmarks/run_gpu.sh --full part6     # ~5 min: issue 46.2: 24 A/B segment pairs in one Trainer run
#   bash benchmarks/run_gpu.sh --plan --full part1            # print the commands only
#   OUT=/tmp/x bash benchmarks/run_gpu.sh --smoke all         # no GPU: tiny CPU/simulated runs (CI smoke test)
#
# Parts: tests direct launch launch_fresh transformer scrape fragmentation direct_nopin launch_short rss walks
# trainer gpm trainer_segments, or the
# groups part1 (tests direct launch launch_fresh), part2 (transformer scrape), part3 (fragmentation),
# part4 (direct_nopin: the direct cost with placement left to the scheduler; launch_short: 100 pairs of
# 1 s launch-bound segments against one sidecar server), part5 (walks: the role walk at 100k parameters and the
# allocator snapshot at 10k segments; trainer: GPT-2 in transformers' Trainer, A/B pairs with vramwatch's
# callback; gpm: a GPU-bound step with the GPM collector on and off), part6 (trainer_segments: the Trainer
# workload as A/B segments of one training run, abba order, at most SEG_DEADLINE s), all (parts 1-3). launch_fresh
# (launch-bound pairs with every run a process of its own, a cross-check) takes what part1 leaves.
# BUDGET (seconds, default 570) bounds one invocation: each phase gets at most what is left (the
# overhead benchmark stops starting pairs in time and keeps what it measured; the others are cut by
# `timeout`). Wheels in .whl/ (nvitop, nvitop-exporter, pytest)
# are unpacked into a private directory when the interpreter lacks them. VW_BENCH_COMMIT names the
# commit when .git did not travel. GPU_TESTS narrows the suite (default tests/gpu); PAIRS (20: the paired
# workloads stop starting pairs at their deadline, so more only fills the budget); STEP_CALLS (1e6) and
# TF_MARGIN (40 s left after the transformer pairs) trim a tight command. PACK=1 packs every output into $OUT/results.tgz. Merge the overhead parts afterwards with
#   python3 benchmarks/overhead.py --merge OUT1/overhead-part1.json OUT2/overhead-part2.json --out overhead.json
set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT="${OUT:-$REPO/out}"
BUDGET="${BUDGET:-570}"
MODE=full
PLAN=0
PARTS=()
for a in "$@"; do
  case "$a" in
    --quick) MODE=quick ;;
    --full) MODE=full ;;
    --smoke) MODE=smoke ;;
    --plan) PLAN=1 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    part1) PARTS+=(tests direct launch launch_fresh) ;;
    part2) PARTS+=(transformer scrape) ;;
    part3) PARTS+=(fragmentation) ;;
    part4) PARTS+=(direct_nopin launch_short) ;;
    part5) PARTS+=(walks trainer gpm) ;;
    part6) PARTS+=(trainer_segments) ;;
    all) PARTS+=(tests direct launch launch_fresh transformer scrape fragmentation) ;;
    tests|direct|launch|launch_fresh|transformer|scrape|fragmentation|direct_nopin|launch_short|rss|walks|trainer|gpm|trainer_segments) PARTS+=("$a") ;;
    *) echo "unknown argument: $a" >&2; exit 2 ;;
  esac
done
if [ ${#PARTS[@]} -eq 0 ]; then
  if [ "$MODE" = full ]; then PARTS=(tests direct launch launch_fresh); else PARTS=(tests direct launch launch_fresh transformer scrape fragmentation); fi
fi
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
say() { echo "[run_gpu $(( $(date +%s) - START ))s] $*"; }
has() { local p; for p in "${PARTS[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }

# --- sizes per mode ---
RUN_ARGS="--run-seconds 3"
if [ "$MODE" = quick ]; then
  PAIRS=4; DIRECT=10; DIRECT_PARTS=5; CALLS=200000; TESTS_CAP=200; SCRAPE_ARGS="--quick"; FRAG_ARGS="--quick"
elif [ "$MODE" = smoke ]; then  # CPU only: proves the pipeline, measures nothing
  PAIRS=2; DIRECT=1.5; DIRECT_PARTS=2.5; CALLS=20000; TESTS_CAP=120  # parts: a window holding a tick (2 s)
  RUN_ARGS="--device cpu --run-seconds 0.2 --warmup-seconds 0.05 --step-repeats 3 --pairs-per-process 1"
  NP=$(nproc 2>/dev/null || echo 1); [ "$NP" -ge 2 ] && RUN_ARGS="$RUN_ARGS --pin-core $((NP - 1))"  # the pinning path too
  SCRAPE_ARGS="--device cpu --ranks 1,2 --scrapes 10 --rate 20 --idle-seconds 0.5 --paced-scrapes 10 --busy-seconds 0.5 --concurrency 4 --concurrent-seconds 0.5 --mixed-seconds 0.5"
  FRAG_ARGS="--device cpu --seconds 1.5 --poll 0.2 --interval 0.2"
else
  PAIRS=${PAIRS:-20}; DIRECT=60; DIRECT_PARTS=30; CALLS=${STEP_CALLS:-1000000}; TESTS_CAP=${TESTS_CAP:-330}; SCRAPE_ARGS=""; FRAG_ARGS=""
fi

# --- commands ---
CMD_TESTS="$PY -m pytest -m gpu ${GPU_TESTS:-tests/gpu} -v -rfEs -p no:cacheprovider --junitxml=$OUT/pytest-gpu.xml"
overhead_cmd() {  # $1 workloads, $2 out file, $3 deadline seconds, $4 extra arguments
  echo "$PY benchmarks/overhead.py --workloads $1 --pairs $PAIRS $RUN_ARGS --direct-seconds $DIRECT" \
       "--direct-parts-seconds $DIRECT_PARTS" \
       "--step-calls $CALLS --deadline $3 --out $2 ${4:-}"
}
# a transformer step is ~100 ms: 0.5 s (and at least 3 steps) warms it; 60 runs share the budget
TF_WARMUP="--warmup-seconds 0.5"; [ "$MODE" = smoke ] && TF_WARMUP=""
SHORT="--run-seconds 1 --segment-warmup-seconds 0.25 --segment-server external --pairs-per-process 50"
[ "$MODE" = full ] && SHORT="$SHORT --pairs 100"
[ "$MODE" = smoke ] && SHORT="--run-seconds 0.2 --segment-warmup-seconds 0 --segment-server external"
CMD_SCRAPE="$PY benchmarks/scrape.py $SCRAPE_ARGS --out $OUT/scrape.json"
CMD_FRAG="$PY benchmarks/fragmentation.py $FRAG_ARGS --out $OUT/fragmentation.json"
RSS_ARGS=""; [ "$MODE" = smoke ] && RSS_ARGS="--simulate --repeats 1 --settle 0.5"
CMD_RSS="$PY benchmarks/rss_floor.py $RSS_ARGS --out $OUT/rss_floor.json"
# issue 46: the walks as models grow (100k parameters: 500k tensors with AdamW's state; 10k 2 MiB segments)
WALK_ARGS="--device cuda --params 150,1000,8000,100000 --segments 10000"
# the Trainer pairs: batch 8 x 1024 tokens keeps a run (fresh process, CUDA, model, Trainer) near 7 s, so 20
# pairs fit beside the walks and GPM; GPM: 8 pairs of 4 s segments, GPM read every second
TRAINER_ARGS="--run-seconds 2 --warmup-seconds 0.5 --tf-batch 8"
GPM_ARGS="--pairs 8 --segment-seconds 4 --slow-interval 1"
# issue 46.2 in one process: 24 pairs of 4 s segments (~54 steps of ~74 ms on an H100), a 1 s settle at every
# boundary, order A B B A; a pair ~10.5 s, so ~4.5 min with the imports, the model and a 2 s first warm-up.
# SEG_DEADLINE (320 s) stops it after the last pair that fits, so the phase ends within 6 minutes. SEG_EXTRA adds
# arguments (--sham: an A/A run through the same design; --trainer-tokens-in-a: the Trainer counts tokens in A too).
SEG_ARGS="--pairs ${SEG_PAIRS:-24} --segment-seconds 4 --segment-warmup-seconds 1 --warmup-seconds 2 --tf-batch 8"
SEG_DEADLINE="${SEG_DEADLINE:-320}"
if [ "$MODE" = quick ]; then WALK_ARGS="--device cuda --params 150,8000 --segments 1000"; GPM_ARGS="--pairs 2 --segment-seconds 2"; fi
if [ "$MODE" = smoke ]; then
  WALK_ARGS="--device cpu --params 150,2000 --segments 2000 --repeats 2"
  TRAINER_ARGS="--run-seconds 0.3 --warmup-seconds 0.05"
  GPM_ARGS="--device cpu --pairs 2 --segment-seconds 0.5 --warmup-seconds 0.1"
  SEG_ARGS="--pairs 2 --pairs-per-process 2 --segment-seconds 0.3 --segment-warmup-seconds 0.1 --warmup-seconds 0.1"
fi
[ "$MODE" = quick ] && SEG_ARGS="--pairs 4 --segment-seconds 2 --segment-warmup-seconds 0.5 --warmup-seconds 1 --tf-batch 8"
SEG_ARGS="$SEG_ARGS ${SEG_EXTRA:-}"
CMD_WALKS="$PY benchmarks/roles_walk.py $WALK_ARGS --out $OUT/walks.json"

if [ "$PLAN" = 1 ]; then
  echo "mode=$MODE parts=${PARTS[*]} out=$OUT budget=$BUDGET"
  has tests && echo "tests: $CMD_TESTS"
  W=""; has direct && W="direct"; has launch && W="${W:+$W,}launch_bound"; has launch_fresh && W="${W:+$W,}launch_bound_fresh"
  [ -n "$W" ] && echo "overhead: $(overhead_cmd "$W" "$OUT/overhead-part1.json" '<left>')"
  has transformer && echo "overhead: $(overhead_cmd transformer,transformer_full "$OUT/overhead-part2.json" '<left>' "$TF_WARMUP")"
  has direct_nopin && echo "overhead: $(overhead_cmd direct "$OUT/overhead-direct-nopin.json" 120 "--pin-core none")"
  has launch_short && echo "overhead: $(overhead_cmd launch_bound "$OUT/overhead-short.json" '<left>' "$SHORT")"
  has scrape && echo "scrape: $CMD_SCRAPE"
  has fragmentation && echo "fragmentation: $CMD_FRAG"
  has rss && echo "rss: $CMD_RSS"
  has walks && echo "walks: $CMD_WALKS"
  has trainer && echo "overhead: $(overhead_cmd trainer "$OUT/overhead-trainer.json" '<left>' "$TRAINER_ARGS")"
  has gpm && echo "gpm: $PY benchmarks/gpm_cost.py $GPM_ARGS --deadline <left> --out $OUT/gpm_cost.json"
  has trainer_segments && echo "overhead: $(overhead_cmd trainer_segments "$OUT/overhead-trainer-segments.json" "<min(left, $SEG_DEADLINE)>" "$SEG_ARGS")"
  exit 0
fi

# --- environment: what ran where ---
say "mode=$MODE parts=${PARTS[*]} budget=${BUDGET}s out=$OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
for v in $(env | grep -o '^VRAMWATCH_[A-Z_]*' || true); do unset "$v"; done  # runs set their own
WHL_SITE="$(mktemp -d /tmp/vwbench-site-XXXXXX)"
need_wheels=""
$PY -c "import pytest" 2>/dev/null || need_wheels="$need_wheels pytest pluggy iniconfig packaging pygments"
$PY -c "import nvitop_exporter" 2>/dev/null || need_wheels="$need_wheels nvitop nvitop_exporter"
if [ -n "$need_wheels" ] && [ -d .whl ]; then
  $PY - "$WHL_SITE" $need_wheels <<'EOF'
import glob, sys, zipfile
site, names = sys.argv[1], sys.argv[2:]
for n in names:
    for w in glob.glob(f".whl/{n}-*.whl"):
        zipfile.ZipFile(w).extractall(site)  # pure-python wheels work unpacked
        print("unpacked", w)
EOF
  export PYTHONPATH="$PYTHONPATH:$WHL_SITE"  # after the repo and the machine's own packages
fi
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: ${VW_BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  # versions from the packages' metadata, not by importing them (torch and transformers: ~5 s of CPU)
  $PY - <<'EOF'
import importlib.metadata as md, importlib.util, platform, re
from pathlib import Path
print("python:", platform.python_version())
for dist in ("torch", "transformers", "nvidia-ml-py", "prometheus-client", "pytest", "nvitop", "nvitop-exporter", "numpy"):
    try:
        extra = ""
        if dist == "torch":  # the CUDA it was built for, as torch.version.cuda says it
            spec = importlib.util.find_spec("torch")
            text = Path(spec.origin).with_name("version.py").read_text() if spec and spec.origin else ""
            m = re.search(r"^cuda\b[^=]*=\s*['\"]?([^'\"\n]+)", text, re.M)
            extra = f" cuda {m.group(1) if m else '?'}"
        print(f"{dist}: {md.version(dist)}{extra}")
    except Exception as e:
        print(f"{dist}: missing ({e.__class__.__name__})")
EOF
  nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,persistence_mode,pstate --format=csv 2>&1
  nvidia-smi 2>&1 | head -25
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt" | head -20

phase() {  # $1 name, $2 cap seconds, rest: command
  local name="$1" cap="$2"; shift 2
  local l; l=$(left)
  if [ "$l" -lt 20 ]; then say "SKIP $name: only ${l}s of the budget left"; echo "$name: skipped (budget)" >> "$OUT/phases.txt"; return; fi
  [ "$cap" -gt "$l" ] && cap=$l
  say "START $name (cap ${cap}s): $*"
  local t0; t0=$(date +%s)
  timeout --signal=TERM --kill-after=15 "$cap" "$@" > >(tee "$OUT/$name.log") 2> >(tee -a "$OUT/$name.log" >&2)
  local rc=$?
  say "END $name rc=$rc in $(( $(date +%s) - t0 ))s"
  echo "$name: rc=$rc seconds=$(( $(date +%s) - t0 ))" >> "$OUT/phases.txt"
}

: > "$OUT/phases.txt"
if has tests; then
  # pytest's own output goes to a file; the tail is printed (the returned output is short)
  phase pytest-gpu "$TESTS_CAP" bash -c "$CMD_TESTS > '$OUT/pytest-gpu.txt' 2>&1; rc=\$?; tail -n 40 '$OUT/pytest-gpu.txt'; exit \$rc"
fi
W=""; has direct && W="direct"; has launch && W="${W:+$W,}launch_bound"; has launch_fresh && W="${W:+$W,}launch_bound_fresh"
if [ -n "$W" ]; then
  # leave room for what follows in this invocation: scrape ~90 s, fragmentation ~100 s (quick: less)
  RESERVE=0; has scrape && RESERVE=$((RESERVE + 130)); has fragmentation && RESERVE=$((RESERVE + 105))
  has transformer && RESERVE=$((RESERVE + 150))
  [ "$MODE" = quick ] && RESERVE=$((RESERVE / 2))
  # smoke: the later phases take seconds; the full reserve left this one the 30 s floor, which a loaded
  # machine (make test's workers) overran, cutting its fixed 2 pairs to 1
  [ "$MODE" = smoke ] && RESERVE=$((RESERVE / 5))
  D=$(( $(left) - RESERVE - 30 )); [ "$D" -lt 30 ] && D=30
  phase overhead-part1 $((D + 60)) $(overhead_cmd "$W" "$OUT/overhead-part1.json" "$D")
fi
if has transformer; then
  RESERVE=0; has scrape && RESERVE=$((RESERVE + 130)); has fragmentation && RESERVE=$((RESERVE + 105))
  [ "$MODE" = quick ] && RESERVE=$((RESERVE / 2))
  [ "$MODE" = smoke ] && RESERVE=$((RESERVE / 5))
  D=$(( $(left) - RESERVE - ${TF_MARGIN:-40} )); [ "$D" -lt 30 ] && D=30
  phase overhead-part2 $((D + 60)) $(overhead_cmd transformer,transformer_full "$OUT/overhead-part2.json" "$D" "$TF_WARMUP")
fi
# part4, for attributing the direct cost and resolving the launch-bound loop below the host's drift
if has direct_nopin; then
  phase overhead-direct-nopin 150 $(overhead_cmd direct "$OUT/overhead-direct-nopin.json" 120 "--pin-core none")
fi
if has launch_short; then
  D=$(( $(left) - 40 )); [ "$D" -lt 30 ] && D=30
  phase overhead-short $((D + 60)) $(overhead_cmd launch_bound "$OUT/overhead-short.json" "$D" "$SHORT")
fi
has scrape && phase scrape 200 $CMD_SCRAPE
has fragmentation && phase fragmentation 240 $CMD_FRAG
has rss && phase rss 90 $CMD_RSS
# issue 46 (part5): the walks first (about a minute), the Trainer pairs with what GPM leaves, GPM last
has walks && phase walks 120 $CMD_WALKS
if has trainer; then
  RESERVE=0; has gpm && RESERVE=170; [ "$MODE" = smoke ] && RESERVE=30
  D=$(( $(left) - RESERVE - 20 )); [ "$D" -lt 30 ] && D=30
  phase overhead-trainer $((D + 40)) $(overhead_cmd trainer "$OUT/overhead-trainer.json" "$D" "$TRAINER_ARGS")
fi
if has gpm; then
  D=$(( $(left) - 15 )); [ "$D" -lt 20 ] && D=20
  phase gpm $((D + 30)) $PY benchmarks/gpm_cost.py $GPM_ARGS --deadline "$D" --out "$OUT/gpm_cost.json"
fi
if has trainer_segments; then
  D=$(( $(left) - 20 )); [ "$D" -gt "$SEG_DEADLINE" ] && D=$SEG_DEADLINE; [ "$D" -lt 30 ] && D=30
  phase overhead-trainer-segments $((D + 40)) $(overhead_cmd trainer_segments "$OUT/overhead-trainer-segments.json" "$D" "$SEG_ARGS")
fi
if [ -f "$OUT/overhead-part1.json" ] && [ -f "$OUT/overhead-part2.json" ]; then
  $PY benchmarks/overhead.py --merge "$OUT/overhead-part1.json" "$OUT/overhead-part2.json" --out "$OUT/overhead.json"
fi

# --- the figures, short enough for a returned output tail ---
$PY - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception:
        return None
print("=== summary ===")
def r4(v):
    return "n/a" if v is None else f"{v:.4f}"
def ms(v):
    return "n/a" if v is None else f"{v * 1000:.2f} ms"
for n in ("overhead-part1.json", "overhead-part2.json", "overhead-direct-nopin.json", "overhead-short.json",
          "overhead-trainer.json", "overhead-trainer-segments.json"):
    d = load(n)
    if not d:
        continue
    if d.get("in_process_cpu_share") is not None:
        plain = d.get("in_process_cpu_share_plain")
        print(f"{n}: in_process_cpu_share {d['in_process_cpu_share'] * 100:.4f}% of a core with watch() and tokens "
              f"(target <= 0.05%, issue 19: 0.03%), without them {'n/a' if plain is None else f'{plain * 100:.4f}%'}; "
              f"step() {d.get('step_call_us'):.3f} us (target <= 5); pinned core {d['metadata'].get('pinned_core')}; "
              f"sample interval {(d.get('direct') or {}).get('sample_interval_s')} s")
        parts = (d.get("direct") or {}).get("sample_parts_cpu_share") or {}
        if parts:
            print("  by part (% of a core): " + ", ".join(f"{k} {v * 100:.4f}" for k, v in sorted(parts.items())))
    for w in ("launch_bound", "launch_bound_fresh", "transformer", "transformer_full", "trainer", "trainer_segments"):
        o = d.get(w)
        if o and o.get("median_ratio") is not None:
            st = o["step_times"]["without"]
            print(f"{n} {w}: ratio {r4(o['median_ratio'])} [{r4(o['min_ratio'])}, {r4(o['max_ratio'])}], A/A null "
                  f"{r4(o['null_median_ratio'])} [{r4(o['null_min_ratio'])}, {r4(o['null_max_ratio'])}], "
                  f"{o['pairs']} pairs, step {ms(sorted(st)[len(st) // 2])}, truncated={o['truncated']}, "
                  f"errors={o['errors']}")
        if o and o.get("pair_ratios"):  # the segment design's intervals and neighbouring-segment nulls
            pr, aa, bb, rz = o["pair_ratios"], o["adjacent_null"]["aa"], o["adjacent_null"]["bb"], o["resolution"]
            ci = lambda f, k: f"{r4(f[k]['low'])}..{r4(f[k]['high'])}"
            above = "n/a" if rz.get("high") is None else f"{rz['rules_out_overhead_above'] * 100:.2f}%"
            print(f"  order {o['order']}; B/A median {r4(pr['median'])}, 95% sign test {ci(pr, 'sign_test_95')}, "
                  f"bootstrap {ci(pr, 'bootstrap_95')}; adjacent A/A {r4(aa['median'])} [{r4(aa['min'])}, "
                  f"{r4(aa['max'])}] n={aa['n']}, sign test {ci(aa, 'sign_test_95')}; adjacent B/B "
                  f"{r4(bb['median'])} n={bb['n']}; bracketed {r4(o['bracketed']['median'])}; rules out above {above}")
s = load("scrape.json")
if s:
    for k, v in (s.get("vramwatch") or {}).items():
        print(f"scrape vramwatch {k} rank(s): p50 {v['p50_ms']:.2f} ms, p99 {v['p99_ms']:.2f} ms, {v['bytes']} B, "
              f"cpu/scrape {ms(v['cpu_per_scrape_s'])} total (marginal {ms(v['cpu_per_scrape_net_s'])}), "
              f"idle {ms(v.get('idle_cpu_share'))} CPU per s, RSS {v.get('rss_mb')} MB")
        pr = v.get("paced_raw")
        if pr:
            print(f"  {pr['scrapes']} at {pr['rate_per_s']}/s on raw sockets: p50 {pr['p50_ms'] or 0:.2f} ms, p99 {pr['p99_ms'] or 0:.2f} ms, "
                  f"cpu/scrape {ms(pr.get('cpu_per_scrape_marginal_s'))} marginal, {ms(pr.get('cpu_per_scrape_total_s'))} total")
        b = v.get("back_to_back")
        if b:
            print(f"  back to back: {b['scrapes']} scrapes, p50 {b['p50_ms'] or 0:.2f} ms, p99 {b['p99_ms'] or 0:.2f} ms, "
                  f"cpu/scrape {ms(b['cpu_per_scrape_s'])} total (marginal {ms(b['cpu_per_scrape_net_s'])})")
        if v.get("rss_by_mapping_mb"):
            print("  RSS by mapping (MB):", ", ".join(f"{k} {x}" for k, x in v["rss_by_mapping_mb"].items()))
        c = v.get("concurrent")
        if c:
            print(f"  {c['clients']} at once: {c['scrapes']} scrapes, {c['status_503']} x 503, p50 {c['p50_ms']} ms, "
                  f"p99 {c['p99_ms']} ms, cpu/scrape {ms(c['cpu_per_scrape_s'])}")
        m = v.get("mixed")
        if m:
            print(f"  {m['clients']} at once, half Prometheus: " + "; ".join(
                f"{k} {h['requests']} requests, {h['ok']} x 200, {h['status_503']} x 503, p50 {h['p50_ms']} ms, "
                f"p99 {h['p99_ms']} ms" for k, h in ((k, m[k]) for k in ("prometheus", "plain"))))
    for row in s.get("targets") or []:
        print(f"scrape target {row['target']}: {row['figures']} -> "
              + {True: "MET", False: "NOT MET", None: "n/a"}[row["met"]])
    nv = s.get("nvitop_exporter") or {}
    print("scrape nvitop-exporter:", nv.get("skipped") or f"p50 {nv['p50_ms']:.2f} ms, p99 {nv['p99_ms']:.2f} ms, "
          f"{nv['bytes']} B, cpu/scrape {ms(nv['cpu_per_scrape_s'])} (net {ms(nv['cpu_per_scrape_net_s'])}), "
          f"RSS {nv.get('rss_mb')} MB")
    pr = nv.get("paced_raw")
    if pr:
        print(f"  {pr['scrapes']} at {pr['rate_per_s']}/s on raw sockets: p50 {pr['p50_ms'] or 0:.2f} ms, p99 {pr['p99_ms'] or 0:.2f} ms")
    b = nv.get("back_to_back")
    if b:
        print(f"  back to back: {b['scrapes']} scrapes, p50 {b['p50_ms'] or 0:.2f} ms, p99 {b['p99_ms'] or 0:.2f} ms, "
              f"cpu/scrape {ms(b['cpu_per_scrape_s'])} (net {ms(b['cpu_per_scrape_net_s'])})")
    c = nv.get("concurrent")
    if c:
        print(f"  {c['clients']} at once: {c['scrapes']} scrapes, {c['status_503']} x 503, p50 {c['p50_ms']} ms, "
              f"p99 {c['p99_ms']} ms, cpu/scrape {ms(c['cpu_per_scrape_s'])}")
    if s.get("error"):
        print("scrape ERROR:", s["error"])
f = load("fragmentation.json")
if f:
    for k, v in (f.get("comparison") or {}).items():
        g = lambda x: "n/a" if x is None else f"{x / 2**30:.2f}"
        print(f"fragmentation {k}: final alloc {g(v['final_allocated_bytes'])} GiB, reserved "
              f"{g(v['final_reserved_bytes'])} GiB, peak reserved {g(v['peak_reserved_bytes'])} GiB, max frag "
              f"{r4(v['max_fragmentation_ratio'])}, retries {v['retries']}, ooms {v['ooms']}, steps {v['steps']}")
m = load("rss_floor.json")
if m:
    for st in m.get("steps", []):
        print(f"rss step {st['step']}: " + (f"{st['rss_mb']:.1f} MB, anon {st['anon_mb']:.1f} MB" if "rss_mb" in st else f"ERROR {st.get('error')}"))
    for v in m.get("serve", []):
        print(f"rss serve {v['variant']}: " + (f"{v['rss_mb']:.1f} MB, anon {v['anon_mb']:.1f} MB" if "rss_mb" in v else f"ERROR {v.get('error')}"))
w = load("walks.json")
if w:
    for c in w.get("cases", []):
        print(f"role walk {c['params']} params ({c['tensors']} tensors, {c['device']}): {c['walk_s'] * 1000:.1f} ms a walk, "
              f"{c['per_tensor_us']:.2f} us a tensor, {c['passes']} passes, every {c['walk_every_s']:.0f} s, "
              f"{c['core_share'] * 100:.4f}% of a core, figures up to {c['age_max_s']:.0f} s old")
    sn = w.get("snapshot")
    if sn:
        print(f"allocator snapshot {sn['segments_seen']} segments: {sn['snapshot_s'] * 1000:.1f} ms, every "
              f"{sn['snapshot_every_s']:.0f} s, {sn['core_share'] * 100:.4f}% of a core, up to {sn['age_max_s']:.0f} s old "
              f"({sn['basis']})")
g = load("gpm_cost.json")
if g and g.get("summary"):
    s = g["summary"]
    print(f"gpm on/off: ratio {r4(s['median_ratio'])} [{r4(s['min_ratio'])}, {r4(s['max_ratio'])}], A/A null "
          f"{r4(s['null_median_ratio'])} [{r4(s['null_min_ratio'])}, {r4(s['null_max_ratio'])}], {s['pairs']} pairs, "
          f"within null {s['within_null']}; step {g['step']}")
print(open(os.path.join(out, "phases.txt")).read())
EOF
rm -rf "$WHL_SITE"
# PACK=1: the device tool returns at most 8 files, so pack them all into one archive (+ two small logs)
[ "${PACK:-0}" = 1 ] && ( cd "$OUT" && tar czf results.tgz --exclude results.tgz ./* && find . -maxdepth 1 -type f \
    ! -name results.tgz ! -name phases.txt ! -name environment.txt -delete ) || true
say "done; files in $OUT"

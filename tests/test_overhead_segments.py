"""overhead.py's trainer_segments: one Trainer run cut into A and B segments (issue 46.2).

On CPU with a tiny GPT-2 the figures mean nothing; what is under test is that the segments come in the
documented order, that A segments really run without vramwatch (no thread of it, its server gone and its
port refusing, the callback relayed nothing, the Trainer's token count off), that B segments run it as a
job would, and that the JSON carries the intervals the note needs.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import common
import overhead
import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_segment_orders():
    assert overhead.segment_kinds(2, "ab") == ["A", "B", "A", "B"]
    assert overhead.segment_kinds(4, "abba") == list("ABBAABBA")
    with pytest.raises(ValueError, match="abab"):
        overhead.segment_kinds(2, "abab")


def test_sign_test_interval_of_the_median():
    values = [float(v) for v in range(1, 25)]  # 24 values: the 7th smallest and the 7th largest, 97.7 %
    ci = overhead.median_interval(values)
    assert (ci["low"], ci["high"]) == (7.0, 18.0)
    tail = sum(math.comb(24, i) for i in range(7)) / 2**24
    assert ci["coverage"] == pytest.approx(1 - 2 * tail) and ci["coverage"] >= 0.95
    assert overhead.median_interval([1.0, 2.0, 3.0, 4.0, 5.0])["low"] is None  # 5 values cannot reach 95 %
    assert overhead.median_interval([float(v) for v in range(6)])["coverage"] == pytest.approx(1 - 2 / 64)
    boot = overhead.bootstrap_median_interval(values, resamples=2000)
    assert boot["low"] <= statistics.median(values) <= boot["high"] and boot["high"] - boot["low"] < 12


def test_abba_cancels_a_steady_drift_in_the_pairs_and_in_the_null():
    """Step times growing 1 % a segment, B 2 % slower than A: the pairs' median is 1.02 and the A/A null's 1.0,
    because the order inside pairs and the orientation of the neighbouring A A alternate."""
    kinds = overhead.segment_kinds(12, "abba")
    seq = [{"kind": k, "step_time_s": 0.1 * 1.01**i * (1.02 if k == "B" else 1.0)} for i, k in enumerate(kinds)]
    f = overhead.segment_figures([seq])
    assert f["order"] == ["ABBA" * 6]
    # to first order: the median of 1.02 x 1.01 and 1.02 / 1.01 is 1.02005 (a one-sided order would read 1.03)
    assert f["pair_ratios"]["n"] == 12 and f["pair_ratios"]["median"] == pytest.approx(1.02, abs=1e-3)
    aa, bb = f["adjacent_null"]["aa"], f["adjacent_null"]["bb"]
    assert aa["n"] == 5 and bb["n"] == 6
    # neighbours of one kind oriented in turn: the drift spreads them both ways instead of shifting them all
    assert sorted(aa["ratios"]) == pytest.approx([1 / 1.01] * 2 + [1.01] * 3)
    assert bb["median"] == pytest.approx(1.0, abs=1e-3)
    assert f["bracketed"]["median"] == pytest.approx(1.02, abs=1e-3)
    r = f["resolution"]
    assert r["low"] < 1.02 < r["high"] and r["rules_out_overhead_above"] == pytest.approx(r["high"] - 1)


def test_the_gate_relays_every_event_only_while_on():
    from transformers import TrainerCallback

    seen = []

    class Inner:
        def __getattr__(self, event):
            return lambda args, state, control, **kw: seen.append((event, sorted(kw))) or "control"

    gate = overhead._callback_gate(TrainerCallback)
    gate.inner = Inner()
    events = [n for n in dir(TrainerCallback) if n.startswith("on_")]
    assert {"on_step_end", "on_log", "on_train_begin", "on_evaluate"} <= set(events)
    for e in events:
        assert getattr(gate, e)(None, None, None, model=1) is None
    assert seen == []
    gate.on = True
    for e in events:
        assert getattr(gate, e)(None, None, None, logs={}) == "control"
    assert [e for e, _ in seen] == events and all(kw == ["logs"] for _, kw in seen)


@pytest.fixture(scope="module")
def trainer_segments(tmp_path_factory):
    out = tmp_path_factory.mktemp("seg") / "o.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--device", "cpu"]
    cmd += ["--workloads", "trainer_segments", "--pairs", "3", "--segment-seconds", "0.3"]
    cmd += ["--segment-warmup-seconds", "0.1", "--warmup-seconds", "0.2", "--pin-core", "none", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-3000:]
    return common.read_json(out)["trainer_segments"]


def test_trainer_segments_json_has_the_figures(trainer_segments):
    o = trainer_segments
    for k in overhead.PAIR_KEYS:
        assert o.get(k) is not None, k
    assert o["pairs"] == 3 and o["errors"] == 0 and not o["truncated"]
    assert len(o["processes"]) == 1, "one Trainer run holds every pair"
    assert o["order"] == ["ABBAAB"] and o["processes"][0]["order"] == "ABBAAB"
    assert o["model"]["loop"].startswith("transformers.Trainer")
    assert o["pair_ratios"]["ratios"] == pytest.approx(o["ratios"]), "the same pairs as summarize's"
    for k in ("sign_test_95", "bootstrap_95", "median", "min", "max", "ratios"):
        assert k in o["pair_ratios"] and k in o["adjacent_null"]["aa"], k
    assert o["adjacent_null"]["aa"]["n"] == 1 and o["adjacent_null"]["bb"]["n"] == 1
    assert set(o["resolution"]) >= {"low", "high", "interval"}
    assert o["segment_seconds"] == 0.3 and o["settle_seconds"] == 0.1


def test_a_segments_run_without_vramwatch_and_b_segments_with_it(trainer_segments):
    a, b = trainer_segments["runs"]["without"], trainer_segments["runs"]["with"]
    segs = sorted(a + b, key=lambda s: s["segment"])
    assert [s["kind"] for s in segs] == list("ABBAAB")
    for s in segs:
        assert s["steps"] >= 1 and s["settle_steps"] >= 3 and s["step_time_s"] > 0
    for s in a:
        p = s["probe"]
        assert p["vramwatch_threads"] == [] and not p["vramwatch_started"], s
        assert not s["trainer_counts_tokens"] and s["tokens_counted"] == 0
        if s["segment"] > 0:  # after a B segment: its server is gone and its port refuses
            assert p["server_port_answers"] is False and p["server_alive"] is False, s
    assert segs[0]["vramwatch_loaded"] is False, "the first A segment runs before vramwatch is imported"
    for s in b:
        p = s["probe"]
        assert "vramwatch-sampler" in p["vramwatch_threads"] and p["vramwatch_started"], s
        assert p["server_port_answers"] and p["server_alive"] and p["server_port"] == s["server_port"]
        assert s["tokens_counted"] == s["steps"] * 2 * 16, "batch 2 x 16 tokens a step (tiny)"
        assert s["trainer_counts_tokens"] and s["scrape_url"].endswith(f":{s['server_port']}/metrics")
        assert s["server_up"] if s["switched"] else "server_up" not in s
        assert "vramwatch-sampler" in s["vramwatch_threads_cpu_s"]
    # abba: B segments 1 and 2 share one start; segment 5 starts vramwatch afresh on a new server
    assert [s["switched"] for s in segs] == [False, True, False, True, False, True]
    assert b[0]["server_pid"] == b[1]["server_pid"] != b[2]["server_pid"]


def _plan_part6(**env: str) -> str:
    p = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), "--plan", "--full", "part6"],
        capture_output=True,
        text=True,
        env=dict(os.environ, **env),
        timeout=30,
    )
    assert p.returncode == 0, p.stderr
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("overhead:")]
    return line.rstrip()


def test_run_gpu_part6_runs_the_segments_under_its_own_deadline(tmp_path):
    line = _plan_part6(OUT=str(tmp_path), SEG_DEADLINE="300")
    assert "--workloads trainer_segments" in line and "<min(left, 300)>" in line
    assert line.endswith("--pairs 24 --segment-seconds 4 --segment-warmup-seconds 1 --warmup-seconds 2 --tf-batch 8")
    assert _plan_part6(OUT=str(tmp_path), SEG_EXTRA="--sham").endswith("--tf-batch 8 --sham")

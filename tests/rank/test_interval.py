"""The sample interval: its default (2 s, issue 19's in-process budget), the docs that state it, and the
parts of a rank that follow it (the sampler's cadence, the loss reads that land on its samples)."""

from __future__ import annotations

import time
from pathlib import Path

import vramwatch
from vramwatch import spool
from vramwatch.config import FIELDS, Settings

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_interval_is_the_one_the_docs_state():
    n = Settings().interval
    assert n == 2.0, "the in-process cost (benchmarks/RESULTS.md, 2026-12-03 CPU direct) is measured at 2 s"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"| `interval` | `VRAMWATCH_INTERVAL` | `{n}` |" in readme, "the settings table (vramwatch docs)"
    assert f"sampler thread, every {n:g} s:" in readme, "the diagram in How it works"
    nothing_lost = (ROOT / "docs" / "nothing-lost.md").read_text(encoding="utf-8")
    assert nothing_lost.count(f"`interval`, {n:g} s by default") == 2, "the grace window and the observer's attach"
    # what a user trades: the help says how old a scraped sample may be and that an OOM does not wait
    doc = FIELDS["interval"].metadata["doc"]
    assert "at most this old" in doc and "OOM" in doc


def test_a_rank_at_defaults_samples_and_reads_its_loss_at_the_interval(tmp_path):
    h = vramwatch.start(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"))
    try:
        n = Settings().interval
        assert h.settings.interval == n and h._thread.interval == n
        # the loss and grad-norm reads round their gap to the samples that make them
        assert [r.sample_interval for r in h.heartbeat._reads] == [n, n]
    finally:
        vramwatch.stop()


def test_an_interval_set_by_the_job_reaches_the_sampler_and_the_loss_reads(start_rank):
    h = start_rank(interval=0.25)
    assert h._thread.interval == 0.25
    assert [r.sample_interval for r in h.heartbeat._reads] == [0.25, 0.25]


def test_at_the_default_interval_a_scraped_sample_is_at_most_one_interval_old(tmp_path):
    # what the setting's help promises a user: the newest sample in the spool is never older than the
    # interval (plus a tick's own time), while the job steps; its heartbeat carries the newest step
    h = vramwatch.start(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"))
    try:
        n = h.settings.interval
        h.sim.init(0)
        ages = []
        end = time.monotonic() + 2.5 * n
        while time.monotonic() < end:
            vramwatch.step(loss=1.0)
            (s,) = spool.read_samples(h.spool_dir, 8)
            ages.append(s.age(time.time()))
            time.sleep(0.05)
        assert max(ages) <= n + 0.5, max(ages)
        assert max(ages) >= 0.5 * n, "samples are interval apart, not published at every step"
        (s,) = spool.read_samples(h.spool_dir, 8)
        assert s.heartbeat.steps >= 1 and s.heartbeat.steps <= len(ages)
    finally:
        vramwatch.stop()

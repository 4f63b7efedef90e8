"""Dead ranks' final samples in the exposition: one label set each, counters carried across restarts, the cap."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, generate_latest
from samples import rank_sample

from vramwatch import spool
from vramwatch.server.collectors import ScrapeContext, ranks
from vramwatch.server.collectors.rank_view import RankView
from vramwatch.spool import files

OOMS = "torch_cuda_memory_ooms_total"
LAST = "torch_cuda_memory_last_oom_requested_bytes"


class Proc:
    """A fake rank process: its sample file, and its lock held until it dies."""

    def __init__(self, d: str, rank: int, pid: int, job_id: str = "") -> None:
        self.path = files.sample_path(d, files.rank_stem(rank, pid, job_id))
        self.rank, self.pid, self.job_id = rank, pid, job_id
        self.lock = files.hold_lock(files.lock_path_of(self.path))

    def publish(self, t: float, ooms: float = 0.0, uuid: str = "GPU-0", **values: float) -> Proc:
        values = {OOMS: ooms, "torch_cuda_memory_allocated_bytes": 1.0, **values}
        s = rank_sample(
            self.rank, local_rank=0, world_size=8, pid=self.pid, time=t, uuid=uuid, values=values, job_id=self.job_id
        )
        with open(self.path, "wb") as fh:
            fh.write(files.frame(spool.encode_sample(s)))
        return self

    def die(self) -> None:
        assert self.lock is not None
        os.close(self.lock)
        self.lock = None


def _scrape(view: RankView, now: float) -> dict[str, list[tuple[dict[str, str], float]]]:
    read, carried = view.read(now)
    ctx = ScrapeContext(tuple(read.live), now, "node-a", tuple(read.final), carried)

    class _Static:
        def collect(self):
            return list(ranks.families(ctx))

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Static())
    text = generate_latest(reg).decode()
    series = [line.rsplit(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"]
    assert len(series) == len(set(series)), "a label set repeated in one exposition"
    from harness import parse_metrics

    return parse_metrics(text)


def _values(m, name: str) -> dict[str, float]:
    return {labels["rank"]: v for labels, v in m.get(name, [])}


def _by_job(m, name: str) -> dict[tuple[str, str], float]:
    return {(labels["job_id"], labels["rank"]): v for labels, v in m.get(name, [])}


def test_the_same_rank_of_two_jobs_is_two_series_on_one_gpu(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 0, 100, "jobA").publish(100.0, ooms=1.0)
    Proc(d, 0, 200, "jobB").publish(100.5, ooms=2.0)
    m = _scrape(view, 101.0)
    assert _by_job(m, OOMS) == {("jobA", "0"): 1.0, ("jobB", "0"): 2.0}
    assert _by_job(m, "vramwatch_rank_info") == {("jobA", "0"): 1.0, ("jobB", "0"): 1.0}


def test_a_restart_keeps_its_job_and_its_count_another_jobs_rank_carries_nothing(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    a = Proc(d, 0, 100, "jobA").publish(100.0, ooms=1.0)
    b = Proc(d, 0, 200, "jobB").publish(100.0)
    _scrape(view, 100.5)
    a.die()  # jobA's rank 0 OOMed and died; jobB's rank 0 lives on
    Proc(d, 0, 101, "jobA").publish(101.0)  # the restart: the same job, a new process
    m = _scrape(view, 101.5)
    assert _by_job(m, OOMS) == {("jobA", "0"): 1.0, ("jobB", "0"): 0.0}
    b.die()
    Proc(d, 0, 300, "jobC").publish(102.0)  # another job's rank 0 after jobB's died: no carry into it
    m = _scrape(view, 102.5)
    assert _by_job(m, OOMS) == {("jobA", "0"): 1.0, ("jobB", "0"): 0.0, ("jobC", "0"): 0.0}


def test_final_samples_have_a_cap_of_their_own_across_jobs(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 2, 30.0)
    Proc(d, 0, 100, "jobA").publish(100.0)
    Proc(d, 0, 200, "jobB").publish(100.5)
    Proc(d, 1, 101, "jobA").publish(100.0).die()
    Proc(d, 2, 102, "jobA").publish(99.0).die()  # the oldest final sample: the one dropped
    Proc(d, 1, 201, "jobB").publish(100.2).die()
    m = _scrape(view, 101.0)
    # two live ranks fill the live cap; the final samples have a cap of their own, of two jobs together
    assert set(_by_job(m, "vramwatch_rank_info")) == {("jobA", "0"), ("jobB", "0"), ("jobA", "1"), ("jobB", "1")}
    assert view.dropped["dead_rank"] == 1 and view.dropped["rank"] == 0


def test_a_dead_ranks_final_sample_exports_its_counters_and_last_oom_not_its_memory(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    p = Proc(d, 0, 100).publish(100.0)
    assert _values(_scrape(view, 100.5), OOMS) == {"0": 0.0}
    p.publish(101.0, ooms=1.0, **{LAST: 4096.0})
    p.die()
    for t in (102.0, 110.0, 130.5):  # any number of scrapes inside the window
        m = _scrape(view, t)
        assert _values(m, OOMS) == {"0": 1.0} and _values(m, LAST) == {"0": 4096.0}
        assert _values(m, "vramwatch_training_steps_total") == {"0": 0.0}
        assert "torch_cuda_memory_allocated_bytes" not in m and "vramwatch_sample_age_seconds" not in m
    assert _values(_scrape(view, 131.5), OOMS) == {}  # the window is over


def test_a_restart_within_one_interval_goes_on_from_the_dead_ones_count(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    a = Proc(d, 0, 100).publish(100.0)
    assert _values(_scrape(view, 100.0), OOMS) == {"0": 0.0}
    a.publish(101.0, ooms=1.0, **{LAST: 4096.0})
    a.die()
    b = Proc(d, 0, 200).publish(101.5)  # same rank number, new pid, counters from 0; no scrape came between
    m = _scrape(view, 102.0)
    assert _values(m, OOMS) == {"0": 1.0}, "the new process's series goes on from the dead one's count"
    assert _values(m, LAST) == {"0": 4096.0}, "the last OOM's values stay while the new one has had none"
    assert _values(m, "torch_cuda_memory_allocated_bytes") == {"0": 1.0}  # the live one's memory
    b.publish(140.0, ooms=0.0)
    assert _values(_scrape(view, 140.0), OOMS) == {"0": 1.0}, "carried after the dead one's window too"
    # a crash loop: b OOMs twice and dies, c takes over
    b.publish(141.0, ooms=2.0)
    b.die()
    assert _values(_scrape(view, 141.5), OOMS) == {"0": 3.0}
    c = Proc(d, 0, 300).publish(142.0)
    assert _values(_scrape(view, 142.0), OOMS) == {"0": 3.0}
    c.die()
    assert _values(_scrape(view, 150.0), OOMS) == {"0": 3.0}
    assert _values(_scrape(view, 200.0), OOMS) == {}, "nobody exports it: the series ends, nothing carried"
    Proc(d, 0, 400).publish(201.0)
    assert _values(_scrape(view, 201.0), OOMS) == {"0": 0.0}


def test_a_restart_on_another_gpu_keeps_the_dead_ones_device_for_its_window(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    a = Proc(d, 0, 100).publish(100.0, ooms=1.0)
    a.die()
    Proc(d, 0, 200).publish(101.0, uuid="GPU-1")
    m = _scrape(view, 101.0)
    assert sorted((lab["uuid"], v) for lab, v in m[OOMS]) == [("GPU-0", 1.0), ("GPU-1", 0.0)]
    assert _values(m, "vramwatch_training_steps_total") == {"0": 0.0}  # one rank label set: the live one's


def test_a_scrape_counts_a_dead_process_once_however_many_scrapes_read_it(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 0, 100).publish(100.0, ooms=1.0).die()
    live = Proc(d, 0, 200).publish(100.5)
    for t in range(101, 120):
        assert _values(_scrape(view, float(t)), OOMS) == {"0": 1.0}
    live.die()


def test_dead_ranks_beyond_their_cap_are_dropped_oldest_first_and_counted(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 4, 3600.0)
    live = [Proc(d, r, 1000 + r).publish(100.0) for r in range(2)]
    for r in range(10, 5010):
        Proc(d, r, r).publish(50.0 + r / 1000).die()
    m = _scrape(view, 100.0)
    assert sorted(_values(m, OOMS), key=int) == ["0", "1", "5006", "5007", "5008", "5009"]
    assert view.dropped["dead_rank"] == 4996
    assert len(m["torch_cuda_memory_allocated_bytes"]) == 2
    for p in live:
        p.die()


def test_the_same_process_publishing_again_is_not_counted_twice(tmp_path):
    # stop() then start() in one process (a notebook): torch's counters go on by themselves
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    a = Proc(d, 0, 100).publish(100.0, ooms=1.0)
    a.die()
    assert _values(_scrape(view, 101.0), OOMS) == {"0": 1.0}
    again = Proc(d, 0, 100).publish(102.0, ooms=1.0)
    assert _values(_scrape(view, 102.0), OOMS) == {"0": 1.0}
    again.publish(103.0, ooms=2.0)
    again.die()
    assert _values(_scrape(view, 104.0), OOMS) == {"0": 2.0}

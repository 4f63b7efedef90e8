"""The ranks' families: what a live rank's sample becomes on /metrics, through the real spool and codec.

Each rank publishes through the spool's own framing and codec; the view reads it back as the server
does and :func:`ranks.families` renders it. Assertions pick series by the labels they name (a label
added later, such as a job id, leaves them standing).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from samples import rank_sample

from harness import parse_metrics
from vramwatch import spool
from vramwatch.monitoring import contract
from vramwatch.server.collectors import ScrapeContext, ranks
from vramwatch.server.collectors.rank_view import RankView
from vramwatch.spool import files

OOMS = "torch_cuda_memory_ooms_total"
RETRIES = "torch_cuda_memory_alloc_retries_total"
ALLOC = "torch_cuda_memory_allocated_bytes"
LAST_REQ = "torch_cuda_memory_last_oom_requested_bytes"
LAST_FREE = "torch_cuda_memory_last_oom_free_bytes"
Series = dict[str, list[tuple[dict[str, str], float]]]


class Proc:
    """A rank process: its sample file in the spool, its lock held until it dies."""

    def __init__(self, d: str, rank: int, pid: int, local_rank: int | None = None) -> None:
        self.path = files.sample_path(d, files.rank_stem(rank, pid))
        self.rank, self.pid = rank, pid
        self.local_rank = rank if local_rank is None else local_rank
        self.lock: int | None = files.hold_lock(files.lock_path_of(self.path))

    def publish(self, t: float, devices: tuple[spool.DeviceSample, ...] = (), **kw: Any) -> Proc:
        kw.setdefault("world_size", 8)
        kw.setdefault("hostname", "node-a")
        s = rank_sample(self.rank, local_rank=self.local_rank, pid=self.pid, time=t, devices=devices, **kw)
        with open(self.path, "wb") as fh:
            fh.write(files.frame(spool.encode_sample(s)))
        return self

    def die(self) -> None:
        assert self.lock is not None
        os.close(self.lock)
        self.lock = None


def dev(uuid: str = "GPU-0", device: int = 0, roles: dict[str, float] | None = None, **values: float):
    return spool.DeviceSample(device, uuid, values, roles or {})


def render(ctx: ScrapeContext, failed=None) -> tuple[str, Series]:
    fams = list(ranks.families(ctx, failed))

    class _Static:
        def collect(self):
            return fams

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Static())
    text = generate_latest(reg).decode()
    series = [line.rsplit(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"]
    assert len(series) == len(set(series)), "a label set repeated in one exposition"
    return text, parse_metrics(text)


def scrape(view: RankView, now: float) -> Series:
    read, carried = view.read(now)
    return render(ScrapeContext(tuple(read.live), now, "node-a", tuple(read.final), carried))[1]


def pick(m: Series, name: str, **labels: str) -> list[float]:
    return [v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]


def one(m: Series, name: str, **labels: str) -> float:
    got = pick(m, name, **labels)
    assert len(got) == 1, f"{name}{labels}: {got}"
    return got[0]


def by_rank(m: Series, name: str) -> dict[str, float]:
    return {lab["rank"]: v for lab, v in m.get(name, [])}


FULL_VALUES = {name: float(i + 1) for i, name in enumerate(ranks._DEVICE_FAMILIES)}


def test_a_live_rank_exports_every_family_with_its_values_and_labels(tmp_path):
    d = str(tmp_path)
    roles = {"parameters": 10.0, "gradients": 20.0, "optimizer_state": 30.0, "other": 40.0}
    hb = spool.HeartbeatSnapshot(
        steps=12,
        last_step_time=990.0,
        buckets=(0.1, 1.0),
        counts=(2, 3, 1),
        sum=4.5,
        loss=2.25,
        grad_norm=0.75,
        tokens=4096.0,
        samples=64.0,
    )
    Proc(d, 3, 100, local_rank=1).publish(
        995.0,
        devices=(dev("GPU-a", 1, roles, **FULL_VALUES),),
        allocator_info=spool.AllocatorInfo("native", "True", "0.8", "512"),
        heartbeat=hb,
        oom_snapshot=spool.OomSnapshot("/snap/oom-1.pickle", 980.0),
        flops_per_token=6e9,
        world_size=16,
        hostname="trainer-7",
    )
    m = scrape(RankView(d, 64, 30.0), 1000.0)
    labels = dict(uuid="GPU-a", device="1", rank="3", local_rank="1", job_id="")
    for name, value in FULL_VALUES.items():
        assert pick(m, name, **labels) == [value], name
    for role, v in roles.items():
        assert one(m, "vramwatch_memory_role_bytes", role=role, **labels) == v
    rl = dict(rank="3", local_rank="1", job_id="")
    info = [lab for lab, _ in m["torch_cuda_allocator_info"]]
    assert len(info) == 1 and {k: info[0][k] for k in contract.spec("torch_cuda_allocator_info").labels} == {
        **rl,
        "backend": "native",
        "expandable_segments": "True",
        "garbage_collection_threshold": "0.8",
        "max_split_size_mb": "512",
    }
    assert one(m, "vramwatch_oom_snapshot_info", path="/snap/oom-1.pickle", **rl) == 1.0
    assert one(m, "vramwatch_oom_snapshot_timestamp_seconds", **rl) == 980.0
    assert one(m, "vramwatch_training_steps_total", **rl) == 12.0
    assert one(m, "vramwatch_training_tokens_total", **rl) == 4096.0
    assert one(m, "vramwatch_training_samples_total", **rl) == 64.0
    assert one(m, "vramwatch_model_flops_per_token", **rl) == 6e9
    assert one(m, "vramwatch_training_last_step_timestamp_seconds", **rl) == 990.0
    assert one(m, "vramwatch_training_loss", **rl) == 2.25
    assert one(m, "vramwatch_training_grad_norm", **rl) == 0.75
    assert one(m, "vramwatch_sample_age_seconds", **rl) == 5.0
    assert one(m, "vramwatch_rank_info", world_size="16", hostname="trainer-7", **rl) == 1.0
    # the histogram: cumulative buckets, +Inf last, its count and sum
    h = "vramwatch_training_step_duration_seconds"
    assert {lab["le"]: v for lab, v in m[h + "_bucket"]} == {"0.1": 2.0, "1.0": 5.0, "+Inf": 6.0}
    assert one(m, h + "_count", **rl) == 6.0 and one(m, h + "_sum", **rl) == 4.5


def test_what_a_rank_does_not_report_is_absent_not_zero(tmp_path):
    d = str(tmp_path)
    # only some roles, no allocator info, snapshot, tokens, samples, flops, loss, grad norm or step yet
    Proc(d, 0, 100).publish(
        1000.0,
        devices=(dev(roles={"parameters": 5.0}, **{ALLOC: 7.0}),),
    )
    m = scrape(RankView(d, 64, 30.0), 1000.0)
    assert [lab["role"] for lab, _ in m["vramwatch_memory_role_bytes"]] == ["parameters"]
    assert by_rank(m, ALLOC) == {"0": 7.0}
    assert by_rank(m, "vramwatch_training_steps_total") == {"0": 0.0}
    for absent in (
        "torch_cuda_allocator_info",
        "vramwatch_oom_snapshot_info",
        "vramwatch_oom_snapshot_timestamp_seconds",
        "vramwatch_training_tokens_total",
        "vramwatch_training_samples_total",
        "vramwatch_model_flops_per_token",
        "vramwatch_training_last_step_timestamp_seconds",
        "vramwatch_training_step_duration_seconds_bucket",
        "vramwatch_training_loss",
        "vramwatch_training_grad_norm",
        OOMS,
    ):
        assert absent not in m, absent
    assert by_rank(m, "vramwatch_sample_age_seconds") == {"0": 0.0}


def test_zero_valued_optional_readings_are_exported(tmp_path):
    # 0 tokens, a loss of 0.0 and a zero grad norm are readings, not "not reported"
    d = str(tmp_path)
    hb = spool.HeartbeatSnapshot(steps=1, loss=0.0, grad_norm=0.0, tokens=0.0, samples=0.0)
    Proc(d, 0, 100).publish(1000.0, heartbeat=hb, flops_per_token=0.0)
    m = scrape(RankView(d, 64, 30.0), 1000.0)
    for name in (
        "vramwatch_training_loss",
        "vramwatch_training_grad_norm",
        "vramwatch_training_tokens_total",
        "vramwatch_training_samples_total",
        "vramwatch_model_flops_per_token",
    ):
        assert by_rank(m, name) == {"0": 0.0}, name


def test_the_collector_bounds_what_the_codec_should_have_bounded(rank_sample):
    # the second line: a sample built in-process (not through the codec) with a long path and hostname,
    # a mis-shaped histogram, and a time in the future
    long_path = "/s/" + "p" * 400
    s = rank_sample(
        0,
        hostname="h" * 300,
        pid=100,
        time=1010.0,
        oom_snapshot=spool.OomSnapshot(long_path, 1.0),
        heartbeat=spool.HeartbeatSnapshot(steps=1, buckets=(0.1,), counts=(1,)),
    )
    _, m = render(ScrapeContext((s,), 1000.0, "n"))
    assert by_rank(m, "vramwatch_sample_age_seconds") == {"0": 0.0}
    assert [lab["hostname"] for lab, _ in m["vramwatch_rank_info"]] == ["h" * 128]
    assert [lab["path"] for lab, _ in m["vramwatch_oom_snapshot_info"]] == [long_path[:256]]
    assert "vramwatch_training_step_duration_seconds_bucket" not in m


def test_several_ranks_and_devices_each_get_their_own_series(tmp_path):
    d = str(tmp_path)
    Proc(d, 0, 100).publish(1000.0, devices=(dev("GPU-0", 0, **{ALLOC: 1.0}), dev("GPU-1", 1, **{ALLOC: 2.0})))
    Proc(d, 1, 101).publish(1000.0, devices=(dev("GPU-2", 0, **{ALLOC: 3.0}),))
    m = scrape(RankView(d, 64, 30.0), 1000.0)
    assert sorted((lab["rank"], lab["uuid"], lab["device"], v) for lab, v in m[ALLOC]) == [
        ("0", "GPU-0", "0", 1.0),
        ("0", "GPU-1", "1", 2.0),
        ("1", "GPU-2", "0", 3.0),
    ]
    assert sorted(by_rank(m, "vramwatch_rank_info")) == ["0", "1"]


def test_values_outside_the_contract_are_not_exported(tmp_path):
    d = str(tmp_path)
    Proc(d, 0, 100).publish(1000.0, devices=(dev(**{ALLOC: 1.0, "gpu_power_watts": 5.0}),))
    m = scrape(RankView(d, 64, 30.0), 1000.0)
    assert "gpu_power_watts" not in m and by_rank(m, ALLOC) == {"0": 1.0}


def _sample(rank: int, hostname: Any = "node-a", **kw: Any) -> spool.RankSample:
    return rank_sample(rank, world_size=2, hostname=hostname, pid=100 + rank, time=1000.0, **kw)


def test_a_rank_that_fails_to_render_is_left_out_alone_and_reported():
    good = _sample(0, devices=(dev(**{ALLOC: 1.0}),))
    bad = _sample(1, hostname=None, devices=(dev("GPU-1", **{ALLOC: 2.0}),))  # no hostname: rank_info fails
    told: list[tuple[int, str]] = []
    _, m = render(ScrapeContext((bad, good), 1000.0, "n"), lambda s, e: told.append((s.rank, type(e).__name__)))
    assert told == [(1, "TypeError")]
    assert by_rank(m, ALLOC) == {"0": 1.0}, "nothing of the failed rank, all of the other"
    assert by_rank(m, "vramwatch_rank_info") == {"0": 1.0}
    assert by_rank(render(ScrapeContext((bad, good), 1000.0, "n"))[1], ALLOC) == {"0": 1.0}  # no callback


def test_families_come_in_contract_order_device_families_first():
    fams = list(ranks.families(ScrapeContext((), 0.0, "n")))
    expected = [contract.family(n).name for n in ranks._DEVICE_FAMILIES + ranks._RANK_FAMILIES]
    assert [f.name for f in fams] == expected and not any(f.samples for f in fams)


def test_the_age_family_and_rank_collector_health():
    a = _sample(0, collectors={"allocator": spool.CollectorHealth(1, 2, 0.5)})
    b = rank_sample(1, world_size=2, hostname="n", pid=9, time=990.0)
    age = ranks.age_family((a, b), 1000.0)
    assert age.name == "vramwatch_sample_age_seconds"
    assert {s.labels["rank"]: s.value for s in age.samples} == {"0": 0.0, "1": 10.0}
    ctx = ScrapeContext((a, b), 1000.0, "n", final=(_sample(5, collectors={"x": spool.CollectorHealth(0, 1, 0)}),))
    assert list(ranks.rank_collector_health(ctx)) == [("allocator", "0", "", spool.CollectorHealth(1, 2, 0.5))]


# --- dead ranks: the final sample, the newest winning, counters carried ---


def test_a_dead_rank_exports_its_steps_snapshot_and_info_but_no_heartbeat_or_memory(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    hb = spool.HeartbeatSnapshot(steps=40, last_step_time=999.0, buckets=(1.0,), counts=(1, 0), loss=1.0, tokens=9.0)
    p = Proc(d, 2, 100).publish(
        1000.0,
        devices=(dev(roles={"parameters": 1.0}, **{ALLOC: 5.0, OOMS: 1.0, RETRIES: 3.0, LAST_REQ: 64.0}),),
        heartbeat=hb,
        oom_snapshot=spool.OomSnapshot("/snap/a", 999.5),
        allocator_info=spool.AllocatorInfo("native", "False", "0", "0"),
        world_size=4,
    )
    p.die()
    m = scrape(view, 1001.0)
    assert by_rank(m, "vramwatch_training_steps_total") == {"2": 40.0}
    assert by_rank(m, OOMS) == {"2": 1.0} and by_rank(m, RETRIES) == {"2": 3.0} and by_rank(m, LAST_REQ) == {"2": 64.0}
    assert [lab["path"] for lab, _ in m["vramwatch_oom_snapshot_info"]] == ["/snap/a"]
    assert by_rank(m, "vramwatch_oom_snapshot_timestamp_seconds") == {"2": 999.5}
    assert [lab["world_size"] for lab, _ in m["vramwatch_rank_info"]] == ["4"]
    for gone in (
        ALLOC,
        "vramwatch_memory_role_bytes",
        "vramwatch_sample_age_seconds",
        "vramwatch_training_last_step_timestamp_seconds",
        "vramwatch_training_step_duration_seconds_bucket",
        "vramwatch_training_loss",
        "vramwatch_training_tokens_total",
        "torch_cuda_allocator_info",
    ):
        assert gone not in m, gone


def test_of_two_dead_processes_of_one_rank_the_newest_is_shown_and_both_counted(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    old = Proc(d, 0, 100).publish(
        1000.0,
        devices=(dev(**{OOMS: 1.0, LAST_REQ: 64.0, LAST_FREE: 8.0}),),
        heartbeat=spool.HeartbeatSnapshot(steps=5),
        oom_snapshot=spool.OomSnapshot("/snap/old", 1000.0),
    )
    old.die()
    new = Proc(d, 0, 200).publish(
        1005.0,
        devices=(dev(**{OOMS: 0.0, RETRIES: 2.0}),),  # no OOM of its own (yet)
        heartbeat=spool.HeartbeatSnapshot(steps=9),
        world_size=2,
    )
    new.die()
    m = scrape(view, 1006.0)
    assert by_rank(m, "vramwatch_training_steps_total") == {"0": 9.0}, "the newest final sample"
    assert [lab["world_size"] for lab, _ in m["vramwatch_rank_info"]] == ["2"]
    assert by_rank(m, OOMS) == {"0": 1.0}, "both dead processes' OOMs"
    assert by_rank(m, RETRIES) == {"0": 2.0}
    assert by_rank(m, LAST_REQ) == {"0": 64.0} and by_rank(m, LAST_FREE) == {"0": 8.0}, "the older one's last OOM"
    assert [lab["path"] for lab, _ in m["vramwatch_oom_snapshot_info"]] == ["/snap/old"]


def test_the_newest_oom_snapshot_wins_between_a_live_rank_and_its_dead_predecessor(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 0, 100).publish(1000.0, oom_snapshot=spool.OomSnapshot("/snap/dead", 1000.0)).die()
    live = Proc(d, 0, 200).publish(1001.0, oom_snapshot=spool.OomSnapshot("/snap/older", 900.0))
    m = scrape(view, 1002.0)
    assert [lab["path"] for lab, _ in m["vramwatch_oom_snapshot_info"]] == ["/snap/dead"]
    live.publish(1003.0, oom_snapshot=spool.OomSnapshot("/snap/live", 1002.5))
    m = scrape(view, 1004.0)
    assert [lab["path"] for lab, _ in m["vramwatch_oom_snapshot_info"]] == ["/snap/live"]
    assert by_rank(m, "vramwatch_oom_snapshot_timestamp_seconds") == {"0": 1002.5}
    live.publish(1005.0)  # the live one has none: the dead one's is still the rank's newest
    m = scrape(view, 1005.0)
    assert [lab["path"] for lab, _ in m["vramwatch_oom_snapshot_info"]] == ["/snap/dead"]


def test_a_live_ranks_own_last_oom_wins_over_its_dead_predecessors(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 0, 100).publish(1000.0, devices=(dev(**{OOMS: 1.0, LAST_REQ: 64.0}),)).die()
    Proc(d, 0, 200).publish(1001.0, devices=(dev(**{OOMS: 2.0, LAST_REQ: 128.0, ALLOC: 1.0}),))
    m = scrape(view, 1002.0)
    assert by_rank(m, LAST_REQ) == {"0": 128.0}
    assert by_rank(m, OOMS) == {"0": 3.0}
    assert by_rank(m, "torch_cuda_memory_last_oom_free_bytes") == {}, "nobody reported it"


def test_a_dead_rank_beside_a_live_other_rank_keeps_its_own_series(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 0, 100).publish(1000.0, devices=(dev("GPU-0", **{OOMS: 1.0}),), heartbeat=spool.HeartbeatSnapshot(3))
    dead = Proc(d, 1, 101).publish(1000.0, devices=(dev("GPU-1", **{OOMS: 2.0}),), heartbeat=spool.HeartbeatSnapshot(4))
    dead.die()
    m = scrape(view, 1001.0)
    assert by_rank(m, OOMS) == {"0": 1.0, "1": 2.0}
    assert by_rank(m, "vramwatch_training_steps_total") == {"0": 3.0, "1": 4.0}
    assert by_rank(m, "vramwatch_sample_age_seconds") == {"0": 1.0}, "only the live rank has an age"


def test_the_dead_ranks_local_rank_and_device_stay_its_own(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 4, 100, local_rank=2).publish(1000.0, devices=(dev("GPU-3", 3, **{OOMS: 1.0}),)).die()
    m = scrape(view, 1001.0)
    assert [(lab["uuid"], lab["device"], lab["rank"], lab["local_rank"], v) for lab, v in m[OOMS]] == [
        ("GPU-3", "3", "4", "2", 1.0)
    ]
    assert [(lab["rank"], lab["local_rank"]) for lab, _ in m["vramwatch_rank_info"]] == [("4", "2")]


# --- the view: counters carried, the grace, the cap ---


def test_an_evicted_dead_process_still_carries_its_count_to_its_successor(tmp_path):
    # the cap leaves room for one final sample: the older dead one's sample is dropped, its OOM is not
    d = str(tmp_path)
    view = RankView(d, 1, 30.0)
    Proc(d, 0, 100).publish(1000.0, devices=(dev(**{OOMS: 1.0}),)).die()
    Proc(d, 0, 150).publish(1000.5, devices=(dev(**{OOMS: 1.0}),)).die()
    Proc(d, 0, 200).publish(1001.0, devices=(dev(**{OOMS: 0.0}),))
    m = scrape(view, 1002.0)
    assert by_rank(m, OOMS) == {"0": 2.0}
    assert view.dropped["dead_rank"] == 1
    assert by_rank(scrape(view, 1003.0), OOMS) == {"0": 2.0}, "and only once"


def test_only_counters_are_carried(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 0, 100).publish(1000.0, devices=(dev(**{OOMS: 1.0, RETRIES: 2.0, ALLOC: 50.0}),)).die()
    Proc(d, 0, 200).publish(1001.0, devices=(dev(**{OOMS: 0.0, RETRIES: 1.0, ALLOC: 7.0}),))
    m = scrape(view, 1002.0)
    assert by_rank(m, ALLOC) == {"0": 7.0}, "a gauge is the live process's own"
    assert by_rank(m, RETRIES) == {"0": 3.0} and by_rank(m, OOMS) == {"0": 1.0}


def test_the_grace_window_is_the_views_and_counted_from_the_final_sample(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 5.0)
    Proc(d, 0, 100).publish(1000.0, devices=(dev(**{OOMS: 1.0}),)).die()
    assert by_rank(scrape(view, 1004.5), OOMS) == {"0": 1.0}
    assert by_rank(scrape(view, 1005.5), OOMS) == {}


def test_the_cap_bounds_live_ranks_and_counts_what_it_drops(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 2, 30.0)
    procs = [Proc(d, r, 100 + r).publish(1000.0, devices=(dev(**{ALLOC: float(r)}),)) for r in range(3)]
    m = scrape(view, 1000.0)
    assert sorted(by_rank(m, ALLOC)) == ["0", "1"]
    assert view.dropped["rank"] == 1
    scrape(view, 1001.0)
    assert view.dropped["rank"] == 2, "counted per read"
    assert set(view.dropped) >= {"rank", "dead_rank"} and view.dropped["dead_rank"] == 0
    for p in procs:
        p.die()


def test_the_carried_counters_handed_out_are_a_copy(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 0, 100).publish(1000.0, devices=(dev(**{OOMS: 1.0}),)).die()
    Proc(d, 0, 200).publish(1001.0, devices=(dev(**{OOMS: 0.0}),))
    _, carried = view.read(1002.0)
    ((key, values),) = carried.items()
    assert key[:4] == ("GPU-0", 0, 0, 0) and values == {OOMS: 1.0}  # uuid, device, rank, local_rank (, job)
    values[OOMS] = 99.0  # type: ignore[index]
    assert view.read(1003.0)[1][key] == {OOMS: 1.0}


def test_read_without_a_time_uses_the_clock(tmp_path):
    import time

    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 0, 100).publish(time.time() - 100.0, devices=(dev(**{OOMS: 1.0}),)).die()  # beyond the grace
    Proc(d, 1, 101).publish(time.time() - 1.0, devices=(dev(**{OOMS: 2.0}),)).die()  # inside it
    read, _ = view.read()
    assert [s.rank for s in read.final] == [1]


@pytest.mark.parametrize("order", ["dead_first", "live_first"])
def test_a_label_set_is_carried_only_while_someone_exports_it(tmp_path, order):
    d = str(tmp_path)
    view = RankView(d, 64, 10.0)
    a = Proc(d, 0, 100).publish(1000.0, devices=(dev(**{OOMS: 1.0}),))
    if order == "live_first":
        assert by_rank(scrape(view, 1000.0), OOMS) == {"0": 1.0}
    a.die()
    b = Proc(d, 0, 200).publish(1001.0, devices=(dev(**{OOMS: 1.0}),))
    assert by_rank(scrape(view, 1002.0), OOMS) == {"0": 2.0}
    b.publish(1020.0, devices=(dev("GPU-1", **{OOMS: 1.0}),))  # moved: GPU-0's label set is exported by nobody
    assert sorted((lab["uuid"], v) for lab, v in scrape(view, 1020.0)[OOMS]) == [("GPU-1", 1.0)]
    b.publish(1021.0, devices=(dev(**{OOMS: 1.0}),))  # back on GPU-0: its series started again
    assert by_rank(scrape(view, 1021.0), OOMS) == {"0": 1.0}


def test_info_series_are_one(tmp_path):
    d = str(tmp_path)
    Proc(d, 0, 100).publish(1000.0, allocator_info=spool.AllocatorInfo("native", "False", "0", "0"))
    m = scrape(RankView(d, 64, 30.0), 1000.0)
    assert [v for _, v in m["torch_cuda_allocator_info"]] == [1.0]
    assert [v for _, v in m["vramwatch_rank_info"]] == [1.0]


def test_of_two_dead_processes_with_snapshots_the_newest_snapshot_is_shown(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 0, 100).publish(1000.0, oom_snapshot=spool.OomSnapshot("/snap/old", 999.0)).die()
    Proc(d, 0, 200).publish(1005.0, oom_snapshot=spool.OomSnapshot("/snap/new", 1004.0)).die()
    m = scrape(view, 1006.0)
    assert [lab["path"] for lab, _ in m["vramwatch_oom_snapshot_info"]] == ["/snap/new"]


def test_a_dead_processes_last_oom_stays_even_when_it_counted_nothing_to_carry(tmp_path):
    # a final sample with the last OOM's values and no counter at all (an older or partial sample)
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 0, 100).publish(1000.0, devices=(dev(**{LAST_REQ: 64.0}),)).die()
    Proc(d, 0, 200).publish(1001.0, devices=(dev(**{ALLOC: 1.0}),))
    m = scrape(view, 1002.0)
    assert by_rank(m, LAST_REQ) == {"0": 64.0}


def test_a_counter_the_live_process_does_not_report_goes_on_from_the_dead_ones(tmp_path):
    d = str(tmp_path)
    view = RankView(d, 64, 30.0)
    Proc(d, 0, 100).publish(1000.0, devices=(dev(**{RETRIES: 2.0, OOMS: 1.0}),)).die()
    Proc(d, 0, 200).publish(1001.0, devices=(dev(**{OOMS: 0.0}),))  # no retries counter in its sample
    m = scrape(view, 1002.0)
    assert by_rank(m, RETRIES) == {"0": 2.0} and by_rank(m, OOMS) == {"0": 1.0}


def test_a_dead_rank_that_fails_to_render_is_reported_with_its_sample():
    bad = _sample(3, hostname=None, devices=(dev("GPU-3", **{OOMS: 1.0}),))
    told: list[Any] = []
    _, m = render(ScrapeContext((), 1000.0, "n", final=(bad,)), lambda s, e: told.append(s))
    assert told == [bad]
    assert "vramwatch_rank_info" not in m

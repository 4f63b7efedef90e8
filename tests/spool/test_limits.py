"""The server bounds what one sample may hold: size, devices, collectors, values, label lengths; cuts counted."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

from samples import rank_sample

from vramwatch import spool
from vramwatch.spool import files, limits


def _sample(**kw) -> spool.RankSample:
    return rank_sample(0, pid=4242, time=100.0, **kw)


def _write(d: str, s: spool.RankSample, payload: bytes | None = None) -> None:
    with open(os.path.join(d, "rank-0-4242.json"), "wb") as fh:
        fh.write(files.frame(spool.encode_sample(s) if payload is None else payload))


def _read(d: str) -> spool.SpoolRead:
    return spool.read_spool(d, 64, 3600.0, now=100.0, reap=False)  # the file is dead (no lock): a final sample


def _dev(i: int, uuid: str = "", n: int = 2) -> spool.DeviceSample:
    return spool.DeviceSample(i, uuid or f"GPU-{i:04d}", {f"torch_cuda_memory_x{j}_bytes": float(j) for j in range(n)})


def test_a_sample_within_the_bounds_is_taken_as_it_is():
    s = _sample(devices=(_dev(0),), collectors={"allocator": spool.CollectorHealth(1, 0, 0.0)})
    dropped: Counter[str] = Counter()
    assert limits.bounded(s, dropped) is s and not dropped


def test_devices_beyond_the_bound_are_dropped_and_counted(tmp_path):
    _write(str(tmp_path), _sample(devices=tuple(_dev(i) for i in range(limits.MAX_DEVICES + 36))))
    read = _read(str(tmp_path))
    (s,) = read.final
    assert [d.device for d in s.devices] == list(range(limits.MAX_DEVICES))
    assert read.dropped["device"] == 36


def test_values_and_collectors_beyond_the_bounds_are_dropped_and_counted(tmp_path):
    many = {f"c{i}": spool.CollectorHealth(1, 0, 0.0) for i in range(limits.MAX_COLLECTORS + 5)}
    _write(str(tmp_path), _sample(devices=(_dev(0, n=limits.MAX_DEVICE_VALUES + 7),), collectors=many))
    read = _read(str(tmp_path))
    (s,) = read.final
    assert len(s.devices[0].values) == limits.MAX_DEVICE_VALUES and read.dropped["value"] == 7
    assert list(s.collectors) == [f"c{i}" for i in range(limits.MAX_COLLECTORS)] and read.dropped["collector"] == 5


def test_a_device_whose_values_are_cut_keeps_its_memory_roles():
    many = dataclasses.replace(_dev(0, n=limits.MAX_DEVICE_VALUES + 1), roles={"parameters": 8.0})
    dropped: Counter[str] = Counter()
    (d,) = limits.bounded(_sample(devices=(many,)), dropped).devices
    assert len(d.values) == limits.MAX_DEVICE_VALUES and d.roles == {"parameters": 8.0} and dropped["value"] == 1


def test_a_label_value_too_long_drops_its_entry_never_truncated_into_a_duplicate(tmp_path):
    long = "x" * 100_000
    twins = ("GPU-" + "a" * 300 + "1", "GPU-" + "a" * 300 + "2")  # one prefix: cutting would repeat a label set
    s = _sample(
        devices=(_dev(0), _dev(1, twins[0]), _dev(2, twins[1])),
        collectors={"allocator": spool.CollectorHealth(1, 0, 0.0), long: spool.CollectorHealth(1, 0, 0.0)},
        allocator_info=spool.AllocatorInfo("native", long, "", ""),
        oom_snapshot=spool.OomSnapshot("/snaps/" + long, 1.0),
    )
    _write(str(tmp_path), dataclasses.replace(s, hostname=long))
    read = _read(str(tmp_path))
    (got,) = read.final
    assert [d.uuid for d in got.devices] == ["GPU-0000"]
    assert list(got.collectors) == ["allocator"]
    assert got.allocator_info is None and got.oom_snapshot is None
    assert got.hostname == long[: limits.MAX_LABEL_VALUE]
    assert read.dropped["label"] == 6  # two devices, a collector, the allocator info, the snapshot, the host name


def test_an_oversized_file_is_not_read_past_the_bound(tmp_path):
    _write(str(tmp_path), _sample(), payload=b" " * (limits.MAX_SAMPLE_BYTES + 1))
    read = _read(str(tmp_path))
    assert read.final == [] and read.dropped["oversized"] == 1


def test_a_label_of_most_of_a_mib_never_reaches_an_exposition(exporter, rank_sample):
    from harness import parse_metrics

    exp = exporter().start()
    pub = spool.RankPublisher(exp.spool, 0)
    try:
        pub.publish(rank_sample(0, uuid="GPU-" + "z" * 1_000_000, values={"torch_cuda_memory_allocated_bytes": 1.0}))
        text = exp.scrape()
        assert len(text) < 200_000 and "zzzz" not in text
        m = parse_metrics(text)
        assert ({"reason": "label"}, 1.0) in [(lab, v) for lab, v in m["vramwatch_spool_dropped_total"]]
        assert {lab["reason"] for lab, _ in m["vramwatch_spool_dropped_total"]} == set(limits.DROP_REASONS)
    finally:
        pub.close()

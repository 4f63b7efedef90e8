"""The rank-sample schema: a round trip through the file, and samples a reader must refuse."""

from __future__ import annotations

import json
import logging
import os
import time

from samples import rank_sample

from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.monitoring import contract
from vramwatch.server.registry import ExporterCollector
from vramwatch.spool import files


def full_sample(t: float = 1000.0, rank: int = 2) -> spool.RankSample:
    return rank_sample(
        rank,
        local_rank=1,
        world_size=4,
        time=t,
        devices=(
            spool.DeviceSample(
                0, "GPU-1", {"torch_cuda_memory_reserved_bytes": 3e9, "torch_cuda_memory_ooms_total": 1.0}
            ),
            spool.DeviceSample(1, "MIG-2", {}),
        ),
        allocator_info=spool.AllocatorInfo("native", "true", "0.8", ""),
        heartbeat=spool.HeartbeatSnapshot(
            steps=5, last_step_time=999.5, buckets=(0.1, 1.0), counts=(1, 2, 1), sum=1.5, loss=0.25, grad_norm=None
        ),
        collectors={"allocator": spool.CollectorHealth(1, 0, 0.0002)},
        oom_snapshot=spool.OomSnapshot("/tmp/vramwatch-oom-rank2.pickle", 998.0),
    )


def test_round_trip_through_the_file(tmp_path):
    pub = spool.RankPublisher(str(tmp_path), 2)
    try:
        pub.publish(full_sample(time.time()))
        (back,) = spool.read_samples(str(tmp_path), 64)
    finally:
        pub.close()
    expected = full_sample(back.time)
    assert back == expected
    assert spool.decode_sample(spool.encode_sample(expected)) == expected


def test_payload_is_compact_json_with_its_version_first(rank_sample):
    doc = json.loads(spool.encode_sample(full_sample()))
    assert next(iter(doc)) == "v" and doc["v"] == spool.SCHEMA_VERSION
    assert doc["devices"][0] == {
        "device": 0,
        "uuid": "GPU-1",
        "values": {"torch_cuda_memory_reserved_bytes": 3e9, "torch_cuda_memory_ooms_total": 1.0},
    }
    assert "oom_snapshot" not in json.loads(spool.encode_sample(rank_sample(0, pid=1, time=1.0)))


def test_allocator_info_labels_follow_the_contract():
    names = contract.spec("torch_cuda_allocator_info").labels[len(contract.RANK) :]
    info = spool.AllocatorInfo(*names)
    assert info.labels() == tuple(names)


def _plant(spool_dir: str, name: str, payload: bytes) -> None:
    """A rank file whose owner is alive (this process holds its lock)."""
    path = os.path.join(spool_dir, name)
    with open(path, "wb") as fh:
        fh.write(files.frame(payload))
    fd = files.hold_lock(files.lock_path_of(path))
    assert fd is not None
    _held.append(fd)


_held: list[int] = []


def _exporter(spool_dir: str) -> ExporterCollector:
    return ExporterCollector(Settings(spool_dir=spool_dir), spool_dir, [])


def _spool_errors(exp: ExporterCollector) -> tuple[float, float]:
    fams = {f.name: f for f in exp.collect()}
    row = [s for s in fams["vramwatch_collector_errors"].samples if s.labels["collector"] == "spool"]
    up = [s for s in fams["vramwatch_collector_up"].samples if s.labels["collector"] == "spool"]
    return row[0].value, up[0].value


def test_other_versions_and_garbage_are_rejected_logged_once_and_counted(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "vramwatch")
    d = str(tmp_path)
    good = spool.RankPublisher(d, 0)
    good.publish(full_sample(time.time(), rank=0))
    doc = json.loads(spool.encode_sample(full_sample()))
    try:
        _plant(d, "rank-1-11.json", json.dumps({**doc, "v": spool.SCHEMA_VERSION + 1}).encode())
        _plant(d, "rank-2-12.json", json.dumps({**doc, "v": 0}).encode())
        _plant(d, "rank-3-13.json", b"\x00not json at all")
        _plant(d, "rank-4-14.json", json.dumps({**doc, "devices": [{"device": "zero"}]}).encode())
        _plant(d, "rank-5-15.json", json.dumps([1, 2]).encode())
        read = spool.read_spool(d, 64, 0.0)
        assert [s.rank for s in read.live] == [0]
        rejected = read.rejected
        assert sorted((r.file, r.reason) for r in rejected) == [
            ("rank-1-11.json", "newer_version"),
            ("rank-2-12.json", "older_version"),
            ("rank-3-13.json", "malformed"),
            ("rank-4-14.json", "malformed"),
            ("rank-5-15.json", "malformed"),
        ]
        exp = _exporter(d)
        assert _spool_errors(exp) == (5.0, 0.0)  # a scrape that served the good rank and counted the rest
        assert _spool_errors(exp) == (10.0, 0.0)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 5, lines  # once per file and reason, not per scrape
        newer = [m for m in lines if "rank-1-11.json" in m]
        assert newer and f"version {spool.SCHEMA_VERSION + 1}" in newer[0] and "not exported" in newer[0]
    finally:
        good.close()
        while _held:
            os.close(_held.pop())


def test_a_spool_without_bad_files_stays_up(tmp_path):
    d = str(tmp_path)
    pub = spool.RankPublisher(d, 0)
    try:
        pub.publish(full_sample(time.time(), rank=0))
        assert _spool_errors(_exporter(d)) == (0.0, 1.0)
    finally:
        pub.close()


def test_node_readings_round_trip_and_go_stale(tmp_path):
    d = str(tmp_path)
    spool.write_node_readings(d, [spool.GpuReadings("GPU-a", 212.0, 2.5e9), spool.GpuReadings("GPU-b")])
    assert [p.name for p in tmp_path.iterdir()] == [files.NODE_READINGS]  # no temporary left behind
    assert spool.read_node(d).gpus == {
        "GPU-a": spool.GpuReadings("GPU-a", 212.0, 2.5e9),
        "GPU-b": spool.GpuReadings("GPU-b"),
    }
    spool.write_node_readings(d, [spool.GpuReadings("GPU-a", 1.0)], now=time.time() - 60)
    assert spool.read_node(d).gpus == {}  # a server that stopped: nothing shown
    spool.write_node_readings(str(tmp_path / "missing" / "dir"), [])  # never raises
    (tmp_path / files.NODE_READINGS).write_text("{garbage")
    assert spool.read_node(d).gpus == {}

"""The spool's edges, each case written against a mutant that survived tests/spool (docs/mutation.md): the
decoder's defaults, the record framing, the reaper's order, file names and modes, the publisher after
close and in a forked child, the readings' freshness bound."""

from __future__ import annotations

import json
import logging
import os
import stat
import time

import pytest
from samples import rank_sample

from vramwatch import spool
from vramwatch.spool import files, reader
from vramwatch.spool.codec import SampleRejected, decode_sample
from vramwatch.spool.readings import STALE_AFTER
from vramwatch.spool.schema import (
    SCHEMA_VERSION,
    AllocatorInfo,
    CollectorHealth,
    HeartbeatSnapshot,
    OomSnapshot,
    RankSample,
)


def sample(rank: int = 0, t: float = 1.0) -> RankSample:
    return rank_sample(rank, world_size=8, time=t)


def payload(**fields) -> bytes:
    """A complete sample as the encoder writes it (every field present), with ``fields`` replaced."""
    doc = json.loads(spool.encode_sample(rank_sample(2, local_rank=0, world_size=4, hostname="h", pid=1, time=5.0)))
    doc.update(fields)
    return json.dumps(doc).encode()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- codec ---
@pytest.mark.parametrize("key", ["rank", "local_rank", "world_size", "hostname", "pid", "time", "devices", "heartbeat"])
def test_a_missing_field_rejects_the_sample_naming_it(key):
    doc = json.loads(payload())
    del doc[key]
    with pytest.raises(SampleRejected) as e:
        decode_sample(json.dumps(doc).encode())
    assert e.value.reason == "malformed" and e.value.detail == f"{key} is missing"


def test_the_optional_parts_decode_to_none():
    got = decode_sample(payload(allocator_info=None, oom_snapshot=None))
    assert got.allocator_info is None and got.oom_snapshot is None and got.devices == ()
    doc = json.loads(payload())
    doc.pop("oom_snapshot", None)
    assert decode_sample(json.dumps(doc).encode()).oom_snapshot is None


def test_every_field_round_trips(rank_sample):
    full = rank_sample(
        3,
        local_rank=1,
        world_size=8,
        pid=42,
        time=12.5,
        device=1,
        uuid="GPU-y",
        values={"torch_cuda_memory_allocated_bytes": 7.0},
        allocator_info=AllocatorInfo("native", "true", "0.8", "128"),
        heartbeat=HeartbeatSnapshot(9, 11.5, (0.1, 1.0), (1, 2, 3), 4.5, 0.25, 2.5),
        collectors={"allocator": CollectorHealth(1, 3, 0.002)},
        oom_snapshot=OomSnapshot("/s/oom.pickle", 11.0),
    )
    assert decode_sample(spool.encode_sample(full)) == full


@pytest.mark.parametrize(
    "doc,reason,detail,version",
    [
        ({"rank": 1}, "malformed", "no schema version", None),
        ({"v": True}, "malformed", "no schema version", None),
        ({"v": SCHEMA_VERSION + 1}, "newer_version", f"schema version {SCHEMA_VERSION + 1},", SCHEMA_VERSION + 1),
        ({"v": SCHEMA_VERSION - 1}, "older_version", f"schema version {SCHEMA_VERSION - 1},", SCHEMA_VERSION - 1),
        ({"v": SCHEMA_VERSION, "rank": 1}, "malformed", "heartbeat is missing", SCHEMA_VERSION),
    ],
)
def test_rejections_name_their_reason_detail_and_version(doc, reason, detail, version):
    with pytest.raises(SampleRejected) as e:
        decode_sample(json.dumps(doc).encode())
    assert e.value.reason == reason and e.value.detail.startswith(detail)
    assert e.value.version == version


@pytest.mark.parametrize("bad", [True, "3", None, [3]])
def test_a_count_that_is_not_a_number_rejects_the_sample(bad):
    with pytest.raises(SampleRejected) as e:
        decode_sample(payload(rank=bad))
    assert e.value.reason == "malformed" and e.value.detail.endswith(f"not {type(bad).__name__}")


def test_a_rejection_carries_its_detail():
    with pytest.raises(SampleRejected) as e:
        decode_sample(b"[]")
    assert e.value.detail == str(e.value) == "not a JSON object"


# --- framing ---
def test_frames_round_trip_and_any_damage_is_no_record():
    assert files.unframe(files.frame(b"")) == b""  # a header alone is a complete (empty) record
    raw = files.frame(b'{"x":1}')
    assert files.unframe(raw) == b'{"x":1}'
    assert files.unframe(b"VWS2" + raw[4:]) is None  # another magic, CRC intact
    assert files.unframe(raw[:-1] + b"2") is None  # payload changed, magic and length intact
    assert files.unframe(raw[:-1]) is None  # torn
    assert files.unframe(raw[: files._HEADER.size - 1]) is None


# --- reader ---
def test_rejections_say_why(tmp_path):
    old = reader.Rejected("rank-1-9.json", "older_version", "x", SCHEMA_VERSION - 1)
    assert f"schema version {SCHEMA_VERSION - 1}" in old.describe() and "malformed" not in old.describe()
    new = reader.Rejected("rank-1-9.json", "newer_version", "x", SCHEMA_VERSION + 1)
    assert f"version {SCHEMA_VERSION + 1}" in new.describe()
    bad = reader.Rejected("rank-1-9.json", "malformed", "not JSON")
    assert bad.describe() == "rank-1-9.json holds a malformed sample (not JSON); its rank is not exported"


def _live_file(tmp_path, rank: int, pid: int, data: bytes) -> int:
    """A rank file whose lock we hold, as its live rank would; the lock's fd is returned."""
    path = files.sample_path(str(tmp_path), files.rank_stem(rank, pid))
    with open(path, "wb") as fh:
        fh.write(data)
    fd = files.hold_lock(files.lock_path_of(path))
    assert fd is not None
    return fd


def test_a_malformed_sample_is_rejected_with_its_reason(tmp_path):
    fd = _live_file(tmp_path, 1, 11, files.frame(b"not json"))
    read = spool.read_spool(str(tmp_path), 64, 0.0)
    assert read.live == []
    os.close(fd)
    ((r),) = read.rejected
    assert (r.file, r.reason) == ("rank-1-11.json", "malformed") and r.detail.startswith("not JSON")


def test_a_torn_record_is_retried_briefly_then_rejected(tmp_path):
    fd = _live_file(tmp_path, 1, 11, files.frame(b'{"v": 1}')[:-2])  # a writer that never finishes
    t0 = time.monotonic()
    read = spool.read_spool(str(tmp_path), 64, 0.0)
    assert read.live == []
    assert time.monotonic() - t0 < 0.5  # five tries half a millisecond apart, not seconds
    os.close(fd)
    assert read.rejected == [reader.Rejected("rank-1-11.json", "malformed", "no complete record")]


@pytest.mark.parametrize("reap", [True, False])
def test_dead_ranks_listed_first_do_not_hide_the_live_ones(tmp_path, monkeypatch, reap):
    for pid in (101, 102, 103):  # dead: their files, no lock held
        with open(files.sample_path(str(tmp_path), files.rank_stem(pid - 100, pid)), "wb") as fh:
            fh.write(files.frame(b"{}"))
    pub = spool.RankPublisher(str(tmp_path), 7)
    pub.publish(sample(7, 2.0))
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda d: sorted(real(d), key=lambda n: str(os.getpid()) in n))
    assert [s.rank for s in spool.read_samples(str(tmp_path), 64, reap=reap)] == [7]
    pub.close()


def test_reaping_removes_a_dead_ranks_half_written_first_sample(tmp_path):
    pub = spool.RankPublisher(str(tmp_path), 4)
    with open(pub._tmp, "wb") as fh:  # died between creating its first record and renaming it
        fh.write(b"VWS1")
    assert spool.read_samples(str(tmp_path), 64) == []
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (pub._tmp, pub.lock_path)), (
        "a live rank in the middle of its first publish keeps both"
    )
    assert spool.read_samples(str(tmp_path), 64, reap=False) == []
    os.close(pub._lock_fd)  # the process is gone: its lock is free
    pub._lock_fd = None
    assert len(os.listdir(tmp_path)) == 2, "not reaped by a read that does not reap"
    assert spool.read_samples(str(tmp_path), 64) == []
    assert os.listdir(tmp_path) == []


def test_any_rank_files_and_the_age_of_a_sample(tmp_path):
    assert not spool.any_rank_files(str(tmp_path / "missing"))
    assert not spool.any_rank_files(str(tmp_path))
    pub = spool.RankPublisher(str(tmp_path), 0)
    pub.publish(sample(0, 100.0))
    assert spool.any_rank_files(str(tmp_path))
    pub.close()
    s = sample(0, 100.0)
    assert s.age(102.5) == 2.5
    assert s.age(100.0) == 0.0 and s.age(99.0) == 0.0  # a clock step back is not a negative age


# --- publisher ---
def test_publisher_files_are_named_and_private(tmp_path):
    d = tmp_path / "spool"
    pub = spool.RankPublisher(str(d), 3)
    pub.publish(sample(3))
    pid = os.getpid()
    assert sorted(os.listdir(d)) == [f"rank-3-{pid}.json", f"rank-3-{pid}.lock"]
    assert mode(d) == 0o700
    assert mode(d / f"rank-3-{pid}.json") == mode(d / f"rank-3-{pid}.lock") == 0o600
    pub.close()


def test_an_existing_spool_readable_by_others_is_made_private(tmp_path):
    d = tmp_path / "spool"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    files.ensure_dir(str(d))
    assert mode(d) == 0o700


def test_the_spawn_lock_is_held_once(tmp_path):
    fd = files.hold_spawn_lock(str(tmp_path))
    assert fd is not None and os.path.exists(tmp_path / files.SPAWN_LOCK)
    assert files.hold_spawn_lock(str(tmp_path)) is None  # another holder is refused
    os.close(fd)
    again = files.hold_spawn_lock(str(tmp_path))
    assert again is not None
    os.close(again)


def test_close_frees_everything_and_publishes_nothing_after(tmp_path):
    before = open_fds()
    pub = spool.RankPublisher(str(tmp_path), 5)
    pub.publish(sample(5))
    with open(pub._tmp, "wb"):
        pass  # a temporary file left behind is removed too
    pub.close()
    final = [os.path.basename(pub.path)]  # the last sample stays as the rank's final one, nothing else
    assert open_fds() == before and os.listdir(tmp_path) == final
    pub.publish(sample(5))
    assert os.listdir(tmp_path) == final


def test_a_forked_child_drops_the_parents_files(tmp_path):
    pub = spool.RankPublisher(str(tmp_path), 6)
    pub.publish(sample(6))
    before = open_fds()
    pub._drop_in_child()  # what os.register_at_fork runs in the child
    assert open_fds() == before - 2  # the lock's and the sample's descriptors
    assert pub._lock_fd is None and pub._fd is None and pub.path == os.devnull
    pub.publish(sample(6, 9.0))
    pub.close()
    assert len(os.listdir(tmp_path)) == 2  # the parent's files stay, untouched


# --- readings ---
def test_readings_are_fresh_up_to_the_bound(tmp_path):
    spool.write_node_readings(str(tmp_path), [spool.GpuReadings("GPU-a", 100.0, 1e9)], now=1000.0)
    assert list(spool.read_node(str(tmp_path), now=1000.0 + STALE_AFTER).gpus) == ["GPU-a"]
    assert spool.read_node(str(tmp_path), now=1000.0 + STALE_AFTER + 0.01).gpus == {}


def test_a_failed_readings_write_is_logged_at_debug(tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        spool.write_node_readings(str(not_a_dir), [spool.GpuReadings("GPU-a")], now=1.0)
    (rec,) = [r for r in caplog.records if "nvml.json" in r.getMessage()]
    assert rec.getMessage().startswith("vramwatch: writing nvml.json failed: ") and "Error" in rec.getMessage()

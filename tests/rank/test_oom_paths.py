"""The OOM log line and its byte counts, called directly (test_oom.py drives the observer end to end)."""

from __future__ import annotations

import array
import errno
import logging
import os
import pickle
import shutil
import threading
import time
import types

import pytest

from vramwatch.config import Settings
from vramwatch.rank import oom
from vramwatch.rank.identity import RankIdentity
from vramwatch.rank.oom import LAST_FREE, LAST_REQUESTED, LAST_TIME, OomWatcher, _fmt, snapshot_files
from vramwatch.rank.plugin_api import RankContext, SampleExtras
from vramwatch.spool import OomSnapshot

GIB = 1 << 30


def test_byte_counts_in_the_log_line():
    assert [_fmt(n) for n in (0, 1023, 1024, 1536, 5 << 20, 3 * GIB, GIB - 1, -2048, 1.5, 1 << 40)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "1.50 KiB",
        "5.00 MiB",
        "3.00 GiB",
        "1024.00 MiB",  # just under a GiB
        "-2.00 KiB",
        "1 B",
        "1024.00 GiB",  # the largest unit: a TiB stays in GiB
    ]


def test_the_oom_line_is_rate_limited_and_counts_what_it_left_out(caplog):
    w = OomWatcher()
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        w._log_oom(100.0, 1, 2 * GIB, 512 << 20, None)
        w._log_oom(105.0, 1, GIB, 0, None)  # within 10 s of the last line: counted, not logged
        w._log_oom(106.0, 1, GIB, 0, None)
        w._log_oom(110.0, 0, 1536, 100, None)  # 10 s after the first: logged, with the two left out
        w._log_oom(111.0, 0, GIB, 0, "/snap/x.pickle")  # a snapshot is always said
    assert caplog.messages == [
        "vramwatch: CUDA out of memory on device 1: tried to allocate 2.00 GiB with 512.00 MiB free",
        "vramwatch: CUDA out of memory on device 0: tried to allocate 1.50 KiB with 100 B free"
        " (2 more since the last report)",
        "vramwatch: CUDA out of memory on device 0: tried to allocate 1.00 GiB with 0 B free"
        "; memory snapshot: /snap/x.pickle",
    ]


# --- attaching and closing, against a source that records what it is asked ------------------------------------


class _Source:
    """The OOM half of an AllocatorSource: records each call; `ready` False until CUDA is "initialised"."""

    def __init__(self, ready=True, attach_error=None, history_error=None, stop_error=None):
        self.ready = ready
        self.attach_error = attach_error
        self.history_error = history_error
        self.stop_error = stop_error
        self.calls = []

    def attach_oom_observer(self, observer):
        self.calls.append(("attach", observer))
        if self.attach_error is not None:
            raise self.attach_error
        return self.ready

    def detach_oom_observer(self, observer):
        self.calls.append(("detach", observer))

    def memory_snapshot(self):
        self.calls.append(("snapshot",))
        return {"segments": [], "device_traces": [[]], "from": "source"}

    def record_memory_history(self, max_entries):
        self.calls.append(("history", max_entries))
        error = self.history_error if max_entries else self.stop_error
        if error is not None:
            raise error


def _names(src):
    return [c[0] for c in src.calls]


def test_attaching_waits_for_cuda_then_attaches_once_with_the_sources_snapshot(tmp_path):
    src = _Source(ready=False)
    w = OomWatcher(src, snapshot_dir=str(tmp_path), history_entries=7)
    assert w.on_sample() is None and w.on_sample() is None
    assert src.calls == [("attach", w), ("attach", w)] and not w.attached and w.dump is None  # asked each sample
    src.ready = True
    w.on_sample()
    w.on_sample()
    w.try_attach()
    assert src.calls[2:] == [("attach", w), ("history", 7)]  # once attached, never again
    assert w.attached and w._history_on
    assert w.dump() == {"segments": [], "device_traces": [[]], "from": "source"}


def test_a_dump_given_is_kept_and_no_history_without_a_directory_or_entries(tmp_path):
    def mine():
        return {"mine": True}

    for kw in ({"snapshot_dir": str(tmp_path), "history_entries": 0}, {"snapshot_dir": "", "history_entries": 9}):
        src = _Source()
        w = OomWatcher(src, dump=mine, **kw)
        w.try_attach()
        assert _names(src) == ["attach"] and w.dump is mine and w.attached and not w._history_on
        w.close()
        assert _names(src) == ["attach", "detach"]  # a history it never started is never stopped
    src = _Source()
    w = OomWatcher(src, snapshot_dir=str(tmp_path), history_entries=1)  # the smallest history is one entry
    w.try_attach()
    assert src.calls[1:] == [("history", 1)]


def test_an_allocator_without_observers_is_said_once_at_info_and_never_asked_again(caplog):
    src = _Source(attach_error=oom.ObserverUnavailable("allocator backend is not native"))
    w = OomWatcher(src)
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        w.on_sample()
        w.on_sample()
        w.try_attach()
    assert _names(src) == ["attach"] and not w.attached and w.dump is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "vramwatch: allocator backend is not native; OOM observer and snapshots are off")
    ]


def test_an_attach_that_fails_is_one_warning_and_never_retried(caplog):
    src = _Source(attach_error=RuntimeError("no"))
    w = OomWatcher(src, snapshot_dir="/nonexistent", history_entries=5)
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        for _ in range(3):
            w.on_sample()
    assert _names(src) == ["attach"] and not w.attached and w.dump is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "vramwatch: could not attach the OOM observer: RuntimeError('no')")
    ]


def test_a_history_that_cannot_start_is_one_warning_and_is_never_stopped(tmp_path, caplog):
    src = _Source(history_error=RuntimeError("no history"))
    w = OomWatcher(src, snapshot_dir=str(tmp_path), history_entries=3)
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        w.try_attach()
        w.close()
    assert w.attached and not w._history_on
    assert src.calls == [("attach", w), ("history", 3), ("detach", w)]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "vramwatch: could not record the memory history: RuntimeError('no history')")
    ]


def test_close_stops_the_history_once_and_makes_the_observer_inert(tmp_path, caplog):
    src = _Source()
    published = []
    w = OomWatcher(src, snapshot_dir=str(tmp_path), history_entries=4, publish=lambda: published.append(1))
    w.try_attach()
    w.close()
    assert src.calls == [("attach", w), ("history", 4), ("detach", w), ("history", 0)]
    assert not w.active and not w._history_on
    w.close()
    assert src.calls[4:] == [("detach", w)]  # the history is stopped only once
    w(0, GIB, 8 * GIB, GIB)  # the allocator may still call a torch observer: it does nothing
    assert w.count == 0 and w.values == {} and published == [] and os.listdir(tmp_path) == []
    # a history that cannot be stopped: a debug line, never an exception
    bad = _Source(stop_error=RuntimeError("stuck"))
    w2 = OomWatcher(bad, snapshot_dir=str(tmp_path), history_entries=4)
    w2.try_attach()
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        w2.close()
    assert not w2._history_on and not w2.active
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "vramwatch: stopping the memory history failed: RuntimeError('stuck')")
    ]


def test_for_rank_takes_the_settings_identity_and_early_publish_and_attaches_at_once(tmp_path):
    settings = Settings(
        oom_snapshot_dir=str(tmp_path),
        oom_snapshot_max_files=3,
        oom_snapshot_max_bytes=12345,
        oom_history_entries=99,
    )
    src = _Source()

    def publish_now():
        return True

    ctx = RankContext(settings, RankIdentity(rank=6, local_rank=2, world_size=8), None, src, "", publish_now)
    w = OomWatcher.for_rank(ctx)
    assert (w.source, w.snapshot_dir, w.max_files, w.max_bytes, w.history_entries, w.rank, w.publish) == (
        src,
        str(tmp_path),
        3,
        12345,
        99,
        6,
        publish_now,
    )
    assert w.attached and src.calls == [("attach", w), ("history", 99)]
    assert w.min_interval == 30.0 and w.dump == src.memory_snapshot


def test_the_defaults_snapshot_nothing_and_keep_five_files_of_a_gib():
    w = OomWatcher(_Source())
    assert (w.snapshot_dir, w.max_files, w.max_bytes, w.history_entries, w.rank, w.min_interval) == (
        "",
        5,
        1 << 30,
        0,
        0,
        30.0,
    )
    assert (w.count, w.snapshots, w.last_path, w.last_snapshot, w.active, w.attached) == (0, 0, None, None, True, False)
    assert w.disk_usage is shutil.disk_usage and w.dump is None and w.publish is None
    assert isinstance(OomWatcher().source, oom.TorchSource)


# --- the observer on the allocating thread ---------------------------------------------------------------------


class _Clock:
    """oom's `time`: a wall clock and a monotonic clock the test moves (strftime and gmtime are the real ones)."""

    def __init__(self, wall=1767225600.0, mono=100.0):  # 2026-01-01T00:00:00Z
        self.wall = wall
        self.mono = mono
        self.strftime = time.strftime
        self.gmtime = time.gmtime

    def time(self):
        return self.wall

    def monotonic(self):
        return self.mono


DATA = {"segments": [], "device_traces": [[]], "pad": b"x" * 1000}


def _snapper(tmp_path, monkeypatch, **kw):
    """A watcher with a snapshot directory, a test clock and a publish that records what it would publish."""
    clock = _Clock()
    monkeypatch.setattr(oom, "time", clock)
    published = []
    kw.setdefault("dump", lambda: DATA)
    kw.setdefault("min_interval", 30.0)
    w = OomWatcher(_Source(), snapshot_dir=str(tmp_path), **kw)

    def publish():
        published.append((w.count, {d: dict(v) for d, v in w.values.items()}, w.last_snapshot))

    w.publish = publish
    return w, clock, published


def test_an_oom_is_published_before_the_snapshot_and_again_with_its_path(tmp_path, monkeypatch, caplog):
    w, clock, published = _snapper(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        w(2, 3 * GIB, 8 * GIB, -5)  # a negative free count (as a driver may report) is 0
    path = os.path.join(str(tmp_path), f"vramwatch-oom-rank0-20260101T000000-{os.getpid()}-1.pickle")
    values = {2: {LAST_REQUESTED: 3.0 * GIB, LAST_FREE: 0.0, LAST_TIME: clock.wall}}
    assert published == [(1, values, None), (1, values, OomSnapshot(path, clock.wall))]
    assert all(type(v) is float for v in w.values[2].values()) and [type(k) for k in w.values] == [int]
    assert (w.count, w.snapshots, w.last_path) == (1, 1, path)
    assert caplog.messages == [
        f"vramwatch: CUDA out of memory on device 2: tried to allocate 3.00 GiB with 0 B free; memory snapshot: {path}"
    ]
    assert w.on_sample() == SampleExtras(values, OomSnapshot(path, clock.wall))


def test_one_snapshot_per_interval_and_a_failed_one_also_waits(tmp_path, monkeypatch):
    dumps = []

    def dump():
        dumps.append(oom.time.monotonic())
        if len(dumps) == 1:
            raise RuntimeError("first dump fails")
        return DATA

    w, clock, published = _snapper(tmp_path, monkeypatch, dump=dump)
    w(0, GIB, 8 * GIB, 0)  # t=100: a snapshot is tried, and fails
    clock.mono = 129.99
    w(0, GIB, 8 * GIB, 0)  # within 30 s of the try: none
    clock.mono = 130.0
    w(0, GIB, 8 * GIB, 0)  # 30 s after: one
    clock.mono = 150.0
    w(0, GIB, 8 * GIB, 0)
    assert dumps == [100.0, 130.0] and w.snapshots == 1 and w.count == 4
    assert [snap is not None for _, _, snap in published] == [False, False, False, True, True]
    assert len(snapshot_files(str(tmp_path))) == 1


def test_without_a_publish_or_a_directory_the_values_are_still_kept(tmp_path):
    w = OomWatcher(_Source(), dump=lambda: DATA)
    w(1, 5, 10, 7)
    w(0, 6, 10, 8)
    w(1, 9, 10, 1)
    assert set(w.values) == {0, 1} and w.values[1][LAST_REQUESTED] == 9.0 and w.values[1][LAST_FREE] == 1.0
    assert w.count == 3 and w.snapshots == 0 and w.last_snapshot is None
    extras = w.on_sample()
    w(0, 1, 10, 1)
    assert extras.device_values[0][LAST_REQUESTED] == 6.0  # a copy: the next OOM does not change a sample taken


def test_the_log_line_is_rate_limited_through_the_observer_but_a_snapshot_is_always_said(tmp_path, monkeypatch, caplog):
    w, clock, _ = _snapper(tmp_path, monkeypatch)
    plain = OomWatcher(_Source())  # no directory: every line is subject to the limit
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        for _ in range(3):
            plain(0, GIB, 8 * GIB, 0)
        w(0, GIB, 8 * GIB, 0)  # a snapshot: said
        clock.wall += 5
        clock.mono += 5
        w(0, 2 * GIB, 8 * GIB, 0)  # 5 s later, no snapshot (the interval): left out
        clock.wall += 5
        w(0, 3 * GIB, 8 * GIB, 0)  # 10 s after the snapshot's line: said, with the one left out
    line = "vramwatch: CUDA out of memory on device 0: tried to allocate {} with 0 B free{}"
    assert caplog.messages == [
        line.format("1.00 GiB", ""),
        line.format("1.00 GiB", f"; memory snapshot: {w.last_path}"),
        line.format("3.00 GiB", " (1 more since the last report)"),
    ]
    assert plain._unlogged == 2 and w.snapshots == 1


def test_the_snapshot_carries_the_time_of_its_oom(tmp_path, monkeypatch):
    w, clock, _ = _snapper(tmp_path, monkeypatch)
    ticks = iter(range(1000))
    monkeypatch.setattr(clock, "time", lambda: clock.wall + next(ticks))  # each reading of the clock is later
    w(0, GIB, 8 * GIB, 0)
    assert w.last_snapshot == OomSnapshot(w.last_path, w.values[0][LAST_TIME])
    assert "-20260101T000000-" in w.last_path


def test_snapshots_without_a_publish_are_written_and_said(tmp_path, caplog):
    w = OomWatcher(_Source(), snapshot_dir=str(tmp_path), dump=lambda: DATA, min_interval=0.0)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        w(0, GIB, 8 * GIB, GIB)
    assert w.snapshots == 1 and caplog.messages == [
        f"vramwatch: CUDA out of memory on device 0: tried to allocate 1.00 GiB with 1.00 GiB free"
        f"; memory snapshot: {w.last_path}"
    ]


def test_a_failing_observer_logs_once_per_kind_of_error_and_never_raises(tmp_path, caplog):
    errors = iter([RuntimeError("a"), RuntimeError("b"), ValueError("c")])

    def publish():
        raise next(errors)

    w = OomWatcher(_Source(), publish=publish)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        for _ in range(3):
            w(0, GIB, 8 * GIB, 0)
    assert w.count == 3
    assert caplog.messages == [
        "vramwatch: OOM observer failed: RuntimeError('a')",
        "vramwatch: OOM observer failed: ValueError('c')",
    ]


# --- writing a snapshot: its name, each failure's one log line, the caps ------------------------------------


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_snapshot_is_named_by_rank_time_pid_and_sequence_and_holds_the_dump(tmp_path, monkeypatch):
    w, clock, _ = _snapper(tmp_path, monkeypatch, rank=3)
    created = []
    real_create = oom._create_in
    monkeypatch.setattr(oom.secrets, "token_hex", lambda n: "ab" * n)

    def create(dir_fd, d, name):
        created.append((d, name))
        return real_create(dir_fd, d, name)

    monkeypatch.setattr(oom, "_create_in", create)
    first = w.write_snapshot(1767225600.0 + 3661.5)  # 01:01:01.5
    clock.wall = 1767225600.0 + 59
    second = w.write_snapshot()  # now: the clock's
    pid = os.getpid()
    assert first == os.path.join(str(tmp_path), f"vramwatch-oom-rank3-20260101T010101-{pid}-1.pickle")
    assert second == os.path.join(str(tmp_path), f"vramwatch-oom-rank3-20260101T000059-{pid}-2.pickle")
    assert created == [(str(tmp_path), ".vramwatch-oom-" + "ab" * 8 + ".tmp")] * 2
    assert w.last_snapshot == OomSnapshot(second, clock.wall) and w.snapshots == 2 and w.last_path == second
    with open(first, "rb") as fh:
        assert pickle.load(fh) == DATA
    assert os.stat(first).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (first, second))


def test_no_dump_or_no_directory_writes_nothing_and_makes_no_directory(tmp_path):
    assert OomWatcher(_Source(), snapshot_dir=str(tmp_path / "a")).write_snapshot(1.0) is None
    assert OomWatcher(_Source(), snapshot_dir="", dump=lambda: DATA).write_snapshot(1.0) is None
    assert os.listdir(tmp_path) == []


def test_a_directory_that_cannot_be_used_is_said_once_per_kind_of_error(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    w, _, _ = _snapper(tmp_path / "snaps", monkeypatch)
    w.snapshot_dir = str(blocker / "snaps")
    usage_errors = [NotADirectoryError(20, "as before"), PermissionError(13, "denied")]
    fds = len(os.listdir("/proc/self/fd"))
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        assert w.write_snapshot() is None and w.write_snapshot() is None  # NotADirectoryError, twice
        w.snapshot_dir = str(tmp_path / "snaps")

        def usage(d):
            raise usage_errors.pop(0)

        w.disk_usage = usage
        assert w.write_snapshot() is None  # the same kind of error: said already
        assert w.write_snapshot() is None
    assert len(os.listdir("/proc/self/fd")) == fds  # every directory descriptor closed
    d = tmp_path / "snaps"
    assert _lines(caplog) == [
        f"vramwatch: cannot write OOM snapshots into {blocker / 'snaps'}: [Errno 20] Not a directory: "
        f"'{blocker / 'snaps'}'",
        f"vramwatch: cannot write OOM snapshots into {d}: [Errno 13] denied",
    ]
    assert os.listdir(d) == []


def test_an_unsafe_directory_is_said_once(tmp_path, monkeypatch, caplog):
    snaps = tmp_path / "shared"
    snaps.mkdir()
    snaps.chmod(0o720)  # the group may write: as unsafe as the world
    w, _, _ = _snapper(snaps, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        assert w.write_snapshot() is None and w.write_snapshot() is None
    assert _lines(caplog) == [
        f"vramwatch: no OOM snapshots: {snaps} is writable by others (mode 720) "
        "(it must be yours and not writable by others)"
    ]


def _usage(total, free):
    return lambda d: types.SimpleNamespace(total=total, free=free)


def test_the_disk_reserve_is_the_larger_of_256_mib_and_5_percent(tmp_path, monkeypatch, caplog):
    big = _snapper(tmp_path / "big", monkeypatch, dump=lambda: {"pad": b"x" * 200_000})[0]
    small = _snapper(tmp_path / "small", monkeypatch, dump=lambda: {"pad": b"x" * 200_000})[0]
    big.disk_usage = _usage(100 * GIB, 5 * GIB + 100_000)  # 5% of 100 GiB is the reserve
    small.disk_usage = _usage(GIB, (256 << 20) + 100_000)  # 5% of 1 GiB is less than 256 MiB
    tight = _snapper(tmp_path / "tight", monkeypatch, max_bytes=150_000)[0]
    tight.dump = lambda: {"pad": b"x" * 200_000}
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        assert big.write_snapshot() is None and small.write_snapshot() is None and tight.write_snapshot() is None
    assert _lines(caplog) == [
        "vramwatch: OOM snapshot larger than 97.66 KiB (oom_snapshot_max_bytes or free disk); not written"
    ] * 2 + ["vramwatch: OOM snapshot larger than 146.48 KiB (oom_snapshot_max_bytes or free disk); not written"]
    assert [os.listdir(tmp_path / n) for n in ("big", "small", "tight")] == [[], [], []]  # no partial file


def test_a_nearly_full_disk_is_said_once_and_the_dump_is_not_even_taken(tmp_path, monkeypatch, caplog):
    dumps = []
    w, _, _ = _snapper(tmp_path, monkeypatch, dump=lambda: dumps.append(1) or DATA)
    w.disk_usage = _usage(100 * GIB, 5 * GIB)  # exactly the reserve: no room
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        assert w.write_snapshot() is None and w.write_snapshot() is None
        w.disk_usage = _usage(100 * GIB, 5 * GIB + 1)  # one byte of room: the dump is taken, and too large
        assert w.write_snapshot() is None
    assert dumps == [1]
    assert _lines(caplog) == [
        f"vramwatch: {tmp_path} is nearly full; no OOM snapshot written",
        "vramwatch: OOM snapshot larger than 1 B (oom_snapshot_max_bytes or free disk); not written",
    ]


def test_a_snapshot_exactly_at_the_byte_cap_is_written(tmp_path, monkeypatch):
    size = len(pickle.dumps(DATA))
    w, _, _ = _snapper(tmp_path / "at", monkeypatch, max_bytes=size)
    assert w.write_snapshot() is not None and snapshot_files(str(tmp_path / "at"))[0][1] == size
    w2, _, _ = _snapper(tmp_path / "under", monkeypatch, max_bytes=size - 1)
    assert w2.write_snapshot() is None and os.listdir(tmp_path / "under") == []
    room = _snapper(tmp_path / "room", monkeypatch)[0]
    room.disk_usage = _usage(100 * GIB, 5 * GIB + size)  # exactly the room left
    assert room.write_snapshot() is not None


def test_a_failing_dump_is_said_once_per_kind_of_error(tmp_path, monkeypatch, caplog):
    errors = [RuntimeError("a"), RuntimeError("b"), MemoryError("c")]

    def dump():
        raise errors.pop(0)

    w, _, _ = _snapper(tmp_path, monkeypatch, dump=dump)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        assert [w.write_snapshot() for _ in range(3)] == [None] * 3
    assert _lines(caplog) == [
        "vramwatch: taking the memory snapshot failed: RuntimeError('a')",
        "vramwatch: taking the memory snapshot failed: MemoryError('c')",
    ]
    assert os.listdir(tmp_path) == []


def test_a_temporary_file_that_cannot_be_created_is_said_once_per_kind(tmp_path, monkeypatch, caplog):
    errors = [PermissionError(13, "denied"), PermissionError(13, "again"), FileExistsError(17, "exists")]

    def create(dir_fd, d, name):
        raise errors.pop(0)

    w, _, _ = _snapper(tmp_path, monkeypatch)
    monkeypatch.setattr(oom, "_create_in", create)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        assert [w.write_snapshot() for _ in range(3)] == [None] * 3
    assert _lines(caplog) == [
        f"vramwatch: cannot create an OOM snapshot in {tmp_path}: [Errno 13] denied",
        f"vramwatch: cannot create an OOM snapshot in {tmp_path}: [Errno 17] exists",
    ]


def test_write_errors_remove_the_partial_file_and_are_said_once_per_errno(tmp_path, monkeypatch, caplog):
    errors = [
        OSError(errno.EIO, "io"),
        OSError(errno.EIO, "io again"),
        OSError(errno.EROFS, "read-only"),
        OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)),
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),  # the same line as the quota's: said already
    ]
    real_write = os.write

    def write(fd, data):
        if fd > 2 and errors:
            raise errors.pop(0)
        return real_write(fd, data)

    w, _, _ = _snapper(tmp_path, monkeypatch)
    monkeypatch.setattr(oom.os, "write", write)
    fds = len(os.listdir("/proc/self/fd"))
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        assert [w.write_snapshot() for _ in range(5)] == [None] * 5
    assert len(os.listdir("/proc/self/fd")) == fds
    assert os.listdir(tmp_path) == []
    assert _lines(caplog) == [
        f"vramwatch: writing the OOM snapshot into {tmp_path} failed: OSError(5, 'io')",
        f"vramwatch: writing the OOM snapshot into {tmp_path} failed: OSError(30, 'read-only')",
        f"vramwatch: no OOM snapshot: {tmp_path} is full (Disk quota exceeded); the partial file is removed",
    ]
    assert w.write_snapshot() is not None and w.snapshots == 1  # and the next one, once it can, is written


def test_an_unpicklable_dump_is_said_once_per_kind_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    data = [{"fn": lambda: None}, {"fn": lambda: 1}, {"lock": threading.Lock()}]
    expected = []
    for d in data:
        try:
            pickle.dumps(d)
        except Exception as e:  # noqa: BLE001 - whatever pickle raises for it
            expected.append(f"vramwatch: writing the OOM snapshot failed: {e!r}")
    w, _, _ = _snapper(tmp_path, monkeypatch, dump=lambda: data.pop(0))
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        assert [w.write_snapshot() for _ in range(3)] == [None] * 3
    assert _lines(caplog) == [expected[0], expected[2]]  # AttributeError, then TypeError
    assert os.listdir(tmp_path) == []


def test_a_rename_that_fails_is_said_once_and_removes_the_temporary_file(tmp_path, monkeypatch, caplog):
    def replace(*a, **kw):
        raise PermissionError(13, "no rename")

    w, _, _ = _snapper(tmp_path, monkeypatch)
    monkeypatch.setattr(oom.os, "replace", replace)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        assert w.write_snapshot() is None and w.write_snapshot() is None
    assert _lines(caplog) == ["vramwatch: writing the OOM snapshot failed: PermissionError(13, 'no rename')"]
    assert os.listdir(tmp_path) == [] and w.snapshots == 0 and w.last_snapshot is None and w.last_path is None


def _old(d, i, size, other=False):
    name = f"{'x' if other else ''}{oom.PREFIX}old-{i}{oom.SUFFIX}"
    p = d / name
    p.write_bytes(b"o" * size)
    os.utime(p, (1000.0 + i, 1000.0 + i))
    return name


def _left(d):
    return sorted(n for n in os.listdir(d) if "old-" in n)


def test_the_count_cap_deletes_only_as_many_of_the_oldest_as_the_new_one_needs(tmp_path, monkeypatch):
    for keep, existing, left in ((3, 2, ["old-0", "old-1"]), (3, 3, ["old-1", "old-2"]), (2, 4, ["old-3"])):
        d = tmp_path / f"{keep}-{existing}"
        d.mkdir(mode=0o700)
        names = [_old(d, i, 10) for i in range(existing)]
        stranger = _old(d, 0, 10, other=True)  # not a snapshot: never counted, never deleted
        w, _, _ = _snapper(d, monkeypatch, max_files=keep)
        assert w.write_snapshot() is not None
        assert [n for n in names if os.path.exists(d / n)] == [n for n in names if any(k in n for k in left)]
        assert os.path.exists(d / stranger) and len(snapshot_files(str(d))) == len(left) + 1


def test_the_byte_cap_deletes_only_as_many_of_the_oldest_as_the_new_one_needs(tmp_path, monkeypatch):
    size = len(pickle.dumps(DATA))
    # three old files of 100, 200 and 300 bytes; the cap leaves room for the new one and what is left
    for cap, left in (
        (size + 600, ["old-0", "old-1", "old-2"]),  # exactly: nothing deleted
        (size + 599, ["old-1", "old-2"]),
        (size + 500, ["old-1", "old-2"]),
        (size + 499, ["old-2"]),
        (size + 300, ["old-2"]),
        (size + 299, []),
    ):
        d = tmp_path / str(cap)
        d.mkdir(mode=0o700)
        for i, n in enumerate((100, 200, 300)):
            _old(d, i, n)
        w, _, _ = _snapper(d, monkeypatch, max_files=100, max_bytes=cap)
        assert w.write_snapshot() is not None
        assert [n.split("-", 2)[2].removesuffix(oom.SUFFIX) for n in _left(d)] == left, cap


# --- the pieces: the capped file, the private directory, the exclusive create, the listing ---------------------


def test_the_capped_file_writes_everything_up_to_its_cap_even_in_short_writes(tmp_path, monkeypatch):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    real_write = os.write
    monkeypatch.setattr(oom.os, "write", lambda f, data: real_write(f, bytes(data[:3])))  # 3 bytes a call
    try:
        capped = oom._CappedFile(fd, 12)
        assert capped.write(b"abcdefg") == 7 and capped.written == 7
        assert capped.write(array.array("h", [1, 2])) == 4 and capped.written == 11  # bytes, not items
        assert capped.write(b"z") == 1 and capped.written == 12  # exactly the cap
        with pytest.raises(oom._CapExceeded):
            capped.write(b"!")
        assert capped.written == 12
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"abcdefg" + array.array("h", [1, 2]).tobytes() + b"z"


def _fd_count():
    return len(os.listdir("/proc/self/fd"))


def test_the_private_directory_accepts_0755_and_refuses_group_or_world_writes(tmp_path):
    for mode, ok in ((0o700, True), (0o755, True), (0o705, True), (0o750, True), (0o720, False), (0o702, False)):
        d = tmp_path / f"{mode:o}"
        d.mkdir()
        d.chmod(mode)
        fds = _fd_count()
        if ok:
            fd = oom.open_owned_dir(str(d))
            assert os.path.samestat(os.fstat(fd), os.stat(d))
            os.close(fd)
        else:
            with pytest.raises(oom._UnsafeDirectory, match=rf"^{d} is writable by others \(mode {mode:o}\)$"):
                oom.open_owned_dir(str(d))
        assert _fd_count() == fds


def test_a_directory_swapped_for_a_file_after_it_was_made_is_refused(tmp_path, monkeypatch):
    f = tmp_path / "was-a-directory"
    f.write_text("")
    f.chmod(0o600)
    monkeypatch.setattr(oom.os, "makedirs", lambda *a, **kw: None)  # it was a directory when made
    fds = _fd_count()
    with pytest.raises(NotADirectoryError):
        oom.open_owned_dir(str(f))
    assert _fd_count() == fds


def test_a_directory_of_another_uid_is_refused_by_its_descriptor(tmp_path, monkeypatch):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    real = os.geteuid()
    monkeypatch.setattr(oom.os, "geteuid", lambda: real + 1)
    fds = _fd_count()
    with pytest.raises(oom._UnsafeDirectory, match=rf"^{d} belongs to uid {real}, not {real + 1}$"):
        oom.open_owned_dir(str(d))
    assert _fd_count() == fds


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a link or a directory another owner")
def test_a_link_to_the_directory_is_followed_only_if_it_is_ours_or_roots(tmp_path, monkeypatch):
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    ours = tmp_path / "ours"
    ours.symlink_to(target)
    fd = oom.open_owned_dir(str(ours))  # root's link (we are root) to root's directory
    assert os.path.samestat(os.fstat(fd), os.stat(target))
    os.close(fd)
    theirs = tmp_path / "theirs"
    theirs.symlink_to(target)
    os.lchown(theirs, 4242, 4242)
    with pytest.raises(oom._UnsafeDirectory, match=rf"^{theirs} is a link owned by uid 4242$"):
        oom.open_owned_dir(str(theirs))
    # a job running as uid 4243 whose directory is reached through a link root made: accepted
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    os.chown(mine, 4243, 4243)
    rooted = tmp_path / "rooted"
    rooted.symlink_to(mine)
    monkeypatch.setattr(oom.os, "geteuid", lambda: 4243)
    fd = oom.open_owned_dir(str(rooted))
    os.close(fd)
    os.lchown(rooted, 4244, 4244)  # another user's link: refused even to a directory that is ours
    with pytest.raises(oom._UnsafeDirectory, match="is a link owned by uid 4244"):
        oom.open_owned_dir(str(rooted))


def test_the_exclusive_create_is_private_never_reuses_a_name_and_checks_the_directory(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    dir_fd = os.open(a, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = oom._create_in(dir_fd, str(a), "n")
        os.close(fd)
        assert os.stat(a / "n").st_mode & 0o777 == 0o600
        with pytest.raises(FileExistsError):
            oom._create_in(dir_fd, str(a), "n")
        (a / "link").symlink_to(tmp_path / "victim")
        with pytest.raises(FileExistsError):  # a dangling link is a name taken, never followed
            oom._create_in(dir_fd, str(a), "link")
        assert not (tmp_path / "victim").exists()
        fds = _fd_count()
        # the path now leads to another directory than the descriptor: created there, then refused
        with pytest.raises(FileNotFoundError):
            oom._create_in(dir_fd, str(b), "m")
        (a / "o").write_text("another file of that name")
        with pytest.raises(
            OSError, match=rf"^\[Errno {errno.EXDEV}\] {b} was replaced while the snapshot was created$"
        ) as e:
            oom._create_in(dir_fd, str(b), "o")
        assert e.value.errno == errno.EXDEV
        # the descriptor's directory holds a link to the file the path made: still another file, refused
        os.symlink(b / "p", a / "p")
        with pytest.raises(OSError, match="was replaced"):
            oom._create_in(dir_fd, str(b), "p")
        assert _fd_count() == fds
    finally:
        os.close(dir_fd)


def test_snapshot_files_lists_regular_snapshots_oldest_first_by_path_or_descriptor(tmp_path, monkeypatch):
    for name, when in (("vramwatch-oom-b.pickle", 30), ("vramwatch-oom-a.pickle", 10), ("vramwatch-oom-c.pickle", 20)):
        (tmp_path / name).write_bytes(b"x" * when)
        os.utime(tmp_path / name, (when, when))
    (tmp_path / "vramwatch-oom-dir.pickle").mkdir()  # not a regular file
    (tmp_path / "vramwatch-oom-link.pickle").symlink_to(tmp_path / "vramwatch-oom-a.pickle")  # a link, not followed
    for other in ("vramwatch-oom-a.pickle.tmp", "other.pickle", "vramwatch-oom-x", ".vramwatch-oom-t.tmp"):
        (tmp_path / other).write_text("")
    names = ["vramwatch-oom-a.pickle", "vramwatch-oom-c.pickle", "vramwatch-oom-b.pickle"]
    expected = [(float(n), n, name) for n, name in zip((10, 20, 30), names, strict=True)]
    assert snapshot_files(str(tmp_path)) == [(t, s, str(tmp_path / name)) for t, s, name in expected]
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert snapshot_files(fd) == expected
    finally:
        os.close(fd)
    assert snapshot_files(str(tmp_path / "missing")) == []
    real_stat = os.stat

    def stat(path, *a, **kw):  # a snapshot deleted between the listing and its stat
        if str(path).endswith("c.pickle"):
            raise FileNotFoundError(2, "gone")
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(oom.os, "stat", stat)
    listed = os.listdir(tmp_path)
    monkeypatch.setattr(oom.os, "listdir", lambda d: sorted(listed, key=lambda n: "c.pickle" not in n))  # c first
    assert [n for _, _, n in snapshot_files(str(tmp_path))] == [str(tmp_path / names[0]), str(tmp_path / names[2])]

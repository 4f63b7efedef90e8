"""The OOM that kills a rank is never lost: a restarted rank of the same pid, a full spool tmpfs, a rank out of
file descriptors, a step of the wall clock. Real processes and a real vramwatch.start() on the simulated GPU;
the container restart is a real PID namespace (PID 1 twice), the full tmpfs a real one of 1 MiB."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.procs import child_env
from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.server import registry as registry_module
from vramwatch.server.collectors.rank_view import RankView
from vramwatch.server.registry import ExporterCollector

OOMS = "torch_cuda_memory_ooms_total"

# a rank that publishes its device, then OOMs: after ``setup`` (argv[2]) has run (fill the tmpfs, spend the
# descriptors), the OOM's publish must still land; "live" publishes and waits instead
RANK = r"""
import os, sys
import vramwatch
mode = sys.argv[1]
h = vramwatch.start(simulate=True, serve="external", interval=30, spool_dir=sys.argv[2], job_id="job-7")
sim = h.sim
sim.init(0)
sim.set_memory_fraction(0.1)
sim.allocate(1 << 30)
h.tick()  # the device is in the spool, its OOM counter at 0
if mode == "live":
    print("published", flush=True)
    sys.stdin.read()
    os._exit(0)
if mode == "fill":  # the tmpfs full: no new file can take a byte
    with open(os.path.join(os.path.dirname(sys.argv[2]), "filler"), "wb") as fh:
        try:
            while True:
                fh.write(b"x" * 65536)
                fh.flush()
        except OSError as e:
            assert e.errno == 28, e
if mode == "fds":  # every descriptor spent: no new file can be opened
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as e:
        assert e.errno == 24, e
try:
    sim.allocate(1 << 50)
except Exception:
    os._exit(3)  # dies at once: only what is in the spool is left
"""


def _run(mode: str, spool_dir: Path, *prefix: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*prefix, sys.executable, "-c", RANK, mode, str(spool_dir)],
        env=child_env(VRAMWATCH_LOG_LEVEL="ERROR"),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _ooms(spool_dir: Path, now: float | None = None) -> list[float]:
    read, carried = RankView(str(spool_dir), 64, 3600.0).read(now)
    values = [d.values[OOMS] for s in read.live for d in s.devices]
    if not values:  # only final samples: their counts
        values = [sum(d.values[OOMS] for s in read.final for d in s.devices)]
    return values


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_the_oom_lands_on_a_full_spool_tmpfs(small_tmpfs: Path) -> None:
    d = small_tmpfs / "spool"
    out = _run("fill", d)
    assert out.returncode == 3, out.stderr
    assert _ooms(d) == [1.0], "the OOM's publish fell back to the in-place write"


def test_the_oom_lands_from_a_rank_out_of_file_descriptors(tmp_path: Path) -> None:
    d = tmp_path / "spool"
    out = _run("fds", d)
    assert out.returncode == 3, out.stderr
    assert _ooms(d) == [1.0], "the OOM's publish fell back to the in-place write"


def test_a_restarted_rank_of_the_same_pid_does_not_write_over_the_dead_ones_oom(tmp_path: Path) -> None:
    """A container restarted beside a surviving spool: PID 1 again, the same rank and job id."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare for a PID namespace")
    ns = (unshare, "--pid", "--fork")
    d = tmp_path / "spool"
    first = _run("oom", d, *ns)
    assert first.returncode == 3, first.stderr
    assert "rank-0-1-job-7.json" in os.listdir(d)  # PID 1 indeed
    view = RankView(str(d), 64, 3600.0)
    restarted = subprocess.Popen(
        [*ns, sys.executable, "-c", RANK, "live", str(d)],
        env=child_env(VRAMWATCH_LOG_LEVEL="ERROR"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert restarted.stdout is not None and restarted.stdout.readline().strip() == "published"
        assert len([n for n in os.listdir(d) if n.endswith(".json") and n.startswith("rank-")]) == 2, "both stay"
        read, carried = view.read()
        assert [s.pid for s in read.final] == [1] and len(read.live) == 1 and read.live[0].pid != 1
        ((key, values),) = carried.items()
        assert values[OOMS] == 1.0, "the restarted rank's series goes on from the dead one's OOM"
    finally:
        assert restarted.stdin is not None
        restarted.stdin.close()
        restarted.wait(timeout=20)


def test_a_wall_clock_step_beyond_the_grace_does_not_drop_the_final_samples(tmp_path, monkeypatch, rank_sample) -> None:
    d = str(tmp_path)
    wall, mono = [1000.0], [50.0]
    monkeypatch.setattr(registry_module.time, "time", lambda: wall[0])
    exp = ExporterCollector(Settings(spool_dir=d, dead_rank_grace_seconds=30.0), d, [])
    exp.monotonic = lambda: mono[0]
    dev = (spool.DeviceSample(0, "GPU-0", {OOMS: 1.0}),)
    for rank, t in ((0, 999.0), (1, 1000.5)):
        pub = spool.RankPublisher(d, rank)
        pub.publish(rank_sample(rank, world_size=2, time=t, devices=dev))
        pub.close()  # dead: its final sample stays
        if rank == 0:
            assert [s.rank for s in exp.context().final] == [0]  # seen before the step
    wall[0], mono[0] = 1000.0 + 3600.0, 51.0  # NTP steps the clock an hour forward; one second passed
    assert sorted(s.rank for s in exp.context().final) == [0, 1], "neither window ended with the step"
    mono[0], wall[0] = 75.0, 3600.0 + 1025.0
    assert sorted(s.rank for s in exp.context().final) == [0, 1]
    mono[0], wall[0] = 81.0, 3600.0 + 1031.0  # 30 s after each was taken, on the monotonic clock
    assert exp.context().final == ()


def test_a_backward_wall_step_does_not_drop_a_final_sample_first_seen_after_it(tmp_path, rank_sample) -> None:
    d = str(tmp_path)
    reader = spool.SpoolReader(d, 64, 30.0)
    assert reader.read(10_000.0, 50.0).final == []
    pub = spool.RankPublisher(d, 0)
    pub.publish(rank_sample(0, time=10_001.0))  # taken, then the clock stepped back 1 h
    pub.close()
    pub = spool.RankPublisher(d, 1)
    pub.publish(rank_sample(1, time=10_002.0 - 3600.0))  # taken after the step
    pub.close()
    read = reader.read(10_003.0 - 3600.0, 53.0)
    assert sorted(s.rank for s in read.final) == [0, 1]
    assert read.expires == pytest.approx(10_003.0 - 3600.0 + 28.0)  # rank 0's: taken 2 s before, 28 s to go


def test_vramwatch_ranks_counts_live_ranks_and_its_help_says_so_during_a_grace_window(tmp_path, rank_sample) -> None:
    """vramwatch_ranks counts live ranks (a rank-started server's end is told by it reading 0 after the dead
    ranks' windows: VramwatchTargetDown); during a window count(vramwatch_rank_info) is larger, and the help
    says exactly that instead of claiming they are equal."""
    from prometheus_client import CollectorRegistry, generate_latest

    from harness import parse_metrics
    from vramwatch.monitoring import contract

    d = str(tmp_path)
    exp = ExporterCollector(Settings(spool_dir=d), d, [])
    reg = CollectorRegistry(auto_describe=False)
    reg.register(exp)
    pubs = [spool.RankPublisher(d, r) for r in range(3)]
    for r, p in enumerate(pubs):
        p.publish(rank_sample(r, world_size=3))
    pubs[2].close()  # rank 2 died: its final sample is served for its window
    m = parse_metrics(generate_latest(reg).decode())
    assert len(m["vramwatch_rank_info"]) == 3 and len(m["vramwatch_sample_age_seconds"]) == 2
    assert m["vramwatch_ranks"] == [({}, 2.0)]
    help_text = contract.BY_NAME["vramwatch_ranks"].help
    assert "Live ranks" in help_text and "vramwatch_sample_age_seconds" in help_text
    assert "not counted" in help_text and "dead_rank_grace_seconds" in help_text
    for p in pubs[:2]:
        p.close()


def test_the_idle_loops_reads_keep_the_windows_across_a_wall_step(tmp_path, monkeypatch, rank_sample) -> None:
    """A rank-started server's idle loop reads the spool every second (read_spool at the clock's time): a final
    sample it saw is still there after a forward step of the wall clock, so the server does not leave early."""
    d = str(tmp_path)
    pub = spool.RankPublisher(d, 0)
    pub.publish(rank_sample(0))
    pub.close()
    assert [s.rank for s in spool.read_spool(d, 64, 30.0, reap=False).final] == [0]
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)
    assert [s.rank for s in spool.read_spool(d, 64, 30.0, reap=False).final] == [0]
    assert [s.rank for s in spool.read_spool(d, 64, 30.0, now=real() + 3600.0, reap=False).final] == []  # a fresh one


def test_a_process_numbered_past_a_dead_ones_files_is_still_its_pid_to_nvml(tmp_path, rank_sample) -> None:
    from vramwatch.spool import files, publisher

    d = str(tmp_path)
    dead = spool.RankPublisher(d, 0, job_id="j")
    dead.publish(rank_sample(0, time=1.0, job_id="j"))
    os.close(dead._lock_fd)  # dies without stop(): its lock file stays, free
    dead._lock_fd = None
    publisher._LEFT_BEHIND.discard(dead.path)
    again = spool.RankPublisher(d, 0, job_id="j")  # the same pid, rank and job: another process to the server
    assert again.instance == os.getpid() + files.PID_SPAN != dead.instance
    assert files.process_id(again.instance) == os.getpid()
    again.close()

"""The public API: start/stop/step, idempotence, errors at start only, never raising afterwards."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import timeit
from bisect import bisect_left

import pytest

import vramwatch
from vramwatch import spool
from vramwatch.rank.heartbeat import BUCKETS


def _sample(h):
    (s,) = spool.read_samples(h.spool_dir, 64)
    return s


def test_start_is_idempotent_and_publishes(start_rank):
    h = start_rank(rank=3, local_rank=1, world_size=8)
    assert vramwatch.start() is h
    assert vramwatch.current() is h
    d = _sample(h)
    assert (d.rank, d.local_rank, d.world_size) == (3, 1, 8)
    assert d.devices == ()  # nothing initialised yet: nothing read


def test_bad_config_raises_before_the_job_runs(tmp_path, monkeypatch):
    with pytest.raises(vramwatch.ConfigError, match="port"):
        vramwatch.start(port=123456)
    monkeypatch.setenv("VRAMWATCH_INTERVAL", "soon")
    with pytest.raises(vramwatch.ConfigError, match=r"from VRAMWATCH_INTERVAL"):
        vramwatch.start(spool_dir=str(tmp_path))
    assert vramwatch.current() is None


def test_step_counts_and_sample_carries_heartbeat(start_rank):
    h = start_rank()
    for i in range(10):
        vramwatch.step(loss=1.0 / (i + 1))
    h.tick()
    hb = _sample(h).heartbeat
    assert hb.steps == 10 and hb.loss == pytest.approx(0.1)
    assert sum(hb.counts) == 9  # durations between consecutive steps


def test_track_reports_a_step_per_item(start_rank):
    h = start_rank()
    assert list(vramwatch.track(range(5))) == [0, 1, 2, 3, 4]
    assert h.heartbeat.steps == 5


def test_nothing_raises_after_start_even_when_everything_breaks(start_rank, tmp_path):
    h = start_rank()
    h.sim.init(0)
    h.sim.faults.add("*")
    h.tick()
    d = _sample(h)
    assert d.collectors["allocator"].up == 0 and d.collectors["allocator"].errors >= 1
    h.heartbeat.loss = object()  # something that is not a number
    vramwatch.step(loss=float("nan"))
    h.tick()
    assert _sample(h).heartbeat.loss is None
    # the spool vanishing under us is logged, not raised
    for name in os.listdir(h.spool_dir):
        os.unlink(os.path.join(h.spool_dir, name))
    os.rmdir(h.spool_dir)
    h.tick()
    vramwatch.step()


def test_stop_withdraws_the_series(start_rank):
    h = start_rank()
    assert spool.read_samples(h.spool_dir, 64)
    vramwatch.stop()
    assert spool.read_samples(h.spool_dir, 64) == []
    assert vramwatch.current() is None
    vramwatch.step()  # after stop: a no-op


class _Reference:
    """What any heartbeat must do per step, in plain Python: two clock reads, a bucket search, four updates."""

    __slots__ = ("counts", "last", "steps", "sum", "wall")

    def __init__(self) -> None:
        self.last, self.wall, self.steps, self.sum = time.monotonic(), 0.0, 0, 0.0
        self.counts = [0] * (len(BUCKETS) + 1)

    def step(self) -> None:
        now = time.monotonic()
        d = now - self.last
        self.counts[bisect_left(BUCKETS, d)] += 1
        self.sum += d
        self.last = now
        self.wall = time.time()
        self.steps += 1


# The guarantee is step() <= 5 us on the training machine (benchmarks/overhead.py checks it there, in
# microseconds: TARGETS["step_call_us_max"]). There _Reference.step took REFERENCE_US, so 5 us is
# STEP_BUDGET_REFERENCES of it. Both are plain interpreted Python, so the ratio carries to any machine
# where absolute times do not (a slower or loaded CI core slows both alike).
# Measured on the H200 host (Python 3.12, 41 rounds, four runs): reference 0.29-0.32 us (one run 0.52 us),
# step() 1.21-1.23 references, as on a loaded 2-core CI machine (0.22 us reference, 1.2 references).
REFERENCE_US = 0.30
STEP_BUDGET_REFERENCES = 5.0 / REFERENCE_US


def test_step_costs_microseconds(start_rank):
    start_rank()
    ref = _Reference()
    n, rounds = 20_000, 41
    ratios, steps, refs = [], [], []
    for _ in range(rounds):  # interleaved short rounds: load that hits one round hits both of its timings
        a = timeit.timeit(vramwatch.step, number=n) / n
        b = timeit.timeit(ref.step, number=n) / n
        ratios.append(a / b)
        steps.append(a)
        refs.append(b)
    ratio = statistics.median(ratios)
    print(f"step() {statistics.median(steps) * 1e6:.3f} us, reference {statistics.median(refs) * 1e6:.3f} us")
    assert ratio < STEP_BUDGET_REFERENCES, (
        f"step() costs {ratio:.1f} reference steps (budget {STEP_BUDGET_REFERENCES:.1f}, i.e. 5 us on the "
        f"training machine); here {statistics.median(steps) * 1e6:.2f} us"
    )


def test_import_does_not_import_torch_or_frameworks():
    code = (
        "import sys, vramwatch, vramwatch.cli, vramwatch.server.main; "
        "print(sorted(m for m in ('torch','transformers','lightning','pytorch_lightning','grafana_foundation_sdk',"
        "'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.replace("'", '"')) == []


def test_rank_starts_the_server_and_it_leaves_after_the_ranks(tmp_path):
    from harness import free_port, http_get, wait_until

    port = free_port()
    code = (
        "import time, vramwatch\n"
        f"h = vramwatch.start(port={port}, spool_dir={str(tmp_path / 's')!r}, simulate=True, interval=0.1, linger=1, "
        "dead_rank_grace_seconds=1)\n"
        "h.sim.init(0); h.sim.allocate(1 << 30)\n"
        "for _ in range(60):\n    vramwatch.step(); time.sleep(0.05)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        body = wait_until(
            lambda: (lambda r: r[0] == 200 and b"torch_cuda_memory_allocated_bytes{" in r[1] and r)(
                http_get(f"http://127.0.0.1:{port}/metrics", 1)
            ),
            15,
            "the rank-start_rank server",
        )
        assert b'rank="0"' in body[1]
        proc.wait(timeout=30)
        wait_until(lambda: not spool.server_running(str(tmp_path / "s")), 15, "the server to leave")
    finally:
        proc.kill()


def test_a_tensor_loss_does_not_keep_its_graph_alive():
    import gc
    import weakref

    import torch

    from vramwatch.rank.heartbeat import Heartbeat

    hb = Heartbeat()
    w = torch.ones(3, requires_grad=True)
    activation = w * 2  # what the graph saves for backward
    loss = activation.sum()
    probe = weakref.ref(loss)
    hb.step(loss=loss)
    assert hb.loss is not loss and hb.loss.grad_fn is None, "kept detached"
    del loss, activation
    gc.collect()
    assert probe() is None, "the heartbeat must not keep the job's loss (and its graph) alive"
    assert hb.snapshot().loss == 6.0  # the value is still published
    hb.step(loss=torch.tensor(0.25))  # a detached tensor the job keeps no reference to
    assert hb.snapshot().loss == 0.25
    hb.step(loss=0.5)
    assert hb.snapshot().loss == 0.5


def test_a_rank_started_server_leaves_even_when_its_rank_died_at_once(tmp_path):
    from harness import free_port, wait_until

    port = free_port()
    spool_dir = str(tmp_path / "s")
    code = (
        f"import os, vramwatch\nvramwatch.start(port={port}, spool_dir={spool_dir!r}, simulate=True, linger=1, "
        "dead_rank_grace_seconds=1)\n"
        "os._exit(0)\n"
    )  # gone before the server's idle loop ever sees it alive
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=30)
    wait_until(lambda: spool.server_running(spool_dir), 10, "the server to start")
    wait_until(lambda: not spool.server_running(spool_dir), 15, "the server to leave well before the 60 s grace")


def test_eight_ranks_starting_together_spawn_one_server(tmp_path):
    from harness import free_port, http_get, wait_until

    port = free_port()
    spool_dir = str(tmp_path / "s")
    code = (
        "import sys, time, vramwatch\n"
        f"vramwatch.start(port={port}, spool_dir={spool_dir!r}, simulate=True, interval=0.1, linger=1, "
        "dead_rank_grace_seconds=1, rank=int(sys.argv[1]))\n"
        "for _ in range(80):\n    vramwatch.step(); time.sleep(0.05)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env) for r in range(8)]
    try:
        wait_until(
            lambda: http_get(f"http://127.0.0.1:{port}/metrics", 1)[1].count(b"vramwatch_rank_info{") == 8,
            20,
            "all eight ranks in one target",
        )
        log = open(os.path.join(spool_dir, "server.log")).read()
        assert log.count("serving http") == 1, log
        assert "another server already serves" not in log, "only one rank should have tried"
    finally:
        for p in procs:
            p.wait(timeout=30)


def test_an_unusable_spool_never_raises_from_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    h = vramwatch.start(spool_dir=str(blocker / "spool"), simulate=True, serve="auto")
    try:
        vramwatch.step()
        h.tick()
    finally:
        vramwatch.stop()

"""Nothing lost: a job's checkpoints and logs are byte-identical with and without vramwatch, and vramwatch
writes only inside its spool directory and its OOM snapshot directory.

Each run gets a fresh HOME, TMPDIR and working directory. A ``sitecustomize`` installs a Python audit hook in
the job and in every process it starts (the rank-started server too), logging each file opened for writing,
created, renamed or removed. The job with vramwatch may write nothing that the job without it did not, except
inside those two directories.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import free_port, wait_until

pytest.importorskip("torch")

pytestmark = pytest.mark.e2e

SITECUSTOMIZE = r"""
import json, os, sys
_fd = os.open(os.path.join(os.environ["AUDIT_DIR"], f"audit-{os.getpid()}.jsonl"),
              os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {"os.rename": 2, "os.remove": 1, "os.mkdir": 1, "os.rmdir": 1, "os.symlink": 2, "os.link": 2,
                "os.truncate": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1}

def _abs(p):
    if isinstance(p, int):
        return None
    p = os.fsdecode(p)
    return p if os.path.isabs(p) else os.path.join(os.getcwd(), p)

# where a path given relative to a directory descriptor (os.rename(..., src_dir_fd=...)) lies
_DIR_FDS = {"os.rename": (2, 3), "os.remove": (1,), "os.mkdir": (2,), "os.rmdir": (1,)}

def _at(dir_fd):
    if isinstance(dir_fd, int) and dir_fd >= 0:
        return os.readlink(f"/proc/self/fd/{dir_fd}")
    return None

def _hook(event, args):
    paths = []
    if event == "open" and len(args) >= 3:
        path, mode, flags = args[0], args[1], args[2]
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            isinstance(flags, int) and flags & _W)
        if writes:
            paths = [path]
    elif event in _PATH_EVENTS:
        paths = list(args[: _PATH_EVENTS[event]])
        for i, fd_at in enumerate(_DIR_FDS.get(event, ())):
            base = _at(args[fd_at]) if len(args) > fd_at and i < len(paths) else None
            if base is not None and not isinstance(paths[i], int):
                paths[i] = os.path.join(base, os.fsdecode(paths[i]))
    for p in paths:
        p = _abs(p)
        if p is not None:
            os.write(_fd, (json.dumps({"pid": os.getpid(), "event": event, "path": p}) + "\n").encode())

sys.addaudithook(_hook)
"""

JOB = r"""
import os, sys, time
import torch

mode, out = sys.argv[1], sys.argv[2]
if mode == "on":
    import vramwatch
    h = vramwatch.start()
    h.sim.init(0)
    h.sim.set_memory_fraction(0.1)
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(256, 32, generator=g)
y = (x[:, :3].sum(1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
with open(os.path.join(out, "train.log"), "w") as log:
    for step in range(1, 61):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.write(f"step {step} loss {loss.item():.8f}\n")
        if mode == "on":
            vramwatch.step(loss=loss.item())
            if step == 30:  # one OOM, caught as a job with retry logic would: vramwatch snapshots it
                try:
                    h.sim.allocate(1 << 50)
                except Exception as e:
                    pass
            time.sleep(0.01)
        if step % 20 == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                       os.path.join(out, "checkpoints", f"step-{step}.pt"))
    log.write("done\n")
if mode == "on":
    vramwatch.stop()
"""


def _run(tmp: Path, mode: str) -> dict:
    root = tmp / mode
    dirs = {k: root / k for k in ("home", "tmp", "cwd", "out", "audit", "site", "spool", "snaps")}
    for k, d in dirs.items():
        if k not in ("spool", "snaps"):  # vramwatch makes those itself
            d.mkdir(parents=True)
    (dirs["site"] / "sitecustomize.py").write_text(SITECUSTOMIZE)
    job = dirs["site"] / "job.py"
    job.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VRAMWATCH_", "PYTHON"))}
    env.update(
        HOME=str(dirs["home"]),
        TMPDIR=str(dirs["tmp"]),
        AUDIT_DIR=str(dirs["audit"]),
        PYTHONPATH=os.pathsep.join([str(dirs["site"]), str(Path(__file__).resolve().parents[2])]),
        PYTHONDONTWRITEBYTECODE="1",
        XDG_CACHE_HOME=str(dirs["home"] / ".cache"),
    )
    port = free_port()
    if mode == "on":
        env.update(
            VRAMWATCH_SIMULATE="true",
            VRAMWATCH_SPOOL_DIR=str(dirs["spool"]),
            VRAMWATCH_PORT=str(port),
            VRAMWATCH_INTERVAL="0.1",
            VRAMWATCH_LINGER="0.5",
            VRAMWATCH_DEAD_RANK_GRACE_SECONDS="1",
            VRAMWATCH_OOM_SNAPSHOT_DIR=str(dirs["snaps"]),
            VRAMWATCH_SERVE="auto",
        )
    r = subprocess.run(
        [sys.executable, str(job), mode, str(dirs["out"])],
        cwd=dirs["cwd"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    if mode == "on":
        # the rank-started server exits on its own once the rank is gone; wait, so all its writes are in
        wait_until(
            lambda: not os.path.exists(dirs["spool"] / "server.json") and _servers_gone(dirs["audit"]),
            30,
            "the rank-started server to exit",
        )
    events = []
    for f in dirs["audit"].iterdir():
        events += [json.loads(line) for line in f.read_text().splitlines()]
    return {"dirs": dirs, "events": events, "stderr": r.stderr, "port": port}


def _servers_gone(audit: Path) -> bool:
    pids = {int(f.stem.split("-")[1]) for f in audit.iterdir()}
    return all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in pids)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] == "Z"
    except OSError:
        return True


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _relative(path: str, run: dict) -> str:
    """The same place in the other run's directories, so the two runs' writes compare."""
    root = str(run["dirs"]["home"].parent)
    path = path.replace(root, "<run>")
    # tempfile.gettempdir() probes TMPDIR with a randomly named file (torch calls it): one probe is another
    return re.sub(r"^<run>/tmp/[a-z0-9_]{8}$", "<run>/tmp/<tempfile probe>", path)


@pytest.mark.slow
def test_outputs_identical_and_vramwatch_writes_only_its_own_directories(tmp_path):
    off = _run(tmp_path, "off")
    on = _run(tmp_path, "on")
    # the job's outputs, byte for byte
    out_off, out_on = _tree(off["dirs"]["out"]), _tree(on["dirs"]["out"])
    assert sorted(out_off) == [
        "checkpoints/step-20.pt",
        "checkpoints/step-40.pt",
        "checkpoints/step-60.pt",
        "train.log",
    ]
    assert out_on.keys() == out_off.keys()
    for name in out_off:
        assert out_on[name] == out_off[name], f"{name} differs with vramwatch"
    # HOME, TMPDIR and the working directory: nothing new
    for d in ("home", "tmp", "cwd"):
        assert _tree(on["dirs"][d]).keys() == _tree(off["dirs"][d]).keys(), d
    # every write: the job's own, or inside the spool / the snapshot directory
    pids = {e["pid"] for e in on["events"]}
    assert len(pids) >= 2, "the audit hook saw the rank-started server too"
    allowed = (str(on["dirs"]["spool"]) + os.sep, str(on["dirs"]["snaps"]) + os.sep)
    made = {str(on["dirs"]["spool"]), str(on["dirs"]["snaps"])}  # the directories themselves
    baseline = {_relative(e["path"], off) for e in off["events"]}
    stray = sorted(
        {
            e["path"]
            for e in on["events"]
            if _relative(e["path"], on) not in baseline
            and not e["path"].startswith(allowed)
            and e["path"] not in made
            and e["path"] != os.devnull
        }
    )
    assert not stray, f"vramwatch wrote outside its directories: {stray}"
    # and it did use them: samples in the spool, the OOM's snapshot in the snapshot directory
    wrote = {e["path"] for e in on["events"]}
    assert any(p.startswith(allowed[0]) and "/rank-" in p for p in wrote)
    assert [p.name for p in on["dirs"]["snaps"].iterdir() if p.name.endswith(".pickle")], "one OOM snapshot"
    # the spool is private
    assert on["dirs"]["spool"].stat().st_mode & 0o777 == 0o700


def test_the_default_spool_dir_is_private(tmp_path, rank_sample):
    from vramwatch import spool

    d = tmp_path / "vramwatch-test"
    old = os.umask(0o022)
    try:
        spool.ensure_dir(str(d))
        publisher = spool.RankPublisher(str(d), 0)
        publisher.publish(rank_sample(0))
        assert d.stat().st_mode & 0o777 == 0o700
        assert all((d / f).stat().st_mode & 0o077 == 0 for f in os.listdir(d))
        publisher.close()
    finally:
        os.umask(old)


LABEL_NAMES = {
    "uuid",
    "gpu",
    "device",
    "rank",
    "local_rank",
    "job_id",
    "hostname",
    "world_size",
    "collector",
    "name",
    "driver_version",
    "pci_bus_id",
    "mig_mode",
    "reason",
    "type",
    "kind",
    "xid",
    "version",
    "path",
    "backend",
    "expandable_segments",
    "garbage_collection_threshold",
    "max_split_size_mb",
    "role",  # memory by role: the codec admits only spool.MEMORY_ROLES
    # MIG instances: NVML's identities (a uuid, two numbers, the profile of the NVML name)
    "parent_uuid",
    "gpu_instance_id",
    "compute_instance_id",
    "profile",
    "mode",  # vramwatch_server_mode: node or job, set by the server itself
    "action",  # an Xid's catalogue action, NVML's recovery action: fixed sets
    "detail",  # a rank's exit: an exception's class name (bounded, never its message) or a signal's name
    "phase",  # a declared phase: spool.PHASES
    "value",  # loss or grad_norm: spool.NONFINITE_VALUES
}


def test_no_label_can_carry_a_process_name_command_line_or_pid():
    from vramwatch.monitoring import contract

    names = {label for m in contract.METRICS for label in m.labels}
    assert names <= LABEL_NAMES, f"new label names need a look in docs/security.md: {sorted(names - LABEL_NAMES)}"
    for word in ("pid", "process", "command", "cmdline", "user", "comm", "exe", "env"):
        assert not any(word in n for n in names), word


def test_process_names_command_lines_and_environment_never_reach_a_scrape(exporter, tmp_path, monkeypatch):
    import shutil

    from harness import start_sim_rank, stop_proc

    marker = "zq7marker"
    monkeypatch.setenv("SECRET_TOKEN", f"{marker}-env")  # in the rank's environment
    foreign_exe = tmp_path / f"{marker}-inference-server"
    shutil.copy("/bin/sleep", foreign_exe)
    foreign = subprocess.Popen([str(foreign_exe), "60", f"--api-key={marker}-argv"])
    exp = exporter(nvml_slow_interval=0.5).start()
    rank = start_sim_rank(exp, 0, "--duration", "60", "--fill-gib", "2")
    try:
        node = exp.node()
        node.add_foreign(0, foreign.pid, 3 << 30)
        exp.save_node(node)
        wait_until(
            lambda: any(v == 1 for _, v in exp.metrics().get("gpu_foreign_processes", [])),
            20,
            "the foreign process counted",
        )
        text = exp.scrape()
        assert marker not in text
        assert str(foreign.pid) not in {
            v for fam in exp.metrics().values() for labels, _ in fam for v in labels.values()
        }
        assert "pid=" not in text
    finally:
        stop_proc(rank)
        foreign.kill()
        foreign.wait()


def test_a_spool_planted_by_another_user_in_a_shared_directory_is_refused(tmp_path):
    from vramwatch import spool

    shared = tmp_path / "shm"
    shared.mkdir()
    shared.chmod(0o1777)  # like /dev/shm
    mine = shared / "vramwatch-mine"
    mine.mkdir(mode=0o777)
    mine.chmod(0o777)
    spool.ensure_dir(str(mine))
    assert mine.stat().st_mode & 0o777 == 0o700, "our own loose directory is tightened"
    if os.getuid() != 0:
        pytest.skip("planting a directory owned by another user needs root")
    planted = shared / "vramwatch-9488"
    planted.mkdir(mode=0o777)
    os.chown(planted, 4242, 4242)
    with pytest.raises(PermissionError, match="belongs to uid 4242"):
        spool.ensure_dir(str(planted))
    link = shared / "vramwatch-link"
    link.symlink_to(planted)
    with pytest.raises(PermissionError):
        spool.ensure_dir(str(link))
    # a directory someone else made outside a world-writable parent (a Kubernetes emptyDir): used as it is
    private_parent = tmp_path / "pod"
    private_parent.mkdir(mode=0o755)
    empty_dir = private_parent / "spool"
    empty_dir.mkdir(mode=0o777)
    os.chown(empty_dir, 4242, 4242)
    spool.ensure_dir(str(empty_dir))


# --- nothing lost on death: the OOM that ends a rank reaches every scraper -----------------------------------

DEATH_JOB = r"""
import os, signal, sys, time
import vramwatch

mode, go = sys.argv[1], sys.argv[2]
h = vramwatch.start(simulate=True, serve="external", interval=30)  # no tick will come to the rescue
sim = h.sim
sim.init(0)
sim.set_memory_fraction(0.1)
sim.allocate(1 << 30)
h.tick()  # the device is in the spool, its OOM counter at 0
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:  # until every scraper has seen the 0
    time.sleep(0.01)
if mode == "run":  # a restarted job that trains on
    time.sleep(60)
    sys.exit(0)
if mode == "uncaught":
    sim.allocate(1 << 50)  # the OOM propagates: the interpreter prints it and exits 1
try:
    sim.allocate(1 << 50)
except Exception:
    if mode == "exit":
        sys.exit(3)
    if mode == "os_exit":
        os._exit(3)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
raise SystemExit("unknown mode " + mode)
"""

TRIALS = 3  # per case; each trial is one rank number, so the trials of a case run side by side
# the exporter's dead_rank_grace_seconds: 5 intervals of the slower Prometheus. A restarted process carries its
# predecessor's count only if it publishes within it; with 4 test workers its start took over 5 s once.
GRACE = 10.0
OOMS = "torch_cuda_memory_ooms_total"


class Meddler:
    """A third client with its own timing: full GETs (recording each rank's highest OOM count and any label set
    repeated in one exposition), HEAD requests and scrapes aborted mid-request, between Prometheus' scrapes."""

    def __init__(self, port: int) -> None:
        import threading

        self.port = port
        self.seen: dict[str, float] = {}
        self.duplicates: list[str] = []
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import http.client
        import socket

        from harness import parse_metrics

        while not self._stop.wait(0.05):
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("HEAD", "/metrics")
                c.getresponse().read()
                c.close()
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:  # aborted mid-request
                    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:  # aborted mid-answer
                    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                    s.recv(10)
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/metrics")
                text = c.getresponse().read().decode()
                c.close()
                self.requests += 4
            except OSError:
                continue
            series = [line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")]
            self.duplicates += sorted({s for s in series if series.count(s) > 1})
            for labels, v in parse_metrics(text).get(OOMS, []):
                self.seen[labels["rank"]] = max(v, self.seen.get(labels["rank"], 0.0))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture(scope="module")
def ha_pair(tmp_path_factory):
    """One exporter, an HA pair of real Prometheus scraping it at different intervals with the shipped alert
    rules, and the meddling client."""
    from harness import Exporter, Prometheus
    from vramwatch.monitoring.alerts.render import rule_file, to_yaml
    from vramwatch.monitoring.config import DEFAULT

    tmp = tmp_path_factory.mktemp("ha")
    exp = Exporter(tmp / "node", dead_rank_grace_seconds=GRACE, nvml=False).start()
    rules = tmp / "rules.yml"
    rules.write_text(to_yaml(rule_file(DEFAULT)))
    target = [f"127.0.0.1:{exp.port}"]
    proms = [
        Prometheus(tmp, target, scrape_interval=iv, evaluation_interval="1s", rule_files=[str(rules)]).start()
        for iv in ("1s", "2s")
    ]
    meddler = Meddler(exp.port)
    try:
        yield exp, proms, meddler, tmp
    finally:
        meddler.stop()
        for p in proms:
            p.stop()
        exp.stop()


def _job(exp, tmp: Path, rank: int, mode: str) -> tuple[subprocess.Popen, Path]:
    from harness.procs import vramwatch_env

    script = tmp / "death_job.py"
    if not script.exists():  # once: rewriting it would truncate it under a job still starting (it ran empty)
        part = tmp / "death_job.py.part"
        part.write_text(DEATH_JOB)
        part.replace(script)
    go = tmp / f"go-{rank}-{mode}-{time.monotonic_ns()}"
    # no OOM log line: its write would hand the GIL to the sampler thread, a help a job cannot count on
    env = vramwatch_env(exp.spool, exp.port, simulate=True, log_level="ERROR")
    env.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="64")
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(go)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    return proc, go


def _everyone_saw(proms, meddler, rank: int, expr: str, value: float, timeout: float) -> None:
    for p in proms:
        p.wait_for(expr, timeout=timeout)
    wait_until(lambda: meddler.seen.get(str(rank)) == value, timeout, f"the meddler to see rank {rank} at {value}")


def _start_and_arm(ha_pair, ranks: list[int], mode: str) -> list[tuple[subprocess.Popen, Path]]:
    exp, proms, meddler, tmp = ha_pair
    jobs = [_job(exp, tmp, r, mode) for r in ranks]
    for r in ranks:  # every scraper has the rank at 0 before its OOM: the increase is there to see
        _everyone_saw(proms, meddler, r, f'{OOMS}{{rank="{r}"}} == 0', 0.0, 60)
    return jobs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exit", "os_exit", "sigkill", "uncaught"])
def test_the_oom_that_ends_a_rank_reaches_every_scraper_in_every_trial(ha_pair, mode):
    exp, proms, meddler, tmp = ha_pair
    base = {"exit": 0, "os_exit": 10, "sigkill": 20, "uncaught": 30}[mode]
    ranks = [base + i for i in range(TRIALS)]
    jobs = _start_and_arm(ha_pair, ranks, mode)
    for _, go in jobs:
        go.touch()
    for proc, _ in jobs:
        rc = proc.wait(timeout=30)
        assert rc == {"exit": 3, "os_exit": 3, "sigkill": -9, "uncaught": 1}[mode], proc.stderr.read().decode()
    for r in ranks:
        _everyone_saw(proms, meddler, r, f'increase({OOMS}{{rank="{r}"}}[10m]) > 0', 1.0, 3 * GRACE)
    assert meddler.requests > 0 and not meddler.duplicates


@pytest.mark.slow
@pytest.mark.timing
def test_a_job_that_ooms_and_restarts_within_one_interval_alerts_on_every_prometheus(ha_pair):
    exp, proms, meddler, tmp = ha_pair
    ranks = [40 + i for i in range(TRIALS)]
    dying = _start_and_arm(ha_pair, ranks, "exit")
    restarted = []
    try:
        for (proc, go), r in zip(dying, ranks, strict=True):
            go.touch()
            assert proc.wait(timeout=30) == 3
            nxt, nxt_go = _job(exp, tmp, r, "run")  # same rank number, new pid, started at once
            nxt_go.touch()
            restarted.append(nxt)
        for r in ranks:
            # the new process's series goes on from the dead one's count: Prometheus sees 0 -> 1, not a reset to 0
            _everyone_saw(proms, meddler, r, f'increase({OOMS}{{rank="{r}"}}[10m]) > 0', 1.0, 3 * GRACE)
            for p in proms:
                p.wait_for(f'ALERTS{{alertname="TorchOutOfMemory",rank="{r}"}}', timeout=30)
        time.sleep(GRACE + 1)  # past the dead one's window: its count stays carried in the live series
        for p, r in zip(restarted, ranks, strict=True):
            assert p.poll() is None, f"rank {r}'s successor exited {p.returncode}: {p.stderr.read().decode()}"
            ((labels, v),) = [(lab, v) for lab, v in exp.metrics()[OOMS] if lab["rank"] == str(r)]
            assert v == 1.0
        # a crash loop: the restarted process OOMs and dies too, a third takes over; one label set, the sum
        (proc, go), r = _job(exp, tmp, ranks[0], "exit"), ranks[0]
        stem = f"rank-{r}-{proc.pid}-"  # and its job id (its launcher's: this test's process)
        wait_until(
            lambda: any(n.startswith(stem) and n.endswith(".json") for n in os.listdir(exp.spool)), 30, "its sample"
        )
        restarted[0].kill()
        restarted[0].wait(5)
        go.touch()
        assert proc.wait(timeout=30) == 3
        third, third_go = _job(exp, tmp, r, "run")
        third_go.touch()
        restarted.append(third)
        _everyone_saw(proms, meddler, r, f'{OOMS}{{rank="{r}"}} == 2', 2.0, 3 * GRACE)
    finally:
        for p in restarted:
            p.kill()
            p.wait(5)
    from harness import http_get, parse_metrics

    for p in proms:  # Prometheus' own count of samples it dropped as repeated label sets
        own = parse_metrics(http_get(p.url + "/metrics")[1].decode())
        (dup,) = own["prometheus_target_scrapes_sample_duplicate_timestamp_total"]
        assert dup[1] == 0.0, "a label set repeated in one exposition"
    assert not meddler.duplicates

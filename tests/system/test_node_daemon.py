"""The node daemon (deploy/systemd/vramwatch.service) with real users: each test process runs as its own uid.

Tests run as root (here and in CI); each "user" is a child that drops to a uid of its own (setgroups, setgid,
setuid before exec) that need not exist in /etc/passwd. The daemon runs the unit's ExecStart as the unit's
User (mapped to a test uid), with its Environment and UMask, on a root made as RuntimeDirectory= makes it.
docs/security.md ("The node daemon") names these tests line by line.
"""

from __future__ import annotations

import configparser
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.exporter import parse_metrics
from harness.net import free_port, http_get, wait_until
from harness.procs import ROOT, child_env, stop_proc
from harness.servers import Prometheus
from harness.tools import find_tool
from vramwatch.spool import files

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run children as other uids")

UNIT = ROOT / "deploy" / "systemd" / "vramwatch.service"
DAEMON, ALICE, BOB, CAROL, STRANGER = 64001, 64002, 64003, 64004, 64009


def as_user(uid: int, umask: int | None = None) -> Callable[[], None]:
    def drop() -> None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if umask is not None:
            os.umask(umask)

    return drop


def _reachable(path: str) -> bool:
    """Whether any uid may run ``path``: every directory on the way and the file itself are open to others."""
    p = Path(path).resolve()
    return all(d.stat().st_mode & 0o001 for d in (*p.parents, p))


_PUBLIC: list[str] = []  # the copy made for other uids, once per process


def _public_copy() -> str:
    """The package and what it imports outside the standard library, copied where any uid may read them:
    the checkout and the venv may lie under a directory others cannot enter (root's 0700 home)."""
    if _PUBLIC:
        return _PUBLIC[0]
    pub = Path(tempfile.mkdtemp(prefix="vw-public-"))
    pub.chmod(0o755)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "vramwatch", pub / "vramwatch", ignore=skip)
    site = Path(sysconfig.get_paths()["purelib"])
    for name in ("prometheus_client", "pynvml.py", "yaml", "_yaml"):
        src = site / name
        if src.is_dir():
            shutil.copytree(src, pub / name, ignore=skip)
        elif src.exists():
            shutil.copy2(src, pub / name)
    for d, dirs, names in os.walk(pub):
        for n in dirs:
            os.chmod(os.path.join(d, n), 0o755)
        for n in names:
            os.chmod(os.path.join(d, n), 0o644)
    _PUBLIC.append(str(pub))
    return str(pub)


def user_python() -> tuple[str, dict[str, str]]:
    """An interpreter the test uids may run, and the environment it needs. This one when it and the checkout
    are open to others; else the real interpreter behind it (a venv's python is a link to one) or the
    system's Python of the same version, with a public copy of the package and its dependencies."""
    if _reachable(sys.executable) and _reachable(str(Path(sys.executable).parent)) and _reachable(str(ROOT)):
        site = sysconfig.get_paths()["purelib"]
        if _reachable(site):
            return sys.executable, {}
    real = os.path.realpath(sys.executable)
    if not _reachable(real):
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        alt = shutil.which(ver, path="/usr/bin:/usr/local/bin")
        if alt is None or not _reachable(alt):
            pytest.fail(f"no {ver} that other uids may run ({sys.executable} is not open to them)")
        real = alt
    return real, {"PYTHONPATH": _public_copy()}


def user_env() -> dict[str, str]:
    return child_env(**user_python()[1])


def read_unit(path: Path = UNIT) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    with open(path, encoding="utf-8") as fh:
        # Environment= repeats: keep every one (configparser keeps the last of a key)
        text = fh.read()
    unit.read_string(text)
    unit.environment = [  # type: ignore[attr-defined]
        line.split("=", 1)[1].strip() for line in text.splitlines() if line.startswith("Environment=")
    ]
    return unit


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory every test uid may traverse (pytest's tmp_path is root's 0700)."""
    d = Path(tempfile.mkdtemp(prefix="vramwatch-node-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Daemon:
    """The unit's ExecStart, run as the unit would: its User (a test uid), Environment, UMask, and a root made
    as RuntimeDirectory=/RuntimeDirectoryMode= make it, below a stand-in for /run."""

    def __init__(self, base: Path, **settings: str) -> None:
        unit = read_unit()
        svc = unit["Service"]
        self.run = base / "run"
        self.run.mkdir(mode=0o755)
        self.root = self.run / svc["RuntimeDirectory"]
        self.root.mkdir()
        os.chown(self.root, DAEMON, DAEMON)
        self.root.chmod(int(svc["RuntimeDirectoryMode"], 8))
        self.port = free_port()
        env = user_env()
        for assignment in unit.environment:  # type: ignore[attr-defined]
            k, _, v = assignment.partition("=")
            env[k] = v
        assert env["VRAMWATCH_NODE_DIR"] == "/run/" + svc["RuntimeDirectory"]
        env.update(
            VRAMWATCH_NODE_DIR=str(self.root),  # the stand-in for /run
            VRAMWATCH_PORT=str(self.port),
            VRAMWATCH_HOST="127.0.0.1",  # loopback only in tests
            VRAMWATCH_SIMULATE="true",  # no GPU here
            VRAMWATCH_INTERVAL="0.2",
            VRAMWATCH_NVML_INTERVAL="0.2",
            VRAMWATCH_DEAD_RANK_GRACE_SECONDS="2",
        )
        env.update(settings)
        argv = svc["ExecStart"].split()
        assert os.path.basename(argv[0]) == "vramwatch", argv
        self.argv = [user_python()[0], "-m", "vramwatch", *argv[1:]]  # the console script is this module
        self.log_path = base / "daemon.log"
        self.env = env
        self.umask = int(svc["UMask"], 8)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def start(self) -> Daemon:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=log, preexec_fn=as_user(DAEMON, self.umask)
            )

        def answers() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                return http_get(self.url, timeout=2)[0] == 200
            except OSError:
                return False

        wait_until(answers, 30, "the daemon to answer")
        return self

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        return parse_metrics(http_get(self.url)[1].decode())

    def ranks(self) -> set[str]:
        return {labels["rank"] for labels, _ in self.metrics().get("vramwatch_sample_age_seconds", [])}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None:
            stop_proc(self.proc)


@pytest.fixture
def daemon(base: Path) -> Iterator[Daemon]:
    d = Daemon(base).start()
    try:
        yield d
    finally:
        d.stop()


RANK = """
import sys, vramwatch
h = vramwatch.start(simulate=True, rank=int(sys.argv[1]), interval=0.2, node_dir=sys.argv[2], port=int(sys.argv[3]))
print(h.spool_dir, flush=True)
sys.stdin.read()
vramwatch.stop()
"""


class Rank:
    """A training process of user ``uid``: vramwatch.start() with no spool_dir of its own."""

    def __init__(self, uid: int, rank: int, d: Daemon, umask: int = 0o077, **env: str) -> None:
        self.uid = uid
        self.proc = subprocess.Popen(
            [user_python()[0], "-c", RANK, str(rank), str(d.root), str(d.port)],
            env={**user_env(), **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=as_user(uid, umask),  # a strict umask: the rank's files must still reach the daemon
        )
        assert self.proc.stdout is not None
        self.spool_dir = Path(self.proc.stdout.readline().strip())
        assert self.spool_dir.parent == d.root, self.stop()

    def sample_file(self) -> Path:
        return wait_until(lambda: next(self.spool_dir.glob("rank-*.json"), None), 10, "the rank's sample")

    def stop(self) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=20)
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


def run_as(uid: int, code: str, *args: str) -> str:
    """Run ``code`` as ``uid``; its stdout (it must exit 0)."""
    out = subprocess.run(
        [user_python()[0], "-c", code, *args],
        env=user_env(),
        capture_output=True,
        text=True,
        preexec_fn=as_user(uid),
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_idle_daemon_is_up_with_no_rank_series(daemon: Daemon) -> None:
    m = daemon.metrics()
    assert m["vramwatch_ranks"] == [({}, 0.0)]
    assert m["vramwatch_server_mode"] == [({"mode": "node"}, 1.0)]
    assert not [n for n in m if n.startswith("torch_")], sorted(m)
    assert "vramwatch_sample_age_seconds" not in m
    st = daemon.root.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (DAEMON, 0o3733)
    lock = (daemon.root / files.SERVER_LOCK).stat()
    assert (lock.st_uid, stat.S_IMODE(lock.st_mode)) == (DAEMON, 0o644)  # every user's ranks can ask


ATTACK = """
import errno, os, sys
root, alice_dir, alice_file = sys.argv[1:4]
def refused(f, *a):
    try:
        f(*a)
    except OSError as e:
        return errno.errorcode[e.errno]
    return "ALLOWED"
print("list-root", refused(os.listdir, root))
print("list-alice", refused(os.listdir, alice_dir))
print("read-alice", refused(lambda: open(alice_file, "rb").read()))
print("stat-alice-file", refused(os.stat, alice_file))
print("unlink-alice", refused(os.unlink, alice_file))
print("forge-alice", refused(lambda: open(os.path.join(alice_dir, "rank-5-5.json"), "wb")))
print("rename-alice-dir", refused(os.rename, alice_dir, os.path.join(root, "stolen")))
print("rmdir-alice-dir", refused(os.rmdir, alice_dir))
print("remove-server-lock", refused(os.unlink, os.path.join(root, "server.lock")))
"""

PLANT = """
import os, sys
root, alice_dir, alice_file = sys.argv[1:4]
os.mkdir(os.path.join(root, "u64004"), 0o770)                  # squats carol's name before her job runs
os.symlink(alice_dir, os.path.join(root, "u64003"))            # bob's own name, pointing at alice's directory
with open(os.path.join(root, "rank-0-1.json"), "wb") as fh:  # a sample file straight in the root
    fh.write(open("/dev/urandom", "rb").read(16))
"""

PLANT_OWN = """
import os, sys
mine, alice_file = sys.argv[1:3]
os.symlink(alice_file, os.path.join(mine, "rank-7-7.json"))    # alice's sample, as if bob's
os.mkfifo(os.path.join(mine, "rank-8-8.json"))                 # a reader opening it without O_NONBLOCK hangs
"""


def test_users_publish_as_themselves_and_cannot_touch_each_other(daemon: Daemon, base: Path) -> None:
    alice = Rank(ALICE, 0, daemon)
    try:
        a_file = alice.sample_file()
        a_dir = alice.spool_dir
        st, fst = a_dir.stat(), a_file.stat()
        # alice's directory: hers, in the daemon's group (the root's setgid bit), 2770 although her umask is 077
        assert (a_dir.name, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == ("u64002", ALICE, DAEMON, 0o2770)
        assert (fst.st_uid, fst.st_gid, stat.S_IMODE(fst.st_mode)) == (ALICE, DAEMON, 0o640)
        wait_until(lambda: daemon.ranks() == {"0"}, 15, "alice's rank on the daemon")

        out = run_as(BOB, ATTACK, str(daemon.root), str(a_dir), str(a_file))
        got = dict(line.split() for line in out.splitlines())
        assert got == {
            "list-root": "EACCES",
            "list-alice": "EACCES",
            "read-alice": "EACCES",
            "stat-alice-file": "EACCES",
            "unlink-alice": "EACCES",
            "forge-alice": "EACCES",
            "rename-alice-dir": "EPERM",  # the sticky root
            "rmdir-alice-dir": "EPERM",
            "remove-server-lock": "EPERM",
        }, out

        run_as(BOB, PLANT, str(daemon.root), str(a_dir), str(a_file))
        # two jobs (children of this one process, they would share a job id: one user's only, the other refused)
        bob = Rank(BOB, 1, daemon, VRAMWATCH_JOB_ID="bob-1")  # his own name is his symlink: he falls back
        carol = Rank(CAROL, 2, daemon, VRAMWATCH_JOB_ID="carol-1")  # her name is squatted by bob: she falls back
        try:
            assert bob.spool_dir.name.startswith("u64003-") and carol.spool_dir.name.startswith("u64004-")
            run_as(BOB, PLANT_OWN, str(bob.spool_dir), str(a_file))
            foreign = bob.spool_dir / "rank-9-9.json"  # a file of another owner in bob's directory
            foreign.write_bytes(a_file.read_bytes())
            os.chown(foreign, STRANGER, DAEMON)
            foreign.chmod(0o640)

            wait_until(lambda: daemon.ranks() == {"0", "1", "2"}, 15, "every user's rank on the daemon")
            time.sleep(1.0)  # several reads: each refusal is logged once, not once per read
            log = daemon.log()
            expected = {
                f"{daemon.root}/u64004: named for uid 64004 but belongs to uid 64003",
                f"{daemon.root}/u64003: a symlink",
                f"{daemon.root}/rank-0-1.json: not a user directory (a file of uid 64003)",
                f"{bob.spool_dir}/rank-7-7.json: a symlink",
                f"{bob.spool_dir}/rank-8-8.json: not a regular file",
                f"{bob.spool_dir}/rank-9-9.json: belongs to uid {STRANGER}, its directory to uid {BOB}",
            }
            for line in expected:
                assert log.count("refused " + line) == 1, (line, log)
            m = daemon.metrics()
            refused = [v for labels, v in m["vramwatch_spool_dropped_total"] if labels["reason"] == "refused"]
            assert refused and refused[0] >= len(expected)
            assert [v for labels, v in m["vramwatch_collector_up"] if labels["collector"] == "spool"] == [1.0]
            for who in (bob, carol):
                assert "refused" in who.stop()  # the rank said why it took another name
        finally:
            for who in (bob, carol):
                if who.proc.poll() is None:
                    who.stop()
        assert daemon.proc is not None and daemon.proc.poll() is None  # the FIFO did not hang it
    finally:
        alice.stop()
    # alice's job ended: her final sample is served for its grace, then the daemon (the group may write) reaps it
    wait_until(lambda: not list(a_dir.glob("rank-*")), 20, "alice's files reaped")
    wait_until(lambda: daemon.ranks() == set(), 10, "the daemon idle again")
    assert daemon.metrics()["vramwatch_ranks"] == [({}, 0.0)]


def test_prometheus_scrapes_the_daemon_and_sees_both_users(daemon: Daemon, base: Path) -> None:
    rules = ROOT / "deploy" / "prometheus" / "rules" / "vramwatch.rules.yml"
    prom = Prometheus(base / "prom", [f"127.0.0.1:{daemon.port}"], rule_files=[str(rules)]).start()
    try:
        prom.wait_for('up{job="vramwatch"} == 1 and on() vramwatch_server_mode{mode="node"} == 1')
        time.sleep(3)  # a few scrapes and rule evaluations of the idle daemon
        assert prom.query("ALERTS") == []  # not even pending: no rule's condition holds on an idle node
        assert prom.query("vramwatch_sample_age_seconds") == []
        alice, bob = Rank(ALICE, 0, daemon), Rank(BOB, 1, daemon)
        try:
            got = prom.wait_for("count(vramwatch_sample_age_seconds) == 2", timeout=30)
            assert got
            ranks = {r["metric"]["rank"] for r in prom.query("vramwatch_sample_age_seconds")}
            assert ranks == {"0", "1"}
        finally:
            alice.stop()
            bob.stop()
    finally:
        prom.stop()


def test_two_jobs_rank_0_on_one_node_are_two_series(daemon: Daemon) -> None:
    alice = Rank(ALICE, 0, daemon, SLURM_JOB_ID="101", SLURM_PROCID="0")
    bob = Rank(BOB, 0, daemon, SLURM_JOB_ID="202", SLURM_PROCID="0")
    try:

        def both() -> list:
            rows = [labels for labels, _ in daemon.metrics().get("vramwatch_sample_age_seconds", [])]
            return rows if len(rows) == 2 else []

        rows = wait_until(both, 15, "both jobs' rank 0 on the daemon")  # one per (job_id, rank)
        assert rows[0] != rows[1], rows  # else Prometheus keeps one of them: a duplicate series in one scrape
        assert {dict(r)["job_id"] for r in rows} == {"101", "202"}, rows
    finally:
        alice.stop()
        bob.stop()


FLOOD = """
import os, sys, time
from vramwatch import spool
from vramwatch.spool import node
d = node.user_dir(sys.argv[1])
buckets = tuple(float(i) for i in range(1, 1001))  # 1,000 histogram buckets in every sample
hb = spool.HeartbeatSnapshot(1, time.time(), buckets, tuple([0] * 1001), 0.0)
pubs = []
for r in range(64):  # 64 fake ranks of a job id that sorts before every real one
    p = spool.RankPublisher(d, r, job_id="000-fake", shared=True)
    p.publish(spool.RankSample(r, r, 64, "fake", os.getpid(), time.time(), heartbeat=hb, job_id="000-fake"))
    pubs.append(p)
forged = spool.RankPublisher(d, 0, job_id=sys.argv[2], shared=True)  # another user's job id, newer samples
forged.publish(spool.RankSample(0, 0, 64, "forged", os.getpid(), time.time() + 5, job_id=sys.argv[2]))
print("ready", flush=True)
sys.stdin.read()
"""


def test_one_user_flooding_the_daemon_does_not_blind_another(daemon: Daemon) -> None:
    """Bob publishes 64 fake ranks of 1,000-bucket histograms (tens of thousands of series) and a rank under
    Alice's job id: Alice's rank is in every scrape with its own series, and the scrape stays small."""
    alice = Rank(ALICE, 0, daemon, SLURM_JOB_ID="101", SLURM_PROCID="0")
    bob = subprocess.Popen(
        [user_python()[0], "-c", FLOOD, str(daemon.root), "101"],
        env=user_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_user(BOB),
    )
    try:
        assert bob.stdout is not None and bob.stdout.readline().strip() == "ready", bob.communicate(timeout=10)
        wait_until(lambda: 'job_id="101"' in http_get(daemon.url)[1].decode(), 15, "alice's rank on the daemon")
        wait_until(lambda: 'job_id="000-fake"' in http_get(daemon.url)[1].decode(), 15, "bob's ranks on the daemon")
        for _ in range(10):
            body = http_get(daemon.url)[1]
            m = parse_metrics(body.decode())
            mine = [labels for labels, _ in m["vramwatch_rank_info"] if labels["job_id"] == "101"]
            assert [(lab["rank"], lab["hostname"] != "forged") for lab in mine] == [("0", True)], mine
            assert len(body) < 2_000_000, len(body)
            assert 0 < sum(1 for labels, _ in m["vramwatch_rank_info"] if labels["job_id"] == "000-fake") < 64
            time.sleep(0.2)
        assert "publishes under job_id '101'" in daemon.log()
    finally:
        assert bob.stdin is not None
        bob.stdin.close()
        bob.wait(timeout=20)
        alice.stop()


JUNK = """
import os, sys
for i in range(int(sys.argv[2])):
    open(os.path.join(sys.argv[1], f"junk-{i}"), "wb").close()
"""


def test_junk_names_in_the_root_give_a_bounded_log(daemon: Daemon) -> None:
    """Every junk name is a refusal; the daemon logs a bounded burst of them (tests/spool/test_once_log.py: then
    one line every 10 s, the first saying how many were left out), never one line per name."""
    run_as(BOB, JUNK, str(daemon.root), "3000")

    def refused() -> float:  # counted per read; a loaded host may take a while to make the reads
        m = daemon.metrics()
        return sum(v for labels, v in m["vramwatch_spool_dropped_total"] if labels["reason"] == "refused")

    wait_until(lambda: refused() >= 3000, 30, "a read refusing the 3,000 junk names")
    log = daemon.log()
    assert 10 <= log.count("vramwatch: refused ") <= 64, log.count("vramwatch: refused ")


def _servers_of(uid: int) -> list[str]:
    """Command lines of ``vramwatch serve`` processes running as ``uid``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "vramwatch serve" in cmd:
            out.append(cmd)
    return out


def test_a_rank_finds_the_daemon_and_starts_no_server(daemon: Daemon) -> None:
    alice = Rank(ALICE, 0, daemon)
    try:
        wait_until(lambda: daemon.ranks() == {"0"}, 15, "alice's rank on the daemon")
        time.sleep(2.5)  # a rank checks for a server on its first ticks (serve=auto)
        assert _servers_of(ALICE) == []
        assert not (alice.spool_dir / files.SERVER_LOG).exists()
        assert not Path(f"/dev/shm/vramwatch-{daemon.port}").exists()  # no private spool either
    finally:
        alice.stop()


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = find_tool("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (make tools)")
    # verify checks that ExecStart's program exists: point it at this install's console script
    script = Path(sys.executable).parent / "vramwatch"
    if not script.exists():
        pytest.skip(f"no console script at {script}")
    text = UNIT.read_text().replace("/usr/local/bin/vramwatch", str(script))
    unit = tmp_path / "vramwatch.service"
    unit.write_text(text)
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


def test_the_unit_runs_unprivileged_and_hardened() -> None:
    svc = read_unit()["Service"]
    assert svc["User"] not in ("root", "0") and svc["Group"] not in ("root", "0")
    assert svc["ExecStart"].split()[1:] == ["serve", "--node"]
    assert svc["RuntimeDirectoryMode"] == "3733" and svc["RuntimeDirectoryPreserve"] == "restart"
    for key, value in {
        "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": "",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }.items():
        assert svc[key] == value, key
    assert "PrivateUsers" not in svc  # it would map every user's files to nobody
    assert "PrivateDevices" not in svc  # it would hide /dev/nvidia*

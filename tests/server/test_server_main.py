"""vramwatch.server.main in this process: serve(), Server.open, Server.run and Server.close on loopback.

The other server tests start ``vramwatch serve`` as a child process, which shows what a user sees but
leaves the loop's decisions out of reach. Here a real ExporterHTTPServer listens on 127.0.0.1 (port 0)
over a spool in tmp_path, with the simulated NVML, and the test scrapes it, stops it (by signal, as a
user does, or with ``Server.stop()``) and checks what it leaves behind: the exit code, the log lines,
the port, the lock, ``server.json`` and the threads.

``serve()`` installs its signal handlers, so it runs in the test's own (main) thread while a helper
thread looks at it and sends the signal. ``Server.run`` runs in a thread of its own. Every wait is
bounded; a loop that should have ended and did not is stopped by hand and the test fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import gc
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from samples import rank_sample

from harness.exporter import parse_metrics
from harness.net import http_get, port_open, wait_until
from vramwatch import spool
from vramwatch.config import Settings, server_settings
from vramwatch.server import main
from vramwatch.server.main import Server, _cause, serve
from vramwatch.server.port_owner import describe_port_owner
from vramwatch.sim.state import SimNode, state_path
from vramwatch.spool import node

Metrics = dict[str, list[tuple[dict[str, str], float]]]


@pytest.fixture(autouse=True)
def _process_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What serve() changes in its process, given back after each test; thread deaths fail the test."""
    switch = sys.getswitchinterval()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    # a server that lost its spool_dir (a bug, a mutant) must not make the machine's /dev/shm/vramwatch-0
    default = str(tmp_path / "default-spool")
    monkeypatch.setattr(Settings, "resolved_spool_dir", lambda self: self.spool_dir or default)
    died: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: died.append(f"{a.thread.name}: {a.exc_value!r}"))
    yield
    sys.setswitchinterval(switch)  # process.tune()
    gc.unfreeze()  # process.freeze()
    for s, h in handlers.items():
        signal.signal(s, h)
    assert not died, f"a server thread died: {died}"


def _settings(tmp_path: Path, nvml: bool = True, **kw: Any) -> Settings:
    d = tmp_path / "spool"
    d.mkdir(exist_ok=True)
    if nvml:
        SimNode.default(1).save(state_path(str(d)))
    else:
        kw.setdefault("xid", False)  # the simulated Xid watch alone costs half a second at each close()
    kw.setdefault("nvml_interval", 0.2)
    kw.setdefault("nvml_slow_interval", 0.5)
    # node_dir empty: a job server must not need one (only `serve --node` does)
    return Settings(simulate=True, nvml=nvml, spool_dir=str(d), port=0, node_dir="", **kw)


def _scrape(port: int) -> Metrics:
    code, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert code == 200, body[:500]
    return parse_metrics(body.decode())


def _server_info(spool_dir: str) -> dict[str, object] | None:
    try:
        with open(os.path.join(spool_dir, spool.SERVER_INFO), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _spool_health(m: Metrics) -> tuple[float, float]:
    """(up, errors) of the spool collector."""

    def one(name: str) -> float:
        [value] = [v for labels, v in m[name] if labels["collector"] == "spool"]
        return value

    return one("vramwatch_collector_up"), one("vramwatch_collector_errors_total")


def _new_threads(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t not in before and t.is_alive())


def _assert_released(spool_dir: str, port: int, before: set[threading.Thread]) -> None:
    """Nothing of a closed server stays: port, lock, server.json, threads."""
    assert not port_open(port), f"port {port} still answers"
    assert not spool.server_running(spool_dir), "the server lock is still held"
    assert not os.path.exists(os.path.join(spool_dir, spool.SERVER_INFO)), "server.json is left behind"
    wait_until(lambda: not _new_threads(before), 5, "the server's threads to end", interval=0.05)


def _sample(t: float, rank: int = 0) -> spool.RankSample:
    return rank_sample(rank, time=t)


# --- the loop's own reads of the spool, and a Server.run in a thread ---


@dataclass
class _Read:
    t: float  # monotonic, as the loop's `now`
    live: int
    final: int
    kwargs: dict[str, Any]


@dataclass
class _LoopReads:
    """Each read of the spool that Server.run's loop makes for idleness (the rank view's scrapes pass a `now`
    and are not counted). ``hold_first()`` makes the first such read wait until ``release()``."""

    reads: list[_Read] = field(default_factory=list)
    entered: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event | None = None

    def hold_first(self) -> None:
        self.gate = threading.Event()

    def release(self) -> None:
        assert self.gate is not None
        self.gate.set()

    def since_last_seen(self) -> float:
        """The time of the loop's last read that saw a rank, live or final."""
        return [r.t for r in self.reads if r.live or r.final][-1]


@pytest.fixture
def loop_reads(monkeypatch: pytest.MonkeyPatch) -> _LoopReads:
    lr = _LoopReads()
    real = spool.read_spool

    def spy(*args: Any, **kw: Any) -> spool.SpoolRead:
        if len(args) != 3 or "now" in kw:
            return real(*args, **kw)
        t = time.monotonic()
        if not lr.entered.is_set():
            lr.entered.set()
            if lr.gate is not None:
                lr.gate.wait(10)
        out = real(*args, **kw)
        lr.reads.append(_Read(t, len(out.live), len(out.final), kw))
        return out

    monkeypatch.setattr(spool, "read_spool", spy)
    return lr


def _assert_left_at_first_read_past(reads: list[_Read], since: float, linger: float) -> None:
    """The loop left at its first read more than ``linger`` s after ``since``: not before, not after."""
    after = [r.t - since for r in reads if r.t > since]
    assert after, "the loop made no read after the last rank it saw"
    assert after[-1] > linger, f"it left {after[-1]:.2f} s after, within the linger of {linger} s"
    assert all(a <= linger for a in after[:-1]), f"it stayed past the linger: reads at {after}"


class _Stuck(Exception):
    """Raised into a thread whose server loop did not end when stopped."""


def _interrupt(thread: threading.Thread) -> None:
    # the last resort against a loop that ignores stop(): an exception at its next bytecode, so the test
    # fails instead of spinning (serve()'s handlers also hold SIGTERM and SIGINT, so nothing else would end it)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0), ctypes.py_object(_Stuck))


class _Run:
    """Server.run in a thread (``exit_when_idle`` None: run()'s own default); the server stopped and the
    thread joined on exit, however the test ends."""

    def __init__(self, server: Server, exit_when_idle: bool | None = None) -> None:
        self.server = server
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(exit_when_idle,), name="test-run", daemon=True)

    def _run(self, exit_when_idle: bool | None) -> None:
        try:
            if exit_when_idle is None:
                self.server.run()
            else:
                self.server.run(exit_when_idle)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test by ended()
            self.error = e

    def __enter__(self) -> _Run:
        self.thread.start()
        wait_until(lambda: self.server._serving is not None, 5, "run() to start serving", interval=0.01)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.server.stop()
        self.thread.join(10)
        if self.thread.is_alive():
            _interrupt(self.thread)
            if exc_type is None:
                raise AssertionError("run() did not end after stop()")

    def ended(self, timeout: float) -> bool:
        """Whether run() returned within ``timeout`` s (re-raising what it raised)."""
        self.thread.join(timeout)
        if self.error is not None:
            raise self.error
        return not self.thread.is_alive()


@contextlib.contextmanager
def _opened(settings: Settings, node_daemon: bool = False) -> Iterator[Server]:
    server = Server(settings, node_daemon)
    try:
        assert server.open() is True
        yield server
    finally:
        server.close()


# --- serve() in this thread ---


@dataclass
class _Served:
    rc: int | None
    looked: Any
    elapsed: float
    stuck: bool


def _serve_here(
    monkeypatch: pytest.MonkeyPatch,
    settings: Settings,
    *,
    exit_when_idle: bool = False,
    node_daemon: bool = False,
    look: Callable[[Server], Any] | None = None,
    stop_with: int | None = None,
    limit: float = 15.0,
) -> _Served:
    """serve() here, in the main thread its signal handlers need. Once run() serves, ``look(server)`` runs
    in a thread and then ``stop_with`` (a signal) goes to this process. A serve() still running ``limit`` s
    after it started is stopped by hand (``stuck``): a wrong loop ends the test instead of hanging it."""
    servers: list[Server] = []
    real_open = Server.open

    def open_spy(self: Server) -> bool:
        servers.append(self)
        return real_open(self)

    monkeypatch.setattr(Server, "open", open_spy)
    done = threading.Event()
    out: dict[str, Any] = {}

    def helper() -> None:
        t0 = time.monotonic()
        try:
            if look is not None or stop_with is not None:
                # run() sets _serving after serve() installed its handlers: a signal is safe from then on
                wait_until(lambda: servers and servers[0]._serving is not None, limit, "run() to serve", 0.01)
                try:
                    if look is not None:
                        out["looked"] = look(servers[0])
                finally:
                    if stop_with is not None:
                        os.kill(os.getpid(), stop_with)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test
            out["error"] = e
        if not done.wait(max(0.0, limit - (time.monotonic() - t0))):
            out["stuck"] = True
            for s in servers:
                s.stop()
            if not done.wait(10):
                _interrupt(threading.main_thread())

    t = threading.Thread(target=helper, name="test-helper", daemon=True)
    t0 = time.monotonic()
    t.start()
    try:
        # serve()'s own defaults unless told otherwise: a job server, not rank-started
        kw = {k: True for k, v in (("exit_when_idle", exit_when_idle), ("node_daemon", node_daemon)) if v}
        rc = serve(settings, **kw)
    finally:
        done.set()
        t.join(limit + 5)
    if "error" in out:
        raise out["error"]
    return _Served(rc, out.get("looked"), time.monotonic() - t0, out.get("stuck", False))


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vramwatch" and r.levelno == level]


# --- the tests: the quick ones first (mutmut stops a mutant's run at its first failure) ---


def test_cause_is_the_error_text_with_its_errno_name_when_there_is_one():
    assert _cause(OSError(errno.ENOSPC, "No space left on device")) == "No space left on device (ENOSPC)"
    assert _cause(OSError(99999, "odd")) == "odd"  # no name for it: nothing in parentheses
    assert _cause(OSError("plain text")) == "plain text"  # no errno, no strerror: the exception's own text


def test_close_before_open_and_a_second_close_do_nothing(tmp_path):
    settings = _settings(tmp_path, nvml=False)
    Server(settings).close()  # a server that failed before open() is closed by the caller
    server = Server(settings)
    assert server.open()
    port = server.port
    server.close()
    server.close()
    assert not port_open(port)


def test_open_binds_says_where_in_server_json_and_close_without_run_releases_it_at_once(tmp_path):
    settings = _settings(tmp_path, max_connections=3)
    before = set(threading.enumerate())
    server = Server(settings)
    assert server.mode == "job" and server.spool_dir == settings.spool_dir
    try:
        assert server.open() is True
        port = server.port
        assert port != 0 and port == server.http.socket.getsockname()[1]
        assert _server_info(settings.spool_dir) == {
            "pid": os.getpid(),
            "host": "127.0.0.1",
            "port": port,
            "settings": server_settings(server.settings),  # what a rank compares with its own
            "exit_when_idle": False,
        }
        assert spool.server_running(settings.spool_dir)
        assert server.http.admission.total == 3  # max_connections reaches the listener
        assert server.exposition.refreshing
        names = _new_threads(before)
        assert "vramwatch-render" in names and "vramwatch-nvml" in names, names  # the collectors read already
    finally:
        closing = threading.Thread(target=server.close, daemon=True)
        closing.start()
        closing.join(10)
    assert not closing.is_alive(), "close() without run() hung"
    assert server.http is None
    _assert_released(settings.spool_dir, port, before)


def test_a_spool_another_server_holds_is_refused_before_binding_exit_1_or_0_when_rank_started(
    tmp_path, monkeypatch, caplog
):
    settings = _settings(tmp_path, nvml=False)
    caplog.set_level(logging.INFO, logger="vramwatch")
    with _opened(settings) as first:
        info = _server_info(settings.spool_dir)
        before = set(threading.enumerate())
        second = Server(settings)
        assert second.open() is False
        assert second.http is None and second.exporter is None and not _new_threads(before)
        second.close()  # the lock and server.json are the first server's: left alone
        assert _serve_here(monkeypatch, settings, limit=5).rc == 1  # by hand: an error
        assert _serve_here(monkeypatch, settings, exit_when_idle=True, limit=5).rc == 0  # a rank's race, lost
        assert (
            _messages(caplog, logging.WARNING) == [f"vramwatch: another server already serves {settings.spool_dir}"] * 2
        )
        assert _server_info(settings.spool_dir) == info and spool.server_running(settings.spool_dir)
        assert port_open(first.port)


def test_serve_node_without_node_dir_exits_1_and_makes_nothing(tmp_path, monkeypatch, caplog):
    settings = dataclasses.replace(_settings(tmp_path, nvml=False), spool_dir=str(tmp_path / "never"))
    served = _serve_here(monkeypatch, settings, node_daemon=True, limit=5)
    assert served.rc == 1 and not served.stuck
    assert _messages(caplog, logging.ERROR) == ["vramwatch: serve --node needs node_dir (the node spool's root)"]
    assert not os.path.exists(tmp_path / "never") and not os.path.exists(tmp_path / "default-spool")


def test_a_spool_directory_that_cannot_be_made_exits_1_naming_it(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("")
    settings = dataclasses.replace(_settings(tmp_path, nvml=False), spool_dir=str(tmp_path / "file" / "spool"))
    served = _serve_here(monkeypatch, settings, limit=5)
    assert served.rc == 1 and not served.stuck
    assert _messages(caplog, logging.ERROR) == [
        f"vramwatch: cannot use the spool directory {settings.spool_dir}: Not a directory"
    ]


def test_a_server_lock_that_cannot_be_opened_exits_1_naming_the_file(tmp_path, monkeypatch, caplog):
    settings = _settings(tmp_path, nvml=False)
    lock = os.path.join(settings.spool_dir, spool.SERVER_LOCK)
    os.mkdir(lock)  # an OSError of open(), not a StartupError: named by its file and errno
    before = set(threading.enumerate())
    served = _serve_here(monkeypatch, settings, limit=5)
    assert served.rc == 1 and not served.stuck
    assert _messages(caplog, logging.ERROR) == [f"vramwatch: cannot use {lock}: Is a directory (EISDIR)"]
    assert not _new_threads(before)


def test_a_port_in_use_exits_1_naming_its_holder_and_releases_the_lock(tmp_path, monkeypatch, caplog):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        settings = dataclasses.replace(_settings(tmp_path, nvml=False), port=port)
        before = set(threading.enumerate())
        served = _serve_here(monkeypatch, settings, limit=5)
        owner = describe_port_owner(port)
    assert served.rc == 1 and not served.stuck
    assert f"pid {os.getpid()}" in owner, owner
    assert _messages(caplog, logging.ERROR) == [
        f"vramwatch: cannot listen on 127.0.0.1:{port}: Address already in use (EADDRINUSE); port {port} is in "
        f"use, {owner}; Prometheus scraping it sees that process, not this job"
    ]
    assert not spool.server_running(settings.spool_dir)
    assert _server_info(settings.spool_dir) is None
    wait_until(lambda: not _new_threads(before), 5, "the collectors' threads to end", interval=0.05)


def test_an_address_it_cannot_bind_is_named_without_blaming_a_holder(tmp_path, monkeypatch, caplog):
    # 192.0.2.1 (TEST-NET-1) is no address of this host: EADDRNOTAVAIL, not EADDRINUSE
    settings = dataclasses.replace(_settings(tmp_path, nvml=False), host="192.0.2.1")
    served = _serve_here(monkeypatch, settings, limit=5)
    assert served.rc == 1 and not served.stuck
    assert _messages(caplog, logging.ERROR) == [
        "vramwatch: cannot listen on 192.0.2.1:0: Cannot assign requested address (EADDRNOTAVAIL)"
    ]
    assert not spool.server_running(settings.spool_dir)


def test_the_web_config_reaches_the_listener_tls_basic_auth_and_headers(tmp_path):
    import bcrypt
    from tlsutil import make_pki

    pki = make_pki(tmp_path / "pki")
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {pki.cert}\n  key_file: {pki.key}\n"
        "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
        f"basic_auth_users:\n  prometheus: {bcrypt.hashpw(b's3cret', bcrypt.gensalt(4)).decode()}\n"
    )
    settings = _settings(tmp_path, nvml=False, web_config_file=str(web))
    ctx = ssl.create_default_context(cafile=str(pki.ca))

    def get(auth: str | None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=ctx, timeout=5)
        try:
            conn.request("GET", "/metrics", headers={"Authorization": auth} if auth else {})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    with _opened(settings) as server, _Run(server):
        status, headers, _ = get(None)
        assert status == 401 and headers["WWW-Authenticate"] == 'Basic realm="vramwatch"'
        status, headers, body = get("Basic cHJvbWV0aGV1czpzM2NyZXQ=")  # prometheus:s3cret
        assert status == 200, body[:300]
        assert headers["X-Frame-Options"] == "deny"
        assert parse_metrics(body.decode())["vramwatch_server_mode"] == [({"mode": "job"}, 1.0)]


def test_serve_runs_until_sigterm_and_leaves_nothing_behind(tmp_path, monkeypatch, caplog):
    settings = _settings(tmp_path)
    caplog.set_level(logging.INFO, logger="vramwatch")
    before = set(threading.enumerate())

    def look(server: Server) -> dict[str, Any]:
        serving = server._serving
        assert serving is not None
        return {
            "port": server.port,
            "info": _server_info(settings.spool_dir),
            "metrics": _scrape(server.port),
            "serving": serving,
            "thread": (serving.name, serving.daemon, serving.is_alive()),
        }

    served = _serve_here(monkeypatch, settings, look=look, stop_with=signal.SIGTERM)
    assert served.rc == 0 and not served.stuck, "SIGTERM did not stop serve()"
    got = served.looked
    port = got["port"]
    assert {k: got["info"][k] for k in ("pid", "host", "port", "exit_when_idle")} == {
        "pid": os.getpid(),
        "host": "127.0.0.1",
        "port": port,
        "exit_when_idle": False,
    }
    assert got["metrics"]["vramwatch_server_mode"] == [({"mode": "job"}, 1.0)]
    assert [v for labels, v in got["metrics"]["gpu_up"]] == [1.0]  # the simulated NVML, read by the server
    assert got["metrics"]["vramwatch_ranks"] == [({}, 0.0)]
    # a daemon thread named for py-spy and stack dumps: it never keeps a dying process alive
    assert got["thread"] == ("vramwatch-http", True, True)
    assert f"vramwatch: serving http://127.0.0.1:{port}/metrics (job mode, spool {settings.spool_dir})" in _messages(
        caplog, logging.INFO
    )
    assert not _messages(caplog, logging.ERROR) and not _messages(caplog, logging.WARNING)
    got["serving"].join(5)
    assert not got["serving"].is_alive(), "the HTTP loop outlived serve()"
    _assert_released(settings.spool_dir, port, before)


def test_serve_node_runs_until_sigint_over_the_node_root(tmp_path, monkeypatch, caplog):
    root = tmp_path / "root"
    settings = dataclasses.replace(
        _settings(tmp_path, nvml=False), node_dir=str(root), spool_dir=str(tmp_path / "unused")
    )
    caplog.set_level(logging.INFO, logger="vramwatch")
    before = set(threading.enumerate())

    def look(server: Server) -> dict[str, Any]:
        lock = os.stat(root / spool.SERVER_LOCK)
        return {
            "port": server.port,
            "info": _server_info(str(root)),
            "metrics": _scrape(server.port),
            "modes": (stat.S_IMODE(os.stat(root).st_mode), stat.S_IMODE(lock.st_mode)),
        }

    served = _serve_here(monkeypatch, settings, node_daemon=True, look=look, stop_with=signal.SIGINT)
    assert served.rc == 0 and not served.stuck, "SIGINT did not stop serve()"
    got = served.looked
    port = got["port"]
    assert {k: got["info"][k] for k in ("pid", "host", "port", "exit_when_idle")} == {
        "pid": os.getpid(),
        "host": "127.0.0.1",
        "port": port,
        "exit_when_idle": False,
    }
    assert got["metrics"]["vramwatch_server_mode"] == [({"mode": "node"}, 1.0)]
    # the root as systemd makes it, and a lock every user's ranks can open to ask whether the daemon runs
    assert got["modes"] == (node.ROOT_MODE, node.SHARED_MODE)
    assert f"vramwatch: serving http://127.0.0.1:{port}/metrics (node mode, spool {root})" in _messages(
        caplog, logging.INFO
    )
    assert not os.path.exists(tmp_path / "unused")
    _assert_released(str(root), port, before)


def test_a_rank_started_serve_that_no_rank_reaches_exits_0_after_the_grace(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(main, "_FIRST_RANK_GRACE", 1.5)
    settings = _settings(tmp_path, nvml=False)
    before = set(threading.enumerate())
    served = _serve_here(monkeypatch, settings, exit_when_idle=True, limit=10)
    assert served.rc == 0 and not served.stuck
    assert served.elapsed >= 1.5, f"it gave up after {served.elapsed:.2f} s, before the grace"
    assert _messages(caplog, logging.WARNING) == ["vramwatch: no rank published within 2 s; exiting"]
    spool_dir = settings.spool_dir
    assert not spool.server_running(spool_dir) and _server_info(spool_dir) is None
    wait_until(lambda: not _new_threads(before), 5, "the server's threads to end", interval=0.05)


def test_a_job_server_outlives_the_grace_and_makes_its_vanished_spool_again(tmp_path, monkeypatch, loop_reads):
    """Without exit_when_idle nothing but a stop ends the loop; each second it checks the spool is the one
    it took, and makes it again (counted as a spool error; the spool down while it cannot)."""
    monkeypatch.setattr(main, "_FIRST_RANK_GRACE", 0.01)
    settings = _settings(tmp_path, nvml=False)
    d = settings.spool_dir
    with _opened(settings) as server:
        checks: list[float] = []
        check = server.guard.check
        server.guard.check = lambda health: (checks.append(time.monotonic()), check(health))[1]  # type: ignore[method-assign]
        info = _server_info(d)
        with _Run(server) as run:
            wait_until(lambda: checks, 10, "a turn of the loop")
            assert not run.ended(0), "a job server gave up with no rank"
            assert loop_reads.reads == [], "a job server read the spool for idleness"
            assert _spool_health(_scrape(server.port)) == (1.0, 0.0)

            shutil.rmtree(d)  # RemoveIPC at logout
            wait_until(lambda: _server_info(d) == info and spool.server_running(d), 5, "the spool made again")
            assert _spool_health(_scrape(server.port)) == (1.0, 1.0)

            shutil.rmtree(d)
            Path(d).write_text("")  # now it cannot be made again: the spool is down, the server serves on
            wait_until(lambda: _spool_health(_scrape(server.port)) == (0.0, 2.0), 5, "the spool down")
            os.unlink(d)
            wait_until(lambda: _spool_health(_scrape(server.port)) == (1.0, 2.0), 5, "the spool back")
            assert _server_info(d) == info
            assert not run.ended(0)
        assert run.ended(5)
        assert loop_reads.reads == []


def test_a_dead_ranks_old_file_starts_the_linger_and_is_left_for_a_scrape_to_reap(tmp_path, monkeypatch, loop_reads):
    """A rank came and died before the server looked, its sample past the grace: the server still lingers
    from its first look (not the first-rank grace) and leaves the file to the rank view's reaping."""
    monkeypatch.setattr(main, "_FIRST_RANK_GRACE", 20.0)
    settings = _settings(tmp_path, nvml=False, linger=1.2, dead_rank_grace_seconds=1.0)
    pub = spool.RankPublisher(settings.spool_dir, 0)
    pub.publish(_sample(time.time() - 60))
    pub.close()
    with _opened(settings) as server, _Run(server, exit_when_idle=True) as run:
        assert run.ended(8), "the server waited for the first-rank grace"
    assert [(r.live, r.final) for r in loop_reads.reads] == [(0, 0)] * len(loop_reads.reads)
    assert all(r.kwargs == {"reap": False} for r in loop_reads.reads)
    _assert_left_at_first_read_past(loop_reads.reads, loop_reads.reads[0].t, 1.2)
    assert os.path.exists(pub.path), "the loop reaped the rank's file"


def test_a_rank_only_a_scrape_saw_starts_the_linger(tmp_path, monkeypatch, loop_reads):
    """A rank that came and went between two looks of the loop, gone from the spool: a scrape that carried
    it is what tells the server a rank was there."""
    monkeypatch.setattr(main, "_FIRST_RANK_GRACE", 20.0)
    settings = _settings(tmp_path, nvml=False, linger=1.2, dead_rank_grace_seconds=1.0)
    pub = spool.RankPublisher(settings.spool_dir, 0)
    pub.publish(_sample(time.time() - 60))  # past the grace: dead, it is gone at the next scrape
    loop_reads.hold_first()
    with _opened(settings) as server, _Run(server, exit_when_idle=True) as run:
        assert loop_reads.entered.wait(5)
        assert _scrape(server.port)["vramwatch_ranks"] == [({}, 1.0)]
        pub.close()  # the cache's refresher sees the death at its next look (0.25 s) and renders it
        wait_until(lambda: _scrape(server.port)["vramwatch_ranks"] == [({}, 0.0)], 5, "the death rendered")
        assert not spool.any_rank_files(settings.spool_dir), "the render did not reap the dead rank"
        loop_reads.release()
        assert run.ended(8), "the server waited for the first-rank grace"
    assert [(r.live, r.final) for r in loop_reads.reads] == [(0, 0)] * len(loop_reads.reads)
    _assert_left_at_first_read_past(loop_reads.reads, loop_reads.reads[0].t, 1.2)


def test_a_live_rank_then_its_final_sample_keep_the_server_up_and_the_last_look_starts_the_linger(tmp_path, loop_reads):
    settings = _settings(tmp_path, nvml=False, linger=1.2, dead_rank_grace_seconds=1.5)
    pub = spool.RankPublisher(settings.spool_dir, 0)
    pub.publish(_sample(time.time()))
    with _opened(settings) as server, _Run(server, exit_when_idle=True) as run:
        wait_until(lambda: loop_reads.reads, 5, "a look at the live rank")
        assert not run.ended(0), "the server left with a rank alive"
        assert _scrape(server.port)["vramwatch_ranks"] == [({}, 1.0)]
        pub.publish(_sample(time.time()))
        pub.close()  # its last sample is its final one, served for 1.5 s
        assert run.ended(8)
    reads = loop_reads.reads
    assert reads[0].live == 1
    assert any(r.final and not r.live for r in reads), "no look saw the final sample"
    _assert_left_at_first_read_past(reads, loop_reads.since_last_seen(), 1.2)

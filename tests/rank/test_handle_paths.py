"""The rank's ``Handle`` piece by piece: where it publishes (its spool, a node daemon's root, nothing under
``serve="off"``), what it logs when that fails, how a tick and an OOM's publish write the sample, the
server it starts, its URL, ``watch`` and ``step``. A ``Handle`` is built from ``Settings`` directly; the
sampler thread waits an hour between ticks, so every tick here is the test's own."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

import vramwatch
from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.rank import handle as handle_mod
from vramwatch.rank import server_spawn
from vramwatch.rank.handle import Handle
from vramwatch.rank.plugins import Plugins
from vramwatch.spool import files, node


def _handle(spool_dir: Any, **kw: Any) -> Handle:
    s = {"simulate": True, "serve": "external", "spool_dir": str(spool_dir), "interval": 3600.0, **kw}
    return Handle(Settings(**s), {})


def _samples(spool_dir: Any) -> list[Any]:
    return spool.read_samples(str(spool_dir), 64, reap=False)


def _rank_files(spool_dir: Any) -> list[str]:
    if not os.path.isdir(spool_dir):
        return []
    return sorted(n for n in os.listdir(spool_dir) if files.RANK_FILE.match(n))


def _sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "vramwatch-sampler"]


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Settings, str]]:
    calls: list[tuple[Settings, str]] = []

    def fake(settings: Settings, spool_dir: str) -> Any:
        calls.append((settings, spool_dir))
        return types.SimpleNamespace(poll=lambda: None, returncode=None)

    monkeypatch.setattr(server_spawn, "spawn_server", fake)
    return calls


def test_serve_off_publishes_nothing_starts_no_thread_and_stops_quietly(tmp_path, caplog, spawned):
    before = _sampler_threads()
    h = _handle(tmp_path / "spool", serve="off")
    assert (h.oom, h.hygiene, h.status) == (None, None, None)
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        h.start()
        h.step(loss=1.0)
        h.tick()
        assert h.publish_now() is False
        h.stop()
    assert _rank_files(tmp_path / "spool") == []
    assert _sampler_threads() == before
    assert spawned == []
    assert [r.getMessage() for r in caplog.records] == []


def test_the_sample_carries_the_rank_and_its_job_in_the_file_and_in_it(tmp_path):
    h = _handle(tmp_path, rank=3, local_rank=1, world_size=4, job_id="train-42")
    h.start()
    try:
        assert _rank_files(tmp_path) == [f"rank-3-{os.getpid()}-train-42.json"]
        (s,) = _samples(tmp_path)
        assert (s.rank, s.local_rank, s.job_id) == (3, 1, "train-42")
        assert os.stat(tmp_path / _rank_files(tmp_path)[0]).st_mode & 0o777 == 0o600, "private outside a node root"
    finally:
        h.stop()


def test_start_returns_the_settings_sources(tmp_path):
    with vramwatch.start(simulate=True, serve="off", spool_dir=str(tmp_path), port=9555) as h:
        assert h.settings.port == 9555
        assert set(h.sources) >= {"port", "serve"} and h.sources["port"] != h.sources["interval"]


def test_an_unusable_spool_is_one_warning_and_nothing_else(tmp_path, caplog, spawned):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    spool_dir = str(blocker / "spool")
    h = _handle(spool_dir, serve="auto")
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        h.start()
        assert h.publish_now() is False
        h.stop()
    (r,) = [r for r in caplog.records if r.module == "_once"]  # the simulator's own line aside
    assert r.levelno == logging.WARNING
    msg = r.getMessage()
    assert msg.startswith(f"vramwatch: cannot publish into {spool_dir} ([Errno 20] Not a directory")
    assert msg.endswith("); exporting nothing")
    assert spawned == []


def test_plugins_that_fail_to_attach_are_one_warning_and_the_rank_still_publishes(tmp_path, caplog, monkeypatch):
    def broken(ctx: Any) -> Plugins:
        raise RuntimeError("boom")

    monkeypatch.setattr(handle_mod, "attach", broken)
    h = _handle(tmp_path)
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        h.start()
        h.step()
        h.tick()
        (s,) = _samples(tmp_path)
        h.stop()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "vramwatch: OOM forensics / status / hygiene unavailable: RuntimeError('boom')")
    ]
    assert s.heartbeat.steps == 1 and h.oom is None


def test_the_plugins_get_the_servers_spool_and_the_publish_of_this_rank(tmp_path, monkeypatch):
    seen: list[Any] = []

    def record(ctx: Any) -> Plugins:
        seen.append(ctx)
        return Plugins()

    monkeypatch.setattr(handle_mod, "attach", record)
    h = _handle(tmp_path)
    h.start()
    h.stop()
    (ctx,) = seen
    assert ctx.spool_dir == str(tmp_path) and ctx.settings is h.settings and ctx.identity is h.identity
    assert ctx.publish_now == h.publish_now and ctx.heartbeat is h.heartbeat and ctx.source is h.source


# --- a node daemon's root (deploy/systemd/) ---


@pytest.fixture
def root(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    r = tmp_path / "vramwatch"
    r.mkdir()
    r.chmod(node.ROOT_MODE)
    (r / files.SERVER_LOCK).touch()
    return r


def _node_handle(root: Path, **kw: Any) -> Handle:
    return _handle(kw.pop("spool_dir", ""), **{"serve": "auto", "node_dir": str(root), **kw})


def _user_dirs(root: Path) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith("u")]


def test_a_rank_under_a_node_root_publishes_into_its_user_dir_and_starts_no_server(root, caplog, monkeypatch, spawned):
    seen: list[Any] = []
    real_attach = handle_mod.attach
    monkeypatch.setattr(handle_mod, "attach", lambda ctx: seen.append(ctx) or real_attach(ctx))
    h = _node_handle(root)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        h.start()
        h.tick()
        h.stop()
    user = root / node.user_dir_name(os.geteuid())
    assert h.spool_dir == str(user)
    (name,) = _rank_files(user)
    assert os.stat(user / name).st_mode & 0o777 == node.FILE_MODE, "readable by the daemon's group"
    assert spawned == [], "the daemon serves this rank"
    assert seen[0].spool_dir == str(root), "the status line reads the daemon's readings, in the root"
    assert [r.getMessage() for r in caplog.records] == [
        f"vramwatch: the node daemon's spool {root} is set up but no daemon holds its lock; publishing there "
        "for when it is back (systemctl status vramwatch)"
    ]


def test_a_running_node_daemon_is_not_warned_about(root, caplog, spawned):
    fd = files.hold_lock(str(root / files.SERVER_LOCK))  # the daemon
    try:
        h = _node_handle(root)
        with caplog.at_level(logging.WARNING, logger="vramwatch"):
            h.start()
            h.stop()
    finally:
        os.close(fd)
    assert caplog.records == [] and spawned == []
    assert _rank_files(root / node.user_dir_name(os.geteuid()))


def test_a_spool_dir_of_its_own_or_serve_off_leaves_the_node_root_alone(root, tmp_path, spawned):
    own = tmp_path / "own"
    h = _node_handle(root, spool_dir=str(own))
    h.start()
    h.stop()
    assert _rank_files(own) and spawned == [(h.settings, str(own))], "its own spool, its own server"
    h = _node_handle(root, serve="off")
    h.start()
    h.stop()
    assert _user_dirs(root) == [], "no user directory made"


def test_a_node_root_without_room_for_this_user_is_one_warning_naming_it(root, caplog, monkeypatch, spawned):
    def refuse(r: str) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(node, "user_dir", refuse)
    h = _node_handle(root)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        h.start()
        h.tick()
        h.stop()
    assert [r.getMessage() for r in caplog.records] == [
        f"vramwatch: cannot publish into {root} ([Errno 13] Permission denied); exporting nothing"
    ]
    assert _user_dirs(root) == [] and _rank_files(root) == [] and spawned == []


# --- the server this rank starts (serve="auto") ---


def test_the_first_tick_starts_the_server_for_this_spool_and_its_exit_is_logged(tmp_path, caplog, monkeypatch):
    clock = [5000.0]
    monkeypatch.setattr(server_spawn, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    server = types.SimpleNamespace(returncode=None)
    server.poll = lambda: server.returncode
    calls: list[tuple[Settings, str]] = []
    monkeypatch.setattr(server_spawn, "spawn_server", lambda s, d: calls.append((s, d)) or server)
    h = _handle(tmp_path, serve="auto")
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        h.start()
        assert calls == [(h.settings, str(tmp_path))]
        server.returncode = 2
        clock[0] += 2.0
        h.tick()
        h.stop()
    assert len(calls) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"vramwatch: the server exited with 2; see {tmp_path / spool.SERVER_LOG}"
    ]


def test_a_server_that_cannot_start_is_one_warning_per_kind_of_error_and_the_sample_still_goes_out(
    tmp_path, caplog, monkeypatch
):
    errors = [PermissionError(13, "Permission denied"), PermissionError(13, "again"), FileNotFoundError("python")]

    def fail(settings: Settings, spool_dir: str) -> Any:
        raise errors.pop(0)

    monkeypatch.setattr(server_spawn, "spawn_server", fail)
    h = _handle(tmp_path, serve="auto")
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        h.start()
        h.tick()
        h.tick()
        published = _samples(tmp_path)
        h.stop()
    assert errors == [] and len(published) == 1
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "vramwatch: cannot start the server: PermissionError(13, 'Permission denied')"),
        (logging.WARNING, "vramwatch: cannot start the server: FileNotFoundError('python')"),
    ]


# --- how samples are written ---


def test_ticks_rewrite_the_sample_in_place_and_an_ooms_publish_renames_a_whole_new_one(tmp_path):
    h = _handle(tmp_path)
    h.start()
    try:
        (name,) = _rank_files(tmp_path)
        path = tmp_path / name
        first = os.stat(path).st_ino
        h.step()
        h.tick()
        assert os.stat(path).st_ino == first, "a tick writes into the open file"
        assert _samples(tmp_path)[0].heartbeat.steps == 1
        h.step()
        assert h.publish_now() is True
        renamed = os.stat(path).st_ino
        assert renamed != first, "renamed into place"
        assert _samples(tmp_path)[0].heartbeat.steps == 2, "the sample of the moment, before returning"
        h.tick()
        assert os.stat(path).st_ino == renamed
    finally:
        h.stop()


def test_an_ooms_publish_behind_a_wedged_tick_gives_up_after_a_second_and_wakes_the_sampler(tmp_path):
    h = _handle(tmp_path)
    h.start()
    try:
        h.step()
        h._publish_lock.acquire()  # a tick in progress
        t0 = time.monotonic()
        try:
            assert h.publish_now() is False
        finally:
            h._publish_lock.release()
        assert 0.9 <= time.monotonic() - t0 < 5.0
        end = time.monotonic() + 5.0
        while _samples(tmp_path)[0].heartbeat.steps != 1:  # the sampler thread publishes it instead
            assert time.monotonic() < end, "the sampler was not woken"
            time.sleep(0.01)
    finally:
        h.stop()


def test_a_forked_child_publishes_nothing(tmp_path):
    h = _handle(tmp_path)
    h.start()
    try:
        path = tmp_path / _rank_files(tmp_path)[0]
        ino = os.stat(path).st_ino
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: answer and leave at once, whatever happens
            try:
                os.write(w, b"1" if h.publish_now() else b"0")
            finally:
                os._exit(0)
        os.close(w)
        answer = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert answer == b"0"
        assert os.stat(path).st_ino == ino
    finally:
        h.stop()


# --- url, watch, step ---


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:9555/metrics"),
        ("0.0.0.0", "http://127.0.0.1:9555/metrics"),
        ("::", "http://127.0.0.1:9555/metrics"),
        ("::1", "http://[::1]:9555/metrics"),
        ("10.1.2.3", "http://10.1.2.3:9555/metrics"),
    ],
)
def test_the_url_names_a_host_one_can_reach(tmp_path, host, url):
    assert _handle(tmp_path, serve="off", host=host, port=9555).url == url


@pytest.mark.parametrize(
    ("config", "scheme"),
    [
        ("tls_server_config:\n  cert_file: c.pem\n  key_file: k.pem\n", "https"),
        ("basic_auth_users:\n  alice: $2y$10$x\n", "http"),
        ("", "http"),
        ("tls_server_config: [unclosed\n", "http"),
        (None, "http"),
    ],
)
def test_the_url_is_https_when_the_web_config_serves_tls(tmp_path, config, scheme):
    web = tmp_path / "web.yml"
    if config is not None:
        web.write_text(config, encoding="utf-8")
    h = _handle(tmp_path, serve="off", port=9555, web_config_file=str(web))
    assert h.url == f"{scheme}://127.0.0.1:9555/metrics"
    assert _handle(tmp_path, serve="off", port=9555).url.startswith("http://")


def test_watch_walks_roles_only_for_something_to_walk_and_when_enabled(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = _handle(tmp_path, serve="off")
    for args in [(model, None), (None, opt), (model, opt)]:
        h.watch(*args)
        assert h.roles is not None, args
    h.watch(None)
    assert h.roles is None
    h.watch(model, opt)
    off = _handle(tmp_path, serve="off", role_interval=0.0)
    off.watch(model, opt)
    assert off.roles is None


@pytest.mark.parametrize(
    ("given", "published"),
    [
        (6e9, 6e9),
        (0.5, 0.5),
        (7, 7.0),
        (None, None),
        (0, None),
        (0.0, None),
        (-1.0, None),
        (math.inf, None),
        (math.nan, None),
        (True, None),
        ("6e9", None),
    ],
)
def test_watch_publishes_only_a_positive_finite_flops_per_token(tmp_path, given, published):
    h = _handle(tmp_path)
    h.start()
    try:
        h.watch(None, flops_per_token=given)
        h.step()
        h.tick()
        (s,) = _samples(tmp_path)
        assert s.heartbeat.steps == 1, "published: an infinity would fail every publish from then on"
        assert s.flops_per_token == published and type(s.flops_per_token) is type(published)
    finally:
        h.stop()


def test_step_reports_each_value_in_its_place_and_runs_the_hooks(tmp_path):
    h = _handle(tmp_path, serve="off")
    ran: list[int] = []
    h.step_hooks = (lambda: ran.append(1),)
    h.step(loss=0.5, grad_norm=2.0, tokens=128, samples=4)
    h.step(0.25, 3.0, 128, 4)
    hb = h.heartbeat.snapshot()
    assert (hb.steps, hb.loss, hb.grad_norm, hb.tokens, hb.samples) == (2, 0.25, 3.0, 256, 8)
    assert ran == [1, 1]


def test_stop_leaves_the_last_moments_sample_and_a_stopped_handle_stays_harmless(tmp_path):
    h = _handle(tmp_path)
    h.start()
    for _ in range(3):
        h.step()
    h.stop()
    (final,) = spool.read_spool(str(tmp_path), 64, 60.0, reap=False).final
    assert final.heartbeat.steps == 3, "published at stop, not only at the last tick"
    h.step()  # a job still holding the handle
    assert h.publish_now() is False
    h.stop()


def test_a_failing_publish_is_one_warning_per_kind_of_error_and_never_raises(tmp_path, caplog, monkeypatch):
    h = _handle(tmp_path)
    h.start()
    try:
        assert h._publisher is not None
        errors: list[Exception] = [OSError(28, "No space left on device"), OSError(28, "again"), ValueError("bad")]

        def fail(sample: Any, replace: bool = False) -> None:
            raise errors.pop(0)

        monkeypatch.setattr(h._publisher, "publish", fail)
        with caplog.at_level(logging.DEBUG, logger="vramwatch"):
            h.tick()
            assert h.publish_now() is True  # it ran here; what failed is said once
            h.tick()
        assert errors == []
        assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
            (logging.WARNING, "vramwatch: publishing failed: OSError(28, 'No space left on device')"),
            (logging.WARNING, "vramwatch: publishing failed: ValueError('bad')"),
        ]
    finally:
        monkeypatch.undo()
        h.stop()

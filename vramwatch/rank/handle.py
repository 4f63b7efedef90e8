"""What ``vramwatch.start()`` sets up in a training process.

One daemon thread samples the allocator and the heartbeat every
``interval`` seconds and publishes one file into the spool; the node's HTTP
server lives in another process (started here if none runs), so a wedged
training thread, even one holding the GIL, never stops a scrape. After
``start()`` returns nothing raises into the job: failures are logged once
and published as ``vramwatch_collector_up`` 0.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.rank.allocator import AllocatorSampler, AllocatorSource, TorchSource
from vramwatch.rank.heartbeat import Heartbeat
from vramwatch.rank.identity import RankIdentity, identify

log = logging.getLogger("vramwatch")

_SPAWN_BACKOFF_MAX = 60.0


class _OnceLog:
    """Log each distinct problem once, then only count it."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, key: str, msg: str, *args: Any) -> None:
        if key not in self.seen:
            self.seen.add(key)
            log.warning(msg, *args)


class Handle:
    """A running exporter in this process; returned by ``vramwatch.start()``."""

    def __init__(self, settings: Settings, sources: dict[str, str]) -> None:
        self.settings = settings
        self.sources = sources
        self.identity: RankIdentity = identify(settings.rank, settings.local_rank, settings.world_size)
        self.heartbeat = Heartbeat()
        self.spool_dir = settings.resolved_spool_dir()
        self.hostname = settings.resolved_hostname()
        self.sim = None
        self.source: AllocatorSource
        if settings.simulate:
            from vramwatch.sim.allocator import SimAllocator
            from vramwatch.sim.state import SimNode, load_or_create

            try:
                node = load_or_create(self.spool_dir)
            except OSError as e:  # start() raises only ConfigError: an unusable spool is reported later
                log.warning(
                    "vramwatch: cannot read the simulated node in %s (%s); using a default one", self.spool_dir, e
                )
                node = SimNode.default(1)
            self.sim = SimAllocator(node)
            self.source = self.sim
        else:
            self.source = TorchSource()
        self.sampler = AllocatorSampler(self.source, settings.largest_block_interval)
        self.extra: dict[str, Any] = {}  # other sample sections (OOM snapshot info, ...)
        # integrations (vramwatch.integrations.setup): OOM forensics, hygiene, status line
        self.oom: Any = None
        self.hygiene: Any = None
        self.status: Any = None
        self.step_hooks: tuple[Any, ...] = ()  # run by step() on the training thread; empty when all are off
        self.sample_hooks: list[Any] = []  # run on the sampler thread with each read's devices
        self._wake = threading.Event()  # set to publish before the next interval (an OOM)
        self._collectors = {"allocator": {"up": 1, "errors": 0, "duration": 0.0}}
        self._oncelog = _OnceLog()
        self._stop = threading.Event()
        self._publisher: spool.RankPublisher | None = None
        self._server_proc: subprocess.Popen | None = None
        self._spawn_lock_fd: int | None = None
        self._next_server_check = 0.0
        self._spawn_backoff = 2.0
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    @property
    def url(self) -> str:
        host = self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        scheme = "https" if self._tls() else "http"
        return f"{scheme}://{host}:{self.settings.port}/metrics"

    def _tls(self) -> bool:
        if not self.settings.web_config_file:
            return False
        try:
            import yaml

            with open(self.settings.web_config_file, encoding="utf-8") as fh:
                return bool((yaml.safe_load(fh) or {}).get("tls_server_config"))
        except Exception:  # noqa: BLE001 - only for the URL we print
            return False

    # --- lifecycle ---
    def start(self) -> None:
        if self.settings.serve == "off":
            return
        try:
            self._publisher = spool.RankPublisher(self.spool_dir, self.identity.rank)
        except OSError as e:
            self._oncelog("spool", "vramwatch: cannot publish into %s (%s); exporting nothing", self.spool_dir, e)
            return
        try:
            from vramwatch.integrations import setup

            setup(self)
        except Exception as e:  # noqa: BLE001 - the exporter still runs without them
            self._oncelog("integrations", "vramwatch: OOM forensics / status / hygiene unavailable: %r", e)
        self.tick()  # the server sees this rank at once
        self._thread = threading.Thread(target=self._run, name="vramwatch-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=max(2.0, self.settings.interval * 2))
        try:
            from vramwatch.integrations import teardown

            teardown(self)
        except Exception:  # noqa: BLE001
            pass
        self._release_spawn_lock()
        if self._publisher is not None and os.getpid() == self._pid:
            self._publisher.close()
        self._publisher = None

    def step(self, loss: Any = None, grad_norm: Any = None) -> None:
        self.heartbeat.step(loss, grad_norm)
        for hook in self.step_hooks:
            hook()

    def wake(self) -> None:
        """Publish a sample now rather than at the next interval (safe from any thread)."""
        self._wake.set()

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: Any) -> None:
        import vramwatch

        if vramwatch.current() is self:
            vramwatch.stop()
        else:
            self.stop()

    # --- the sampler thread ---
    def _run(self) -> None:
        interval = self.settings.interval
        next_t = time.monotonic() + interval
        while True:
            self._wake.wait(max(0.0, next_t - time.monotonic()))
            if self._stop.is_set():
                return
            self._wake.clear()
            self.tick()
            now = time.monotonic()
            if now >= next_t:  # a regular tick (a wake-up publishes early and keeps the cadence)
                next_t += interval
                if next_t < now:  # we were wedged: don't burst to catch up
                    next_t = now + interval

    def tick(self) -> None:
        """One sample and publish. Never raises."""
        try:
            sample = self._sample()
            if self._publisher is not None:
                self._publisher.publish(sample)
        except Exception as e:  # noqa: BLE001 - nothing escapes into the job
            self._oncelog("publish:" + type(e).__name__, "vramwatch: publishing failed: %r", e)
        try:
            self._ensure_server()
        except Exception as e:  # noqa: BLE001
            self._oncelog("spawn:" + type(e).__name__, "vramwatch: cannot start the server: %r", e)

    def _sample(self) -> spool.RankSample:
        col = self._collectors["allocator"]
        t0 = time.perf_counter()
        devices: list[spool.DeviceSample] = []
        try:
            devices = self.sampler.read()
            col["up"] = 1
        except Exception as e:  # noqa: BLE001
            col["up"] = 0
            col["errors"] += 1
            self._oncelog("allocator:" + type(e).__name__, "vramwatch: reading the allocator failed: %r", e)
        col["duration"] = time.perf_counter() - t0
        for hook in self.sample_hooks:
            try:
                hook(devices)
            except Exception as e:  # noqa: BLE001
                self._oncelog("hook:" + type(e).__name__, "vramwatch: %r failed: %r", hook, e)
        ident = self.identity
        return spool.RankSample(
            rank=ident.rank,
            local_rank=ident.local_rank,
            world_size=ident.world_size,
            hostname=self.hostname,
            pid=os.getpid(),
            time=time.time(),
            devices=tuple(devices),
            allocator_info=self.sampler.info() if devices else None,
            heartbeat=self.heartbeat.snapshot(),
            collectors={
                k: spool.CollectorHealth(v["up"], v["errors"], v["duration"]) for k, v in self._collectors.items()
            },
            oom_snapshot=self.extra.get("oom_snapshot"),
        )

    def _ensure_server(self) -> None:
        if self.settings.serve != "auto":
            return
        now = time.monotonic()
        if now < self._next_server_check:
            return
        proc = self._server_proc
        if proc is not None and proc.poll() is None:
            self._next_server_check = now + 5.0
            return
        if spool.server_running(self.spool_dir):
            self._server_proc = None
            self._release_spawn_lock()
            self._spawn_backoff = 2.0
            self._next_server_check = now + 5.0
            return
        if proc is not None:  # ours exited and no server runs: back off before the next try
            self._oncelog(
                "server-exit",
                "vramwatch: the server exited with %s; see %s",
                proc.returncode,
                os.path.join(self.spool_dir, "server.log"),
            )
            self._spawn_backoff = min(self._spawn_backoff * 2, _SPAWN_BACKOFF_MAX)
        elif self._spawn_lock_fd is None:
            # eight local ranks finding no server at once: only the one holding spawn.lock starts it
            self._spawn_lock_fd = spool.hold_lock(os.path.join(self.spool_dir, "spawn.lock"))
            if self._spawn_lock_fd is None:
                self._next_server_check = now + 2.0
                return
        self._server_proc = spawn_server(self.settings, self.spool_dir)
        self._next_server_check = now + self._spawn_backoff

    def _release_spawn_lock(self) -> None:
        if self._spawn_lock_fd is not None:
            os.close(self._spawn_lock_fd)
            self._spawn_lock_fd = None


def spawn_server(settings: Settings, spool_dir: str) -> subprocess.Popen:
    """Start ``vramwatch serve`` for the node, in its own session, exiting once the ranks are gone."""
    env = dict(os.environ)
    env.update(settings.to_env())
    env["VRAMWATCH_SPOOL_DIR"] = spool_dir
    env.pop("VRAMWATCH_CONFIG_FILE", None)  # already resolved into the variables above
    logf = open(os.path.join(spool_dir, "server.log"), "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "vramwatch", "serve", "--exit-when-idle"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        logf.close()

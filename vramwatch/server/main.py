"""The node's scrape server: one process, one port, every local rank.

Started by a rank (``serve=auto``), as a sidecar, or by hand with
``vramwatch serve``. It holds ``server.lock`` in the spool so only one runs
per spool, and it never imports torch, so it can never create a CUDA context.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import threading
import time

from vramwatch import spool
from vramwatch.config import ConfigError, Settings, server_settings
from vramwatch.server import process
from vramwatch.server.collectors import Runner, enabled_collectors
from vramwatch.server.exposition_cache import CachedExposition
from vramwatch.server.http import ExporterHTTPServer
from vramwatch.server.registry import ExporterCollector
from vramwatch.server.spool_guard import SpoolGuard

log = logging.getLogger("vramwatch")

HTTP_THREAD = "vramwatch-http"  # the event loop's thread (its kernel name too)
# A rank-started server gives up if no rank shows up this long after it started.
_FIRST_RANK_GRACE = 60.0


class StartupError(Exception):
    """The server cannot start; the message is the true cause, in one line."""


def _cause(e: OSError) -> str:
    code = errno.errorcode.get(e.errno or 0, "")
    return f"{e.strerror or e}" + (f" ({code})" if code else "")


class Server:
    def __init__(self, settings: Settings, node_daemon: bool = False) -> None:
        # node_daemon: the node's one long-running server for every user's ranks (deploy/systemd/), reading
        # the node root (every collector's spool: NVML readings, Xid attribution, the simulated node); else the
        # server of one user's ranks, reading their private spool
        if node_daemon:
            settings = dataclasses.replace(settings, spool_dir=settings.node_dir)
        self.settings = settings
        self.mode = "node" if node_daemon else "job"
        self.exit_when_idle = False  # started by a rank (serve --exit-when-idle): serve() sets it
        self.spool_dir = settings.resolved_spool_dir()
        self.collectors: list[Runner] = []
        self.exporter: ExporterCollector | None = None
        self.http: ExporterHTTPServer | None = None
        self.guard = SpoolGuard(self.spool_dir, node_daemon)
        self.exposition: CachedExposition | None = None
        self._serving: threading.Thread | None = None  # serve_forever's thread, once started
        self._stop = threading.Event()

    def open(self) -> bool:
        """Take the spool's server lock, bind, say where in ``server.json``; False if another server owns the
        spool. Raises :class:`StartupError` (or OSError naming a file) when it cannot; :meth:`close` then
        releases what was taken."""
        if not self.guard.take():
            return False
        web_config = None
        if self.settings.web_config_file:
            from vramwatch.server.webconfig import load_web_config

            web_config = load_web_config(self.settings.web_config_file)  # read again on use
        self.collectors = enabled_collectors(self.settings)
        self.exporter = ExporterCollector(self.settings, self.spool_dir, self.collectors, self.mode)
        # nothing shown changes faster than a rank publishes or a collector reads: the ages' gap
        self.exposition = CachedExposition(self.exporter, gap=min(self.settings.interval, self.settings.nvml_interval))
        try:
            self.http = ExporterHTTPServer(
                (self.settings.host, self.settings.port),
                self.exposition,
                max_connections=self.settings.max_connections,
                web_config=web_config,
            )
        except OSError as e:
            why = f"cannot listen on {self.settings.host}:{self.settings.port}: {_cause(e)}"
            if e.errno == errno.EADDRINUSE:  # name who holds it: a squatter serves Prometheus its own metrics
                from vramwatch.server.port_owner import describe_port_owner

                why += (
                    f"; port {self.settings.port} is in use, {describe_port_owner(self.settings.port)}; "
                    "Prometheus scraping it sees that process, not this job"
                )
            raise StartupError(why) from None
        for c in self.collectors:
            c.start()
        self.exposition.start()
        try:
            self.guard.write_info(self._server_info())
        except OSError as e:
            # a full spool tmpfs (ENOSPC): ranks could not publish into it either, so refuse to run blind
            raise StartupError(
                f"cannot write {e.filename}: {_cause(e)}; free space in the spool's filesystem or set spool_dir"
            ) from None
        return True

    def _server_info(self) -> dict[str, object]:
        assert self.http is not None
        return {
            "pid": os.getpid(),
            "host": self.settings.host,
            "port": self.http.server_address[1],
            # what a rank compares with its own; a rank-started server may be replaced once idle
            "settings": server_settings(self.settings),
            "exit_when_idle": self.exit_when_idle,
        }

    @property
    def port(self) -> int:
        assert self.http is not None
        return self.http.server_address[1]

    def _serve_forever(self) -> None:
        assert self.http is not None
        process.name_thread(HTTP_THREAD)  # what `top -H` shows, and how a benchmark finds the loop's CPU
        self.http.serve_forever()

    def run(self, exit_when_idle: bool = False) -> None:
        assert self.http is not None and self.exporter is not None
        self._serving = threading.Thread(target=self._serve_forever, name=HTTP_THREAD, daemon=True)
        self._serving.start()
        started = time.monotonic()
        last_seen: float | None = None
        try:
            while not self._stop.wait(1.0):
                self.guard.check(self.exporter.spool_health)
                self.exporter.spool_trouble, self.exporter.spool_vanished = self.guard.trouble, self.guard.vanished
                if not exit_when_idle:
                    continue
                now = time.monotonic()
                read = spool.read_spool(
                    self.spool_dir, self.settings.max_ranks, self.settings.dead_rank_grace_seconds, reap=False
                )
                if read.live or read.final:  # a dead rank's final sample keeps the server up for its grace
                    last_seen = now
                elif last_seen is None and (
                    spool.any_rank_files(self.spool_dir) or self.exporter.served_ranks_since(started)
                ):
                    last_seen = now  # a rank came and went before this loop saw it alive: linger from now
                elif last_seen is None and now - started > _FIRST_RANK_GRACE:
                    log.warning("vramwatch: no rank published within %.0f s; exiting", _FIRST_RANK_GRACE)
                    break
                elif last_seen is not None and now - last_seen > self.settings.linger:
                    break
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if self.exposition is not None:
            self.exposition.stop()
        for c in self.collectors:
            c.stop()
        if self.http is not None:
            if self._serving is not None:  # shutdown() waits for serve_forever: never started, it never returns
                self.http.shutdown()
                self._serving = None
            self.http.server_close()
            self.http = None
        self.guard.release()


def serve(settings: Settings, exit_when_idle: bool = False, node_daemon: bool = False) -> int:
    """Run until SIGTERM/SIGINT (or, rank-started, until the ranks are gone). Returns an exit code."""
    if node_daemon and not settings.node_dir:
        log.error("vramwatch: serve --node needs node_dir (the node spool's root)")
        return 1
    process.tune()  # before any thread of the server starts
    if blocked := process.unblock_signals():
        log.info("vramwatch: %s were blocked (inherited); unblocked them", ", ".join(sorted(s.name for s in blocked)))
    server = Server(settings, node_daemon)
    server.exit_when_idle = exit_when_idle
    try:
        server.guard.ensure_dir()
    except OSError as e:
        log.error("vramwatch: cannot use the spool directory %s: %s", server.spool_dir, e.strerror or e)
        return 1
    try:
        if not server.open():
            log.warning("vramwatch: another server already serves %s", server.spool_dir)
            return 0 if exit_when_idle else 1
    except ConfigError:
        raise
    except (StartupError, OSError) as e:
        if isinstance(e, StartupError):
            log.error("vramwatch: %s", e)
        else:
            log.error("vramwatch: cannot use %s: %s", e.filename or server.spool_dir, _cause(e))
        server.close()  # port, lock and threads released: nothing of this server stays behind
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    log.info(
        "vramwatch: serving http://%s:%d/metrics (%s mode, spool %s)",
        settings.host,
        server.port,
        server.mode,
        server.spool_dir,
    )
    process.freeze()  # what the server holds from here on lives as long as it does
    server.run(exit_when_idle)
    return 0

"""The node's scrape server: one process, one port, every local rank.

Started by a rank (``serve=auto``), as a sidecar, or by hand with
``vramwatch serve``. It holds ``server.lock`` in the spool so only one runs
per spool, and it never imports torch, so it can never create a CUDA context.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

from vramwatch import spool
from vramwatch.config import ConfigError, Settings
from vramwatch.server.collectors import Runner, enabled_collectors
from vramwatch.server.exposition_cache import CachedExposition
from vramwatch.server.http import ExporterHTTPServer
from vramwatch.server.registry import ExporterCollector

log = logging.getLogger("vramwatch")

# A rank-started server gives up if no rank shows up this long after it started.
_FIRST_RANK_GRACE = 60.0


class Server:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.spool_dir = settings.resolved_spool_dir()
        self.collectors: list[Runner] = []
        self.exporter: ExporterCollector | None = None
        self.http: ExporterHTTPServer | None = None
        self.exposition: CachedExposition | None = None
        self._lock_fd: int | None = None
        self._stop = threading.Event()

    def open(self) -> bool:
        """Take the spool's server lock and bind; False if another server already owns the spool."""
        spool.ensure_dir(self.spool_dir)
        self._lock_fd = spool.hold_lock(os.path.join(self.spool_dir, spool.SERVER_LOCK))
        if self._lock_fd is None:
            return False
        ssl_context = authorize = headers = None
        if self.settings.web_config_file:
            from vramwatch.server.webconfig import load_web_config

            ssl_context, authorize, headers = load_web_config(self.settings.web_config_file)
        self.collectors = enabled_collectors(self.settings)
        self.exporter = ExporterCollector(self.settings, self.spool_dir, self.collectors)
        self.exposition = CachedExposition(self.exporter)
        self.http = ExporterHTTPServer(
            (self.settings.host, self.settings.port),
            self.exposition,
            max_connections=self.settings.max_connections,
            ssl_context=ssl_context,
            authorize=authorize,
            headers=headers,
        )
        for c in self.collectors:
            c.start()
        # nothing shown changes faster than a rank publishes or a collector reads
        self.exposition.start(min_gap=min(self.settings.interval, self.settings.nvml_interval))
        with open(os.path.join(self.spool_dir, spool.SERVER_INFO), "w", encoding="utf-8") as fh:
            json.dump({"pid": os.getpid(), "host": self.settings.host, "port": self.http.server_address[1]}, fh)
        return True

    @property
    def port(self) -> int:
        assert self.http is not None
        return self.http.server_address[1]

    def run(self, exit_when_idle: bool = False) -> None:
        assert self.http is not None and self.exporter is not None
        t = threading.Thread(
            target=self.http.serve_forever, kwargs={"poll_interval": 0.2}, name="vramwatch-http", daemon=True
        )
        t.start()
        started = time.monotonic()
        last_seen: float | None = None
        try:
            while not self._stop.wait(1.0):
                if not exit_when_idle:
                    continue
                now = time.monotonic()
                if spool.read_samples(self.spool_dir, self.settings.max_ranks, reap=False):
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
            self.http.shutdown()
            self.http.server_close()
            self.http = None
        try:
            os.unlink(os.path.join(self.spool_dir, spool.SERVER_INFO))
        except OSError:
            pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def serve(settings: Settings, exit_when_idle: bool = False) -> int:
    """Run until SIGTERM/SIGINT (or, rank-started, until the ranks are gone). Returns an exit code."""
    server = Server(settings)
    try:
        spool.ensure_dir(server.spool_dir)
    except OSError as e:
        log.error("vramwatch: cannot use the spool directory %s: %s", server.spool_dir, e.strerror or e)
        return 1
    try:
        if not server.open():
            log.warning("vramwatch: another server already serves %s", server.spool_dir)
            return 0 if exit_when_idle else 1
    except ConfigError:
        raise
    except OSError as e:
        if e.filename:
            log.error("vramwatch: cannot use %s: %s", e.filename, e.strerror or e)
        else:
            log.error("vramwatch: cannot listen on %s:%s: %s", settings.host, settings.port, e.strerror or e)
        server.close()
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    log.info("vramwatch: serving http://%s:%d/metrics", settings.host, server.port)
    server.run(exit_when_idle)
    return 0

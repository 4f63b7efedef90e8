"""Serving the web config: TLS with certificates re-read when they change, basic auth (:mod:`.auth`), headers.

The file is parsed and checked by :mod:`vramwatch.webconfig_schema` (also used
by ``vramwatch.start()``). Certificates are re-read when their files change
(cert-manager rotates them), at most once a second; a broken new pair keeps
the old one and is logged.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time

from vramwatch.errors import ConfigError
from vramwatch.server.auth import BasicAuth
from vramwatch.webconfig_schema import WebConfig, build_ssl_context, check_web_config, resolve

log = logging.getLogger("vramwatch")

__all__ = ["BasicAuth", "TLSServer", "load_web_config"]


class TLSServer:
    """What the HTTP server wraps each connection with; swaps in re-read certificates when files change."""

    CHECK_EVERY = 1.0

    def __init__(self, cfg: WebConfig) -> None:
        self.cfg = cfg
        self.context = build_ssl_context(cfg)
        self._stamp = self._files_stamp()
        self._next_check = time.monotonic() + self.CHECK_EVERY
        self._lock = threading.Lock()
        self._failed_stamp: tuple | None = None

    def _files_stamp(self) -> tuple:
        tls = self.cfg.tls
        assert tls is not None
        out: list[tuple[int, int, int] | None] = []
        for p in (tls.cert_file, tls.key_file, tls.client_ca_file):
            if not p:
                continue
            try:
                st = os.stat(resolve(self.cfg.path, p))
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def current(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now >= self._next_check and self._lock.acquire(blocking=False):
            try:
                self._next_check = now + self.CHECK_EVERY
                stamp = self._files_stamp()
                if stamp != self._stamp and stamp != self._failed_stamp:
                    try:
                        self.context = build_ssl_context(self.cfg)
                        self._stamp = stamp
                        log.info("vramwatch: TLS certificate files changed; reloaded them")
                    except ConfigError as e:
                        self._failed_stamp = stamp  # e.g. half-written: retried when the files change again
                        log.warning("vramwatch: keeping the old TLS certificate: %s", e)
            finally:
                self._lock.release()
        return self.context

    def wrap_socket(self, sock, server_side: bool = True, do_handshake_on_connect: bool = True):
        return self.current().wrap_socket(
            sock, server_side=server_side, do_handshake_on_connect=do_handshake_on_connect
        )


def load_web_config(path: str) -> tuple[TLSServer | None, BasicAuth | None, dict[str, str] | None]:
    """(TLS wrapper, authorizer, extra response headers) for the HTTP server; ConfigError if anything is wrong."""
    cfg = check_web_config(path)
    if cfg.http2 is not None:
        log.info("vramwatch: http_server_config.http2 is accepted and ignored: the exporter speaks HTTP/1.x")
    tls = TLSServer(cfg) if cfg.tls is not None else None
    auth = BasicAuth(cfg.users) if cfg.users else None
    if tls is None and auth is not None:
        log.warning("vramwatch: basic auth without TLS sends passwords in clear text; add tls_server_config")
    return tls, auth, dict(cfg.headers) or None

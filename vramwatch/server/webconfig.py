"""The web config as the server uses it: read again on use whenever the file, or a file it names, changed.

As exporter-toolkit does (its handler reads the config for every request, its TLS config for every
connection), every connection and every request ask :meth:`WebConfigFile.current`, which looks at the
files (a ``stat`` each) and reads them again when one changed: a rotated password works at once and the
old one stops, a removed user is refused, new certificates or client-certificate settings take the next
connection. Each reload is logged. A file that no longer checks (half-written, wrong) keeps the last
good config, logged once until the files change again. Whether the server speaks TLS at all is decided
at start, as the toolkit decides it: turning TLS on or off needs a restart.

Parsing and checking are :mod:`vramwatch.webconfig_schema`'s (also used by ``vramwatch.start()``).
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass, field

from vramwatch.errors import ConfigError
from vramwatch.server.auth import BasicAuth
from vramwatch.webconfig_schema import WebConfig, build_ssl_context, check_web_config, resolve

log = logging.getLogger("vramwatch")

__all__ = ["Served", "WebConfigFile", "load_web_config"]

_Stamp = tuple[tuple[int, int, int] | None, ...]


@dataclass(frozen=True)
class Served:
    """What one connection or request is served with."""

    ssl_context: ssl.SSLContext | None = None
    auth: BasicAuth | None = None
    headers: dict[str, str] = field(default_factory=dict)


class WebConfigFile:
    """The web config file, read again on use when it or a certificate file changed."""

    def __init__(self, path: str) -> None:
        self.path = path
        cfg = check_web_config(path)  # ConfigError at start: a bad file fails before anything is served
        self.tls = cfg.tls is not None
        self._served = self._serve(cfg, None)
        self._stamp = self._files_stamp(cfg)
        self._failed: _Stamp | None = None
        if cfg.http2 is not None:
            log.info("vramwatch: http_server_config.http2 is accepted and ignored: the exporter speaks HTTP/1.x")
        if not self.tls and cfg.users:
            log.warning("vramwatch: basic auth without TLS sends passwords in clear text; add tls_server_config")
        self._cfg = cfg

    def current(self) -> Served:
        stamp = self._files_stamp(self._cfg)
        if stamp != self._stamp and stamp != self._failed:
            self._reload(stamp)
        return self._served

    def _reload(self, stamp: _Stamp) -> None:
        try:
            cfg = check_web_config(self.path)
            if (cfg.tls is not None) != self.tls:
                raise ConfigError(f"TLS is turned {'on' if cfg.tls else 'off'} only by a restart")
            served = self._serve(cfg, self._served.auth)
        except ConfigError as e:
            self._failed = stamp  # e.g. half-written: tried again when the files change again
            log.warning("vramwatch: web config %s changed but is not used; keeping the last good one: %s", self.path, e)
            return
        self._cfg, self._served, self._failed = cfg, served, None
        self._stamp = self._files_stamp(cfg)  # the files the new config names
        log.info(
            "vramwatch: web config %s changed; reloaded it (%s, %d basic-auth users)",
            self.path,
            f"TLS client_auth_type {cfg.tls.client_auth_type}" if cfg.tls else "no TLS",
            len(cfg.users),
        )

    @staticmethod
    def _serve(cfg: WebConfig, old: BasicAuth | None) -> Served:
        auth = old if old is not None and old.users == cfg.users else (BasicAuth(cfg.users) if cfg.users else None)
        ctx = build_ssl_context(cfg) if cfg.tls is not None else None
        return Served(ctx, auth, dict(cfg.headers))

    def _files_stamp(self, cfg: WebConfig) -> _Stamp:
        paths = [self.path]
        if cfg.tls is not None:
            paths += [resolve(cfg.path, p) for p in (cfg.tls.cert_file, cfg.tls.key_file, cfg.tls.client_ca_file) if p]
        out: list[tuple[int, int, int] | None] = []
        for p in paths:
            try:
                st = os.stat(p)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)


def load_web_config(path: str) -> WebConfigFile:
    """The web config for the HTTP server; ConfigError if anything in it is wrong."""
    return WebConfigFile(path)

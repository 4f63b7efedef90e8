"""Serving the web config: TLS with certificates re-read when they change, basic auth, headers.

The file is parsed and checked by :mod:`vramwatch.webconfig_schema` (also used
by ``vramwatch.start()``). Certificates are re-read when their files change
(cert-manager rotates them), at most once a second; a broken new pair keeps
the old one and is logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import ssl
import struct
import threading
import time
from base64 import b64decode
from binascii import Error as BinasciiError
from collections import OrderedDict

from vramwatch.errors import ConfigError
from vramwatch.webconfig_schema import WebConfig, build_ssl_context, check_web_config, resolve

log = logging.getLogger("vramwatch")

__all__ = ["BasicAuth", "TLSServer", "load_web_config"]

# bcrypt of "fakepassword" (the toolkit's): unknown users cost what known ones do
_DUMMY_HASH = b"$2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"


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


# --- basic auth ---
class BasicAuth:
    """``Authorization`` header -> allowed. bcrypt runs one at a time; verified pairs are cached as HMACs."""

    CACHE_SIZE = 256

    def __init__(self, users: tuple[tuple[str, str], ...]) -> None:
        import bcrypt  # lazily: only when basic_auth_users is set

        self._bcrypt = bcrypt
        self._users = [(name.encode("utf-8"), hashed.encode("ascii")) for name, hashed in users]
        self._key = os.urandom(32)  # cache keys are worthless outside this process
        self._ok: OrderedDict[bytes, None] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()  # bcrypt is slow by design: at most one core on it

    def _credentials(self, header: str | None) -> tuple[bytes, bytes] | None:
        if not header:
            return None
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "basic" or not token or len(token) > 4096:
            return None
        try:
            raw = b64decode(token.strip(), validate=True)
        except (BinasciiError, ValueError):
            return None
        user, sep, password = raw.partition(b":")
        return (user, password) if sep else None

    def _cache_key(self, user: bytes, hashed: bytes, password: bytes) -> bytes:
        msg = b"".join(struct.pack(">I", len(x)) + x for x in (user, hashed, password))
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def __call__(self, header: str | None) -> bool:
        try:
            creds = self._credentials(header)
            if creds is None:
                return False
            user, password = creds
            hashed, known = _DUMMY_HASH, False
            for name, h in self._users:  # every name compared, in constant time each
                if hmac.compare_digest(name, user):
                    hashed, known = h, True
            key = self._cache_key(user, hashed, password)
            with self._cache_lock:
                cached = False
                for k in self._ok:
                    cached |= hmac.compare_digest(k, key)
            if cached:
                return known
            with self._bcrypt_lock:
                # bcrypt reads 72 bytes; htpasswd and Go truncate longer passwords the same way
                ok = self._bcrypt.checkpw(password[:72], hashed)
            if ok and known:
                with self._cache_lock:
                    self._ok[key] = None
                    while len(self._ok) > self.CACHE_SIZE:
                        self._ok.popitem(last=False)
            return ok and known
        except Exception:  # noqa: BLE001 - a malformed header is a refusal, never a crash
            return False


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

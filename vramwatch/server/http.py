"""The scrape endpoint: a small threaded HTTP server with bounded concurrency.

Each connection gets a thread, but at most ``max_connections`` at once;
beyond that a client gets a clean 503 at once. Sockets time out, so a slow
client (slowloris) holds a slot for at most ``timeout`` seconds: the TLS
handshake and the request head must arrive within one deadline, not one per
read. The request line and headers together get a byte budget (431 beyond it).
Requests are one per connection (HTTP/1.0 semantics), so an idle keep-alive
never pins a slot. A failing collection answers 500, never a dropped socket.
"""

from __future__ import annotations

import io
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import _SocketWriter  # type: ignore[attr-defined]
from typing import Any

from prometheus_client import CollectorRegistry

from vramwatch.server.exposition_cache import Exposition, RegistryExposition

log = logging.getLogger("vramwatch")

LANDING = b"""<!doctype html><html><head><title>vramwatch</title></head><body>
<h1>vramwatch</h1><p>PyTorch allocator and NVML telemetry for this node.</p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/-/healthy">/-/healthy</a></li></ul>
</body></html>
"""
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
    b"Content-Length: 17\r\nConnection: close\r\n\r\ntoo many requests"
)

_TLS_HINT = b"Client sent an HTTP request to an HTTPS server.\n"
_PLAIN_TO_TLS = (
    b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
    b"Connection: close\r\n\r\n%s" % (len(_TLS_HINT), _TLS_HINT)
)
MAX_REQUEST_HEAD = 16 * 1024  # request line + headers; a Prometheus scrape sends well under 1 KiB
_DRAIN_BYTES = 64 * 1024

Authorizer = Callable[[str | None], bool]  # Authorization header -> allowed


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` header (RFC 9110, 12.5.3) allows gzip: ``gzip`` or ``*`` with q > 0.

    A substring test would answer ``gzip;q=0`` (gzip refused) with gzip; an explicit ``gzip`` entry
    wins over ``*``.
    """
    star: bool | None = None
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0  # a malformed weight is no consent
        if coding in ("gzip", "x-gzip"):
            return q > 0
        if coding == "*":
            star = q > 0
    return bool(star)


class _HeadTooLarge(Exception):
    pass


class _RequestReader(io.RawIOBase):
    """The socket as the request parser reads it: one deadline for the whole head, and a byte budget."""

    def __init__(self, sock: socket.socket, deadline: float, budget: int) -> None:
        super().__init__()
        self.sock, self.deadline, self.left = sock, deadline, budget

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.left <= 0:
            raise _HeadTooLarge
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request deadline passed")
        self.sock.settimeout(remaining)
        with memoryview(b) as view:
            n = self.sock.recv_into(view[: min(len(view), self.left)])
        self.left -= n
        return n


class ExporterHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        registry: Exposition | CollectorRegistry,
        *,
        max_connections: int = 8,
        timeout: float = 10.0,
        ssl_context: Any = None,
        authorize: Authorizer | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        # what answers /metrics: the server's cache, or a plain registry rendered per request
        self.exposition = RegistryExposition(registry) if isinstance(registry, CollectorRegistry) else registry
        self.conn_timeout = timeout
        self.ssl_context = ssl_context  # an ssl.SSLContext, or anything with its wrap_socket()
        self.authorize = authorize
        self.extra_headers = headers or {}
        self._slots = threading.BoundedSemaphore(max_connections)
        self.rejected = 0
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.rejected += 1
            try:
                request.settimeout(1.0)
                if self.ssl_context is None:  # over TLS a 503 would need a handshake here: just close
                    request.sendall(_BUSY)
                request.shutdown(socket.SHUT_WR)
                request.setblocking(False)
                request.recv(_DRAIN_BYTES)  # what already came, so the close sends no RST over the 503
            except OSError:
                pass
            self.close_request(request)  # no draining: the accept loop must not wait on anyone
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            deadline = time.monotonic() + self.conn_timeout
            if self.ssl_context is not None:
                request.settimeout(max(0.1, self.conn_timeout / 2))
                request = self.ssl_context.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
                try:
                    request.do_handshake()
                except ssl.SSLError as e:
                    if getattr(e, "reason", "") == "HTTP_REQUEST":  # plain HTTP to the TLS port: say so
                        socket.socket.sendall(request, _PLAIN_TO_TLS)
                    raise
            _Handler(request, client_address, self, deadline)
        except Exception:  # noqa: BLE001 - handshake failures, resets: the client's problem
            pass
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def shutdown_request(self, request):
        """Close cleanly: send FIN, then read what the client still sends (briefly), so it gets no RST."""
        try:
            request.shutdown(socket.SHUT_WR)
            request.settimeout(0.05)
            left = _DRAIN_BYTES
            while left > 0:
                chunk = socket.socket.recv(request, min(left, 16384))
                if not chunk:
                    break
                left -= len(chunk)
        except Exception:  # noqa: BLE001 - timeouts, resets: the client's problem
            pass
        self.close_request(request)

    def handle_error(self, request, client_address):
        log.debug("vramwatch: request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: ExporterHTTPServer
    server_version = "vramwatch"
    sys_version = ""
    default_request_version = "HTTP/1.0"  # every answer has a status line, even to garbage
    error_message_format = "%(code)d %(message)s\n"
    error_content_type = "text/plain; charset=utf-8"

    def __init__(self, request, client_address, server: ExporterHTTPServer, deadline: float | None = None) -> None:
        # the server passes the deadline it started before the TLS handshake; without one it starts now
        self.deadline = time.monotonic() + server.conn_timeout if deadline is None else deadline
        super().__init__(request, client_address, server)

    def version_string(self) -> str:
        return self.server_version

    def setup(self) -> None:
        self.connection = self.request
        self.command, self.request_version, self.requestline = "", "HTTP/1.0", ""  # send_error needs them
        self.rfile = io.BufferedReader(_RequestReader(self.request, self.deadline, MAX_REQUEST_HEAD))
        self.wfile = _SocketWriter(self.request)

    def finish(self) -> None:
        pass  # the server closes the socket

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except _HeadTooLarge:
            self.close_connection = True
            self.send_error(431, "Request Header Fields Too Large")
        except TimeoutError:
            self.close_connection = True

    def send_response(self, code: int, message: str | None = None) -> None:
        # the client has the whole head now; the response may take the rest of the socket timeout
        self.request.settimeout(self.server.conn_timeout)
        super().send_response(code, message)

    def end_headers(self) -> None:
        for k, v in self.server.extra_headers.items():
            self.send_header(k, v)
        super().end_headers()

    def log_message(self, format: str, *args) -> None:
        log.debug("vramwatch http: " + format, *args)

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _not_allowed(self) -> None:
        self._reply(405, b"method not allowed\n", "text/plain", {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def _serve(self, head: bool) -> None:
        if self.server.authorize is not None and not self.server.authorize(self.headers.get("Authorization")):
            self._reply(401, b"unauthorized\n", "text/plain", {"WWW-Authenticate": 'Basic realm="vramwatch"'})
            return
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            gzip_ok = accepts_gzip(self.headers.get("Accept-Encoding") or "")
            try:
                reply = self.server.exposition.reply(self.headers.get("Accept", ""), gzip_ok)
            except Exception:
                log.warning("vramwatch: rendering /metrics failed", exc_info=True)
                self._reply(500, b"collection failed; see the server log\n", "text/plain", head=head)
                return
            extra = {"Content-Encoding": reply.encoding} if reply.encoding else {}
            self._reply(200, reply.body, reply.content_type, extra, head)
        elif path == "/":
            self._reply(200, LANDING, "text/html; charset=utf-8", head=head)
        elif path in ("/-/healthy", "/-/ready"):
            self._reply(200, b"OK\n", "text/plain", head=head)
        else:
            self._reply(404, b"not found; see /metrics\n", "text/plain", head=head)

    def _reply(
        self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None, head: bool = False
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

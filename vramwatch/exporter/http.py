"""The scrape endpoint: a small threaded HTTP server with bounded concurrency.

Each connection gets a thread, but at most ``max_connections`` at once;
beyond that a client gets a clean 503 at once. Sockets time out, so a slow
client (slowloris) holds a slot for at most ``timeout`` seconds. Requests are
one per connection (HTTP/1.0 semantics), so an idle keep-alive never pins a slot.
"""

from __future__ import annotations

import gzip
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger("vramwatch")

LANDING = b"""<!doctype html><html><head><title>vramwatch</title></head><body>
<h1>vramwatch</h1><p>PyTorch allocator and NVML telemetry for this node.</p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/-/healthy">/-/healthy</a></li></ul>
</body></html>
"""
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
         b"Content-Length: 17\r\nConnection: close\r\n\r\ntoo many requests")

Authorizer = Callable[[str | None], bool]  # Authorization header -> allowed


class ExporterHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry, *, max_connections: int = 8,
                 timeout: float = 10.0, ssl_context: ssl.SSLContext | None = None,
                 authorize: Authorizer | None = None, headers: dict[str, str] | None = None) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.registry = registry
        self.conn_timeout = timeout
        self.ssl_context = ssl_context
        self.authorize = authorize
        self.extra_headers = headers or {}
        self._slots = threading.BoundedSemaphore(max_connections)
        self.rejected = 0
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):  # noqa: ANN001 - socketserver signature
        if not self._slots.acquire(blocking=False):
            self.rejected += 1
            try:
                request.settimeout(1.0)
                if self.ssl_context is None:
                    request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):  # noqa: ANN001
        try:
            request.settimeout(self.conn_timeout)
            if self.ssl_context is not None:
                request = self.ssl_context.wrap_socket(request, server_side=True)
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - handshake failures, resets: the client's problem
            pass
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request, client_address):  # noqa: ANN001
        log.debug("vramwatch: request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: ExporterHTTPServer
    server_version = "vramwatch"
    sys_version = ""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
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
            encoder, ctype = choose_encoder(self.headers.get("Accept"))
            body = encoder(self.server.registry)
            extra = {}
            if "gzip" in (self.headers.get("Accept-Encoding") or ""):
                body = gzip.compress(body, compresslevel=1)
                extra["Content-Encoding"] = "gzip"
            self._reply(200, body, ctype, extra, head)
        elif path == "/":
            self._reply(200, LANDING, "text/html; charset=utf-8", head=head)
        elif path in ("/-/healthy", "/-/ready"):
            self._reply(200, b"OK\n", "text/plain", head=head)
        else:
            self._reply(404, b"not found; see /metrics\n", "text/plain", head=head)

    def _reply(self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None,
               head: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in {**self.server.extra_headers, **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

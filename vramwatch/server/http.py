"""The scrape endpoint: an event loop that admits requests, and a bounded set of worker threads.

One thread (``serve_forever``) accepts connections, runs each TLS handshake and reads each
request head without blocking, so a slow client (slowloris) costs a socket and a buffer, never a
worker: at most ``max_pending`` connections may still be sending their heads (the oldest is
closed for a newer one), each within one deadline (``timeout``) and 16 KiB / 64 header lines
(431 beyond). A complete, well-formed ``GET``/``HEAD`` that passed basic auth is answered by the
loop itself when nothing has to be rendered for it: ``/metrics`` from the exposition's current
render (its ``reply_now``: the age family formatted at that moment, so as fresh as a worker's
answer), the landing page, health and 404. Only a request that needs a render (no render yet, a
read that failed, a format never asked for) reaches one of the ``max_connections`` workers;
:mod:`.admission` decides which when there are more of them than workers (Prometheus' scrapes
first), and the rest get a clean 503 at once. Every answer is written without blocking the loop,
within ``timeout``; at most ``max_pending`` connections may hold an answer they are not reading (the
oldest is closed for a newer one), so clients that never read cannot pile answers up in memory.
Refusals (400, 401, 405, 429, 431, 503) are written by the loop itself, so a flood of them never
takes a worker.

A head byte-identical to one of the last ``HEAD_CACHE`` well-formed ones (a node's scrapers send the
same few) reuses its parse and gzip choice: 4.3 us of the loop's ~100 us a scrape; only the parse, since
auth is checked every time and a head with credentials is kept only once its pair was verified.

Basic auth (:mod:`.auth`): a pair verified before is recognised on the loop; any other pair
costs one bcrypt on a worker thread of its own, within a per-source budget (429 beyond it).

Keep-alive: an HTTP/1.1 request without ``Connection: close`` (Prometheus' own) is answered in
HTTP/1.1 and its connection waits for the next request, so a scraper that comes back every 15 s pays
no new TCP connection (nor, with TLS, a new handshake) per scrape. An idle connection holds no
worker and no admission slot: it waits, watched by the loop, up to ``KEEPALIVE_IDLE`` s (at most
``max_pending`` of them, the oldest closed for a newer one, quietly: that is no abuse), and its next
request's head must come whole within ``timeout`` of its first byte, as on a new connection. Any
other request (HTTP/1.0, ``Connection: close``) and every refusal is one per connection, closed after
the answer. A failing collection answers 500, never a dropped socket. Every refusal is logged (WARNING, the
first of each kind a minute, then counted) and counted in ``refused``.
"""

from __future__ import annotations

import logging
import queue
import re
import select
import socket
import socketserver
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from prometheus_client.registry import CollectorRegistry

from vramwatch.server.admission import Admission, Decision, is_scrape, scrape_wait
from vramwatch.server.auth import BasicAuth, Check, Credentials, FailureBudget
from vramwatch.server.exposition_cache import Exposition, RegistryExposition, Reply

log = logging.getLogger("vramwatch")

LANDING = b"""<!doctype html><html><head><title>vramwatch</title></head><body>
<h1>vramwatch</h1><p>PyTorch allocator and NVML telemetry for this node.</p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/-/healthy">/-/healthy</a></li></ul>
</body></html>
"""
_TLS_HINT = b"Client sent an HTTP request to an HTTPS server.\n"
_PLAIN_TO_TLS = (
    b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
    b"Connection: close\r\n\r\n%s" % (len(_TLS_HINT), _TLS_HINT)
)
MAX_REQUEST_HEAD = 16 * 1024  # request line + headers; a Prometheus scrape sends well under 1 KiB
MAX_HEADER_LINES = 64  # Prometheus sends about six
MAX_PENDING = 128  # connections still in their TLS handshake or request head
HEAD_CACHE = 32  # request heads whose parse is reused: a node's scrapers send the same few, byte for byte
HEAD_CACHE_BYTES = 2048  # a larger head is parsed each time (a Prometheus scrape is well under 1 KiB)
# an answered HTTP/1.1 connection waits this long for its next request: longer than Prometheus' default
# scrape interval (1 m), shorter than its client's own idle timeout (5 m), so the client closes first
KEEPALIVE_IDLE = 90.0
AUTH_QUEUE = 8  # bcrypt checks waiting at once
AUTH_JOIN_SECONDS = 2.0  # shutdown waits this long for a bcrypt check under way (~75 ms at cost 10)
LINGER = 1.0  # after our FIN, how long the client's remaining bytes are read (so it gets no RST)
_DRAIN_BYTES = 64 * 1024
# readiness as the loop's poller takes it (epoll's bits are poll's)
_READ, _WRITE = select.POLLIN, select.POLLOUT
_MAX_EVENTS = 64  # a poll's events at most; the rest stay ready for the next (level-triggered)


class _Poll:
    """``select.poll`` behind epoll's ``poll(seconds, maxevents)``, where the system has no epoll."""

    def __init__(self) -> None:
        self._p = select.poll()
        self.register, self.modify, self.unregister = self._p.register, self._p.modify, self._p.unregister

    def poll(self, timeout: float, maxevents: int = -1) -> list[tuple[int, int]]:
        return self._p.poll(timeout * 1000.0)

    def close(self) -> None:
        pass


def _poller() -> Any:
    # epoll itself, not selectors' wrapper of it: the wrapper's Python per wake-up was 0.03 ms of a cold
    # kept-alive scrape's ~0.2 on the CPU machine
    return select.epoll() if hasattr(select, "epoll") else _Poll()


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


def _nonblocking(sock: socket.socket) -> None:
    if sock.gettimeout() != 0.0:  # a worker's timeout; the loop's own sockets are already (no system call)
        sock.setblocking(False)


def _head_end(buf: bytes, start: int) -> int:
    """Index just past the blank line that ends the head (CRLF or bare LF lines), or -1."""
    for term in (b"\n\r\n", b"\n\n"):
        i = buf.find(term, max(0, start - len(term)))
        if i >= 0:
            return i + len(term)
    return -1


_FIELD_NAME = re.compile(r"[!-~]*\Z")  # what email's parser takes for a field name: visible ASCII


class _Headers(Mapping[str, str]):
    """A request's header fields by case-insensitive name; the first of repeated fields wins."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, str]) -> None:
        self._fields = fields  # lower-cased names

    def __getitem__(self, name: str) -> str:
        return self._fields[name.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


def _parse_fields(rest: bytes) -> _Headers:
    """Header lines as RFC 9112 section 5 reads them, leniently as ``http.client.parse_headers`` does:
    a folded line continues the field before it, and a line that is no field ends the head."""
    fields: dict[str, str] = {}
    last = ""
    for line in rest.decode("latin-1").split("\n"):  # one decode for the block: latin-1 maps every byte
        line = line.rstrip("\r")
        if not line:
            break
        if line[0] in " \t":
            if last:
                fields[last] += " " + line.strip()
            continue
        name, colon, value = line.partition(":")
        if not colon or not _FIELD_NAME.match(name):
            break  # not a header field: the rest is no head of ours
        key = name.lower()
        last = key if key not in fields else ""  # a repeated field's fold belongs to the one we ignore
        fields.setdefault(key, value.strip())
    return _Headers(fields)


@dataclass
class _Request:
    method: str
    path: str
    headers: _Headers
    keep_alive: bool = False  # HTTP/1.1 without "Connection: close": the connection serves the next one too
    gzip: bool | None = None  # accepts_gzip of its Accept-Encoding, once asked (a cached head asks once)
    route: str = field(init=False)  # the path without its query
    accept: str = field(init=False)  # its Accept header ("" without one)
    has_body: bool = field(init=False)  # it said a body follows (which the server never reads)

    def __post_init__(self) -> None:  # once per parse: a cached head's answers read them as they are
        self.route = self.path.split("?", 1)[0]
        self.accept = self.headers.get("Accept", "")
        length = self.headers.get("Content-Length", "").strip()
        self.has_body = bool(length and length != "0") or "transfer-encoding" in self.headers


class _Refusal(Exception):
    def __init__(self, code: int, kind: str, body: str) -> None:
        super().__init__(body)
        self.code, self.kind, self.body = code, kind, body


def _parse_head(head: bytes) -> _Request:
    line, _, rest = head.partition(b"\n")
    words = line.rstrip(b"\r").split()
    if len(words) != 3 or words[2] not in (b"HTTP/1.0", b"HTTP/1.1"):
        raise _Refusal(400, "bad-request", "bad request line")
    if rest.count(b"\n") > MAX_HEADER_LINES + 1:
        raise _Refusal(431, "too-many-headers", f"more than {MAX_HEADER_LINES} header lines")
    method, target = words[0].decode("latin-1"), words[1].decode("latin-1")
    headers = _parse_fields(rest)
    keep = words[2] == b"HTTP/1.1" and "close" not in _tokens(headers.get("Connection", ""))
    return _Request(method, target, headers, keep)


def _tokens(value: str) -> list[str]:
    """A comma-separated header's tokens, lower case (``Connection: Keep-Alive, Close``)."""
    return [t.strip().lower() for t in value.split(",")]


_REASONS = {400: "Bad Request", 401: "Unauthorized", 405: "Method Not Allowed", 429: "Too Many Requests"}
_REASONS |= {431: "Request Header Fields Too Large", 503: "Service Unavailable"}
_REASONS |= {200: "OK", 404: "Not Found", 500: "Internal Server Error"}


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def imf_fixdate(now: float) -> str:
    """``email.utils.formatdate(now, usegmt=True)`` without the email package (about 1 MB resident)."""
    t = time.gmtime(now)
    return (
        f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year:04d} "
        f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT"
    )


class _Date:
    """The ``Date`` header's value (RFC 9110, 6.6.1: IMF-fixdate) as bytes, formatted once a second."""

    def __init__(self) -> None:
        self._last = (-1, b"")  # (second, its value): one tuple, as the loop and workers both read it

    def __call__(self) -> bytes:
        now = time.time()
        second, value = self._last
        if int(now) != second:
            value = imf_fixdate(now).encode("ascii")
            self._last = (int(now), value)
        return value


class _AbuseLog:
    """One WARNING per kind of refusal a minute; the ones in between are counted into the next line."""

    WINDOW = 60.0

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._quiet: Counter[str] = Counter()

    def __call__(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.WINDOW:
            self._quiet[kind] += 1
            return
        self._last[kind] = now
        more = self._quiet.pop(kind, 0)
        suffix = f" ({more} more like it in the last {self.WINDOW:.0f} s)" if more else ""
        log.warning("vramwatch http: " + msg + suffix, *args)


class _Conn:
    """One client connection as the event loop tracks it."""

    __slots__ = (
        "addr",
        "buf",
        "deadline",
        "done_sending",
        "events",
        "fd",
        "head",
        "keep",
        "out",
        "raw",
        "req",
        "sock",
        "state",
        "where",
    )

    def __init__(self, sock: socket.socket, addr: Any, deadline: float, state: str) -> None:
        self.sock, self.addr, self.deadline, self.state = sock, addr, deadline, state
        self.fd = sock.fileno()  # what the poller knows it by (a closed socket's fileno() is -1)
        self.buf = b""
        self.head = b""
        self.out: bytes | memoryview = b""
        self.req: _Request | None = None  # parsed, for the worker that answers it
        self.raw = False  # write past the TLS layer (to a client that never did TLS)
        self.keep = False  # once answered, wait for the next request (keep-alive) rather than close
        self.done_sending = False  # its whole request was read and no more is expected: close needs no linger
        self.events = 0
        self.where: dict[int, _Conn] | None = None

    @property
    def source(self) -> str:
        return str(self.addr[0]) if isinstance(self.addr, tuple) and self.addr else "?"

    @property
    def peer(self) -> str:
        if isinstance(self.addr, tuple) and len(self.addr) >= 2:
            return f"{self.addr[0]}:{self.addr[1]}"
        return "?"


class ExporterHTTPServer(socketserver.TCPServer):
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        registry: Exposition | CollectorRegistry,
        *,
        max_connections: int = 8,
        timeout: float = 10.0,
        ssl_context: Any = None,
        authorize: BasicAuth | None = None,
        headers: dict[str, str] | None = None,
        max_pending: int = MAX_PENDING,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        # what answers /metrics: the server's cache, or a plain registry rendered per request
        self.exposition = RegistryExposition(registry) if isinstance(registry, CollectorRegistry) else registry
        self.conn_timeout = timeout
        self.ssl_context = ssl_context  # an ssl.SSLContext, or anything with its wrap_socket()
        # what a non-blocking step may raise to wait for the socket; ssl (about 5 MB resident with
        # libssl) only when TLS is configured: a plain socket never raises its errors
        self._want_read: tuple[type[BaseException], ...] = (BlockingIOError, InterruptedError)
        self._want_write: tuple[type[BaseException], ...] = ()
        if ssl_context is not None:
            import ssl

            self._want_read += (ssl.SSLWantReadError,)
            self._want_write = (ssl.SSLWantWriteError,)
        self.auth = authorize
        self._quick = ssl_context is None and authorize is None  # where _kept_answer may answer
        self.extra_headers = headers or {}
        self.max_pending = max_pending
        self.admission: Admission[_Conn] = Admission(max_connections)
        self.failure_budget = FailureBudget()
        self.rejected = 0  # 503s for want of a worker
        self.refused: Counter[str] = Counter()  # every refusal, by kind
        self._abuse = _AbuseLog()
        self._date = _Date()
        # an answer's head but its Date and Content-Length values, by (code, type, extra fields, keep-alive)
        self._answer_heads: dict[tuple[int, str, tuple[tuple[str, str], ...], bool], tuple[bytes, bytes, bytes]] = {}
        self.served_on_loop = 0  # answers the loop wrote itself, with no worker (tests and benchmarks read it)
        self._heads: dict[bytes, _Request] = {}  # recent heads' parses (HEAD_CACHE); insertion order is age
        self._due = 0.0  # the nearest deadline (monotonic) as of the last select: the sweep waits for it
        self._pending: dict[int, _Conn] = {}  # handshake or head; insertion order is age
        self._writing: dict[int, _Conn] = {}  # an answer or refusal not all sent yet; insertion order is age
        self._closing: dict[int, _Conn] = {}  # lingering after our FIN
        self._idle: dict[int, _Conn] = {}  # answered, kept alive for the next request; insertion order is age
        self._calls: deque[Callable[[], None]] = deque()  # from other threads, run on the loop
        self._auth_queue: queue.Queue[tuple[_Conn, _Request, Credentials] | None] = queue.Queue(AUTH_QUEUE)
        self._sel: Any = None  # the poller while serve_forever runs
        self._by_fd: dict[int, Any] = {}  # what each watched descriptor is: "accept", "wake" or a _Conn
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._wake_r, self._wake_w = socket.socketpair()  # before binding: a failed bind closes them
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        super().__init__(address, socketserver.BaseRequestHandler)  # unused: workers run _Handler
        self.socket.setblocking(False)

    # --- the loop ---
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stop.clear()
        self._stopped.clear()
        auth_thread = None
        if self.auth is not None:
            auth_thread = threading.Thread(target=self._auth_worker, name="vramwatch-http-auth", daemon=True)
            auth_thread.start()
        try:
            self._sel = sel = _poller()
            by_fd = self._by_fd = {self.socket.fileno(): "accept", self._wake_r.fileno(): "wake"}
            try:
                sel.register(self.socket, _READ)
                sel.register(self._wake_r, _READ)
                while not self._stop.is_set():
                    for fd, _ in sel.poll(self._next_timeout(poll_interval), _MAX_EVENTS):
                        what = by_fd.get(fd)
                        if what is not None:  # None: closed by an event before it in this batch
                            self._guarded(what)
                    if time.monotonic() >= self._due:  # nothing expires sooner: a scrape skips the sweep
                        self._guarded("expire")
            finally:
                try:
                    self._close_all()
                finally:
                    sel.close()
        finally:
            self._sel = None
            self._by_fd = {}
            if auth_thread is not None:
                try:
                    self._auth_queue.put_nowait(None)
                except queue.Full:
                    pass  # the worker sees _stop within its poll
                # shutdown() returns with the worker gone (a check under way ends first), not one poll later
                auth_thread.join(AUTH_JOIN_SECONDS)
            self._stopped.set()

    def _guarded(self, what: Any) -> None:
        """One event; a bug in handling it costs that connection, never the loop (which is the server)."""
        try:
            if what.__class__ is _Conn:  # the common case first: a comparison of a _Conn with a str is slow
                self._step(what)
            elif what == "accept":
                self._accept()
            elif what == "wake":
                self._run_calls()
            elif what == "expire":
                self._expire(time.monotonic())
        except Exception:
            log.warning("vramwatch http: handling %r failed", what, exc_info=True)
            if isinstance(what, _Conn):
                self._close(what)

    def shutdown(self) -> None:
        """Stop serve_forever (returns at once if it is not running)."""
        self._stop.set()
        self._wake()
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        for s in (self._wake_r, self._wake_w):
            s.close()

    def _next_timeout(self, poll_interval: float) -> float:
        deadlines = [c.deadline for c in self._writing.values()] if self._writing else []
        if self._closing:
            deadlines += [c.deadline for c in self._closing.values()]
        for waiting in (self._pending, self._idle):
            if waiting:
                deadlines.append(next(iter(waiting.values())).deadline)  # the oldest expires first
        if self.admission.waiting:
            deadlines.append(time.monotonic() + 0.05)
        if not deadlines:
            self._due = float("inf")
            return poll_interval
        self._due = min(deadlines)
        return max(0.0, min(poll_interval, self._due - time.monotonic()))

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # full (a wake is pending anyway) or closed

    def _call_soon(self, fn: Callable[[], None]) -> None:
        self._calls.append(fn)
        self._wake()

    def _run_calls(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        while self._calls:
            self._calls.popleft()()

    def _watch(self, conn: _Conn, events: int) -> None:
        assert self._sel is not None
        if conn.events == events or conn.state == "closed":
            return
        if not conn.events:
            self._sel.register(conn.fd, events)
            self._by_fd[conn.fd] = conn
        elif not events:
            self._sel.unregister(conn.fd)
            del self._by_fd[conn.fd]
        else:
            self._sel.modify(conn.fd, events)
        conn.events = events

    def _move(self, conn: _Conn, where: dict[int, _Conn] | None) -> None:
        if conn.where is not None:
            conn.where.pop(id(conn), None)
        conn.where = where
        if where is not None:
            where[id(conn)] = conn

    def _close(self, conn: _Conn) -> None:
        if conn.events:
            self._watch(conn, 0)
        self._move(conn, None)
        conn.state = "closed"
        try:
            conn.sock.close()
        except OSError:
            pass

    def _close_all(self) -> None:
        conns = [*self._pending.values(), *self._writing.values(), *self._closing.values(), *self._idle.values()]
        for conn in [*conns, *self.admission.drop_all()]:
            try:
                self._close(conn)
            except Exception:  # noqa: BLE001 - closing everything at shutdown: the next one still gets closed
                conn.sock.close()
        while True:
            try:
                item = self._auth_queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].sock.close()

    # --- accepting and reading heads ---
    def _accept(self) -> None:
        for _ in range(64):  # then let the other sockets have a turn
            try:
                sock, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: the next round may fare better
                self._abuse("accept", "cannot accept a connection: %s", e.strerror or e)
                return
            if len(self._pending) >= self.max_pending:
                oldest = next(iter(self._pending.values()))
                self._note(
                    "evicted",
                    "%d connections were still sending their request heads; closed the "
                    "oldest, from %s (a flood of slow clients?)",
                    self.max_pending,
                    oldest.peer,
                )
                self._close(oldest)
            sock.setblocking(False)
            deadline = time.monotonic() + self.conn_timeout
            try:
                if self.ssl_context is not None:
                    sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                conn = _Conn(sock, addr, deadline, "handshake" if self.ssl_context is not None else "head")
            except (OSError, ValueError) as e:
                self._note("tls", "cannot start TLS with %s: %s", addr, e)
                sock.close()
                continue
            self._move(conn, self._pending)
            self._step(conn)

    def _step(self, conn: _Conn) -> None:
        try:
            if conn.state == "handshake":
                self._handshake(conn)
                if conn.state == "head":
                    self._read_head(conn)
            elif conn.state == "head":
                self._read_head(conn)
            elif conn.state == "write":
                try:
                    self._flush(conn)
                except BlockingIOError:  # a plain socket's full send buffer: wait for room, not for bytes
                    self._watch(conn, _WRITE)
            elif conn.state == "linger":
                self._drain(conn)
        except self._want_read:
            self._watch(conn, _READ)
        except self._want_write:
            self._watch(conn, _WRITE)
        except OSError:  # resets, TLS alerts mid-stream: the client's problem
            self._close(conn)

    def _handshake(self, conn: _Conn) -> None:
        import ssl  # loaded with the TLS context

        try:
            conn.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLError as e:
            if isinstance(e, ssl.SSLWantReadError | ssl.SSLWantWriteError):
                raise
            if getattr(e, "reason", "") == "HTTP_REQUEST":  # plain HTTP to the TLS port: say so
                self._note("plain-to-tls", "%s sent plain HTTP to the TLS port; answered 400", conn.peer)
                conn.raw = True
                self._write(conn, _PLAIN_TO_TLS)
            else:
                self._note("tls", "%s failed the TLS handshake: %s", conn.peer, getattr(e, "reason", None) or e)
                self._close(conn)
            return
        conn.state = "head"

    def _read_head(self, conn: _Conn) -> None:
        while True:
            chunk = conn.sock.recv(16384)
            if not chunk:  # the client is done sending: answer what came
                if conn.buf:
                    head, conn.buf = conn.buf, b""
                    self._head_complete(conn, head)
                else:
                    self._close(conn)
                return
            if conn.where is self._idle:  # its next request begins: a head's deadline from now, as when new
                if self._quick and not conn.buf and self._kept_answer(conn, chunk):
                    return
                conn.deadline = time.monotonic() + self.conn_timeout
                self._move(conn, self._pending)
            start = len(conn.buf)
            conn.buf += chunk
            if self._take_head(conn, start):
                return

    def _kept_answer(self, conn: _Conn, head: bytes) -> bool:
        """Answer a kept-alive connection's next request in one step, if it is a head seen before whole
        (parsed, and with no auth to check: admitted) that the loop can answer now; whether it did.

        The same bytes as the general path (:meth:`_head_complete` to :meth:`_done`), without its
        moves between the tables and its re-watching: at 10 scrapes a second the Python run per scrape
        is most of what a cold scrape costs. A new or partial head, two pipelined, or one a worker
        renders goes the general way; so does an answer the socket does not take at once.
        """
        req = self._heads.get(head)
        if req is None:
            return False
        data = self._answer_now(req)
        if data is None:
            return False
        self.served_on_loop += 1
        conn.keep = req.keep_alive
        if conn.keep:
            try:
                sent = conn.sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent == len(data):  # answered; it waits for the next request as the youngest idle one
                conn.deadline = time.monotonic() + KEEPALIVE_IDLE
                del self._idle[id(conn)]
                self._idle[id(conn)] = conn
                return True
            data = data[sent:]
        self._move(conn, None)
        conn.head = head
        self._write(conn, data, self.conn_timeout)
        return True

    def _take_head(self, conn: _Conn, start: int) -> bool:
        """Answer the head in ``conn.buf`` if it is complete (what follows it stays there: a pipelined
        next request), or refuse one grown too large; whether the head was dealt with."""
        end = _head_end(conn.buf, start)
        if 0 <= end <= MAX_REQUEST_HEAD:
            head, conn.buf = conn.buf[:end], conn.buf[end:]
            self._head_complete(conn, head)
            return True
        if len(conn.buf) > MAX_REQUEST_HEAD:
            self._refuse(conn, _Refusal(431, "too-large", f"request head over {MAX_REQUEST_HEAD} bytes"))
            return True
        return False

    def _expire(self, now: float) -> None:
        while self._pending:
            conn = next(iter(self._pending.values()))
            if conn.deadline > now:
                break
            what = "TLS handshake" if conn.state == "handshake" else "request head"
            self._note(
                "slow",
                "%s sent no complete %s within %g s; closed it (a slow or stalled client)",
                conn.peer,
                what,
                self.conn_timeout,
            )
            self._close(conn)
        for conn in [c for c in (*self._writing.values(), *self._closing.values()) if c.deadline <= now]:
            self._close(conn)
        while self._idle:  # a kept-alive connection nobody used again: closed, quietly
            conn = next(iter(self._idle.values()))
            if conn.deadline > now:
                break
            self._close(conn)
        for conn in self.admission.expire(now):
            self._busy(conn, "a scrape that waited its turn")

    # --- deciding ---
    def _head_complete(self, conn: _Conn, head: bytes) -> None:
        # still watched for reading: an answer the loop writes now keeps it so (no system call); only a
        # request handed on (to the bcrypt thread, a worker, the admission queue) is unwatched first
        self._move(conn, None)
        conn.head, conn.state = head, "busy"
        req = self._heads.get(head)
        if req is None:
            try:
                req = _parse_head(head)
                if req.method not in ("GET", "HEAD"):
                    raise _Refusal(405, "method", "method not allowed")
            except _Refusal as r:
                self._refuse(conn, r)
                return
            if "authorization" not in req.headers:  # credentials only once verified (below)
                self._remember(head, req)
        if self.auth is None:
            self._admit(conn, req)
            return
        result, creds = self.auth.check(req.headers.get("Authorization"))  # every time: a hit skips the parse only
        if result is Check.VERIFIED:
            self._remember(head, req)
            self._admit(conn, req)
        elif creds is None:
            self._refuse(conn, _Refusal(401, "no-credentials", "unauthorized"))
        elif not self.failure_budget.take(conn.source):
            self._refuse(conn, _Refusal(429, "auth-throttled", "too many failed authentications; retry later"))
        else:
            self._watch(conn, 0)  # the bcrypt thread's until it answers
            try:
                self._auth_queue.put_nowait((conn, req, creds))
            except queue.Full:
                self._refuse(conn, _Refusal(503, "auth-busy", "too many authentications in progress"))

    def _remember(self, head: bytes, req: _Request) -> None:
        """Keep a well-formed head's parse for its next byte-identical arrival (bounded: the oldest goes)."""
        if len(head) > HEAD_CACHE_BYTES or head in self._heads:
            return
        if len(self._heads) >= HEAD_CACHE:
            del self._heads[next(iter(self._heads))]
        self._heads[head] = req

    def _auth_worker(self) -> None:
        assert self.auth is not None
        while not self._stop.is_set():
            try:
                item = self._auth_queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is None:
                return
            conn, req, creds = item
            try:
                ok = self.auth.verify(creds)
            except Exception:  # noqa: BLE001 - a hash bcrypt chokes on is a refusal, never a crash
                ok = False
            self._call_soon(partial(self._authenticated, conn, req, ok))

    def _authenticated(self, conn: _Conn, req: _Request, ok: bool) -> None:
        if conn.state == "closed":
            return
        if ok:
            self._admit(conn, req)
        else:
            self._refuse(conn, _Refusal(401, "auth-failed", "unauthorized"))

    def _admit(self, conn: _Conn, req: _Request) -> None:
        conn.keep, conn.done_sending = req.keep_alive, not req.has_body
        data = self._answer_now(req)
        if data is not None:  # nothing to render: answered here, no worker, no slot
            self.served_on_loop += 1
            self._write(conn, data, self.conn_timeout)
            return
        self._watch(conn, 0)  # a worker's socket once it starts; nothing to read meanwhile
        conn.req = req
        scrape = is_scrape(req.method, req.path, req.headers)
        decision = self.admission.offer(conn, scrape, time.monotonic() + scrape_wait(req.headers))
        if decision is Decision.START:
            self._start(conn, scrape)
        elif decision is Decision.REFUSE:
            self._busy(conn, "a scrape" if scrape else "not a Prometheus scrape")

    def _busy(self, conn: _Conn, what: str) -> None:
        self.rejected += 1
        self._refuse(
            conn,
            _Refusal(503, "busy", "too many requests"),
            extra={"Retry-After": "1"},
            detail=f"all {self.admission.total} workers busy; {what}",
        )

    # --- answering ---
    def _start(self, conn: _Conn, scrape: bool) -> None:
        t = threading.Thread(target=self._work, args=(conn, scrape), name="vramwatch-http", daemon=True)
        try:
            t.start()
        except RuntimeError:  # no thread to be had: as if every worker were busy
            self._finished(conn, scrape, None, started=False)

    def _work(self, conn: _Conn, scrape: bool) -> None:
        """A worker renders the answer; the loop writes it, once its slot is free again: a client
        that has its answer (and, kept alive, sends the next request) finds the slot released."""
        data = None
        try:
            assert conn.req is not None
            data = self._answer(conn.req)
        except Exception:  # _answer says 500 for a failed render: this is a bug, and costs the connection
            log.warning("vramwatch: answering %s failed", conn.peer, exc_info=True)
        finally:
            conn.req = None
            self._call_soon(partial(self._finished, conn, scrape, data))

    # --- the answers to admitted requests (GET or HEAD, authorised) ---
    def _answer_now(self, req: _Request) -> bytes | None:
        """The answer, if the loop can give it without rendering (else None: a worker renders)."""
        if req.route != "/metrics":
            return self._answer(req)
        reply_now = getattr(self.exposition, "reply_now", None)
        if reply_now is None:
            return None
        try:
            reply: Reply | None = reply_now(req.accept, self._gzip_ok(req))
        except Exception:  # a worker's reply() answers (or says 500, and logs why)
            log.debug("vramwatch: serving /metrics from the cache failed", exc_info=True)
            return None
        return None if reply is None else self._metrics(req, reply)

    def _answer(self, req: _Request) -> bytes:
        head, keep = req.method == "HEAD", req.keep_alive
        path = req.route
        if path == "/metrics":
            try:
                reply = self.exposition.reply(req.accept, self._gzip_ok(req))
            except Exception:
                log.warning("vramwatch: rendering /metrics failed", exc_info=True)
                failed = b"collection failed; see the server log\n"
                return self._response(500, failed, "text/plain", head=head, keep=keep)
            return self._metrics(req, reply)
        if path == "/":
            return self._response(200, LANDING, "text/html; charset=utf-8", head=head, keep=keep)
        if path in ("/-/healthy", "/-/ready"):
            return self._response(200, b"OK\n", "text/plain", head=head, keep=keep)
        return self._response(404, b"not found; see /metrics\n", "text/plain", head=head, keep=keep)

    @staticmethod
    def _gzip_ok(req: _Request) -> bool:
        if req.gzip is None:
            req.gzip = accepts_gzip(req.headers.get("Accept-Encoding") or "")
        return req.gzip

    def _metrics(self, req: _Request, reply: Reply) -> bytes:
        extra = (("Content-Encoding", reply.encoding),) if reply.encoding else ()
        return self._response(200, reply.body, reply.content_type, extra, req.method == "HEAD", req.keep_alive)

    def _response(
        self,
        code: int,
        body: bytes,
        ctype: str,
        extra: tuple[tuple[str, str], ...] = (),
        head: bool = False,
        keep: bool = False,
    ) -> bytes:
        """A whole answer, status line to body, in one buffer: one write, one system call when it fits.

        The head's fixed parts are joined once per kind of answer (a handful: our codes and types): a
        cold scrape's head took 0.035 ms of f-strings and joins on the CPU machine, ~0.2 ms in all."""
        key = (code, ctype, extra, keep)
        parts = self._answer_heads.get(key)
        if parts is None:
            parts = self._answer_heads[key] = self._head_parts(*key)
        to_date, to_length, rest = parts
        return b"%b%b%b%d%b%b" % (to_date, self._date(), to_length, len(body), rest, b"" if head else body)

    def _head_parts(
        self, code: int, ctype: str, extra: tuple[tuple[str, str], ...], keep: bool
    ) -> tuple[bytes, bytes, bytes]:
        """An answer's head up to the Date value, up to the Content-Length value, and after it."""
        fields = "".join(f"{k}: {v}\r\n" for k, v in (*extra, *self.extra_headers.items()))
        return (
            f"{'HTTP/1.1' if keep else 'HTTP/1.0'} {code} {_REASONS[code]}\r\nServer: vramwatch\r\nDate: ".encode(
                "latin-1"
            ),
            f"\r\nContent-Type: {ctype}\r\nContent-Length: ".encode("latin-1"),
            f"\r\n{fields}\r\n".encode("latin-1"),
        )

    def _finished(self, conn: _Conn, scrape: bool, data: bytes | None, started: bool = True) -> None:
        for waiting in self.admission.release(scrape):
            self._start(waiting, True)
        if not started:
            self._busy(conn, "no thread could be started")
        elif data is None or conn.state == "closed":
            self._close(conn)
        else:
            self._write(conn, data, self.conn_timeout)

    def _refuse(
        self,
        conn: _Conn,
        r: _Refusal,
        extra: dict[str, str] | None = None,
        detail: str = "",
    ) -> None:
        """Answer ``r`` and close. The request line it logs, and whether it is a HEAD (no body), come from
        ``conn.head``: set for every head that was taken, empty before one is (a head too large)."""
        conn.keep = conn.done_sending = False  # a refusal ends the connection; the client may still send
        head = conn.head
        first = head.split(b"\n", 1)[0].rstrip(b"\r")[:80]
        why = detail or (f"{r.body}: {first!r}" if first else r.body)
        self._note(r.kind, "%s: answered %d (%s)", conn.peer, r.code, why)
        headers = {
            "Content-Type": "text/plain; charset=utf-8",
            "Content-Length": str(len(r.body) + 1),
            "Connection": "close",
            **(extra or {}),
        }
        if r.code == 401:
            headers["WWW-Authenticate"] = 'Basic realm="vramwatch"'
        elif r.code == 405:
            headers["Allow"] = "GET, HEAD"
        headers.update(self.extra_headers)
        lines = [f"HTTP/1.0 {r.code} {_REASONS[r.code]}", "Server: vramwatch"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        # a well-formed HEAD (refused after parsing: auth, overload) gets no body, anything else does
        head_only = r.code in (401, 429, 503) and head.startswith(b"HEAD ")
        body = b"" if head_only else r.body.encode() + b"\n"
        self._write(conn, "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body)

    def _note(self, kind: str, msg: str, *args: object) -> None:
        self.refused[kind] += 1
        self._abuse(kind, msg, *args)

    def _write(self, conn: _Conn, data: bytes, within: float = LINGER) -> None:
        """Write ``data`` (then linger and close) without blocking the loop, all of it within ``within`` s."""
        conn.out, conn.state = memoryview(data), "write"
        _nonblocking(conn.sock)
        conn.deadline = time.monotonic() + within
        if len(self._writing) >= self.max_pending:  # clients that do not read: each holds its answer here
            oldest = next(iter(self._writing.values()))
            self._note(
                "slow-reader",
                "%d connections were not reading their answers; closed the oldest, from %s",
                self.max_pending,
                oldest.peer,
            )
            self._close(oldest)
        self._move(conn, self._writing)
        self._step(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            n = socket.socket.send(conn.sock, conn.out) if conn.raw else conn.sock.send(conn.out)
            conn.out = conn.out[n:]  # a memoryview: no copy of what is left
        self._done(conn)

    def _done(self, conn: _Conn) -> None:
        """The answer is sent: wait for the connection's next request (keep-alive), or close it."""
        if not conn.keep:
            self._linger(conn)
            return
        conn.state, conn.head, conn.out, conn.req = "head", b"", b"", None
        conn.deadline = time.monotonic() + KEEPALIVE_IDLE
        if len(self._idle) >= self.max_pending:
            self._close(next(iter(self._idle.values())))  # the longest unused: it reconnects if it comes back
        self._move(conn, self._idle)
        pending = getattr(conn.sock, "pending", None)  # TLS: bytes the TLS layer read that epoll cannot see
        if conn.buf or (pending is not None and pending()):
            # the next request came with this one (pipelined): answered from the loop's next turn, so
            # that a client sending many at once never deepens this call chain
            self._call_soon(partial(self._resume, conn))
        else:
            self._watch(conn, _READ)

    def _resume(self, conn: _Conn) -> None:
        if conn.state != "head" or conn.where is not self._idle:
            return  # closed (or evicted) meanwhile
        conn.deadline = time.monotonic() + self.conn_timeout  # a head's deadline: its bytes have come
        self._move(conn, self._pending)
        try:
            if not self._take_head(conn, 0):
                self._step(conn)  # the rest of that head
        except OSError:
            self._close(conn)

    def _linger(self, conn: _Conn) -> None:
        """Send FIN, then read what the client still sends (briefly), so that it gets no RST.

        As nginx's ``lingering_close on``: only where more may come. A plain connection whose request
        was read whole, said no body and left nothing unread is closed at once (its FIN goes with the
        close; no RST, as nothing is unread). That saves a new-connection scrape a poll round and four
        system calls. TLS connections always linger (their layer may hold bytes epoll cannot see)."""
        if conn.done_sending and not conn.buf and not conn.raw and self.ssl_context is None:
            try:
                more = conn.sock.recv(1)
            except (BlockingIOError, InterruptedError):
                more = b""
            except OSError:
                more = b""  # reset meanwhile: nothing left to protect
            if not more:
                self._close(conn)
                return
        conn.state = "linger"
        conn.deadline = time.monotonic() + LINGER
        conn.buf = b""
        conn.out = b""
        if conn.where is not self._closing:
            self._move(conn, self._closing)
        try:
            _nonblocking(conn.sock)
            conn.sock.shutdown(socket.SHUT_WR)  # an SSLSocket drops its TLS layer here: raw from now on
        except OSError:
            self._close(conn)
            return
        conn.head = b""
        self._step(conn)

    def _drain(self, conn: _Conn) -> None:
        left = _DRAIN_BYTES
        while left > 0:
            chunk = socket.socket.recv(conn.sock, min(left, 16384))
            if not chunk:
                break
            left -= len(chunk)
        self._close(conn)

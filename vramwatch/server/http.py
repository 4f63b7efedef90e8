"""The scrape endpoint: asyncio carries the bytes, this module keeps the policies.

:meth:`ExporterHTTPServer.serve_forever` runs an asyncio event loop on the calling thread. Each
connection is a task: its TLS handshake (with the context the web config gives at that moment) and its
request head come within one deadline (``timeout``), its answer is written within another, and an
HTTP/1.1 connection then waits up to ``KEEPALIVE_IDLE`` for its next request (whose head again has
``timeout`` from its first byte). Heads are read line by line, at most 16 KiB and 64 fields (431
beyond); a declared body is read and dropped, so it is never taken for a request (:mod:`.request`).
Pipelined requests are answered in order. A slow client costs a socket and a buffer, never a thread:
at most ``max_pending`` connections may be in their handshake or head, ``max_pending`` may hold an
answer they are not reading, and ``max_pending`` may idle; a newer one closes the oldest.

A ``/metrics`` the exposition can answer from memory (:meth:`~.exposition_cache.CachedExposition.reply_now`),
the landing page and health are answered on the loop. A render runs on one of ``max_connections``
worker threads, and :mod:`.admission` decides who gets one when there are more requests than workers
(Prometheus' scrapes first); the rest get a 503 at once. A failing render answers 500.

Basic auth (:mod:`.auth`): a pair verified before is recognised on the loop; any other costs one bcrypt
on the auth thread, within a per-source budget (429 beyond it). The web config is read again on use
(:mod:`.webconfig`). Every refusal is logged (WARNING, the first of each kind a minute, then counted)
and counted in ``refused``.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from prometheus_client.registry import CollectorRegistry

from vramwatch.server.admission import Admission, Decision, is_scrape, scrape_wait
from vramwatch.server.auth import BasicAuth, Check, FailureBudget
from vramwatch.server.connections import AbuseLog, Conn, Rooms
from vramwatch.server.exposition_cache import Exposition, RegistryExposition, Reply
from vramwatch.server.request import MAX_HEADER_LINES, MAX_REQUEST_HEAD, Refusal, Request, accepts_gzip, parse_head
from vramwatch.server.webconfig import Served, WebConfigFile

__all__ = ["MAX_HEADER_LINES", "MAX_REQUEST_HEAD", "ExporterHTTPServer", "accepts_gzip"]

log = logging.getLogger("vramwatch")
T = TypeVar("T")

LANDING = b"""<!doctype html><html><head><title>vramwatch</title></head><body>
<h1>vramwatch</h1><p>PyTorch allocator and NVML telemetry for this node.</p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/-/healthy">/-/healthy</a></li></ul>
</body></html>
"""
_TLS_HINT = b"Client sent an HTTP request to an HTTPS server.\n"
_PLAIN_TO_TLS = (
    b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
)
MAX_PENDING = 128  # connections in their handshake or head; as many writing, as many idle
# an answered HTTP/1.1 connection waits this long for its next request: longer than Prometheus' default
# scrape interval (1 m), shorter than its client's own idle timeout (5 m), so the client closes first
KEEPALIVE_IDLE = 90.0
AUTH_QUEUE = 8  # bcrypt checks waiting at once
LINGER = 1.0  # after a refusal, how long the client's remaining bytes are read (so it gets no RST)
_DRAIN_BYTES = 64 * 1024
ACCEPT_RETRY = 0.5  # s between accepts while the process is out of descriptors (EMFILE)
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}
_REASONS |= {413: "Content Too Large", 429: "Too Many Requests", 431: "Request Header Fields Too Large"}
_REASONS |= {500: "Internal Server Error", 503: "Service Unavailable"}


class _Fixed:
    """A web config given as values (tests, a registry served by hand): never read again."""

    def __init__(self, served: Served) -> None:
        self.served = served

    def current(self) -> Served:
        return self.served


class ExporterHTTPServer:
    def __init__(
        self,
        address: tuple[str, int],
        registry: Exposition | CollectorRegistry,
        *,
        max_connections: int = 8,
        timeout: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
        authorize: BasicAuth | None = None,
        headers: dict[str, str] | None = None,
        web_config: WebConfigFile | None = None,
        max_pending: int = MAX_PENDING,
    ) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:  # not socket.create_server: its OSError's strerror carries the address, which the caller names
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(128)
        except BaseException:
            self.socket.close()
            raise
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        # what answers /metrics: the server's cache, or a plain registry rendered per request
        self.exposition = RegistryExposition(registry) if isinstance(registry, CollectorRegistry) else registry
        self.conn_timeout = timeout
        self.web = web_config or _Fixed(Served(ssl_context, authorize, dict(headers or {})))
        self.max_pending = max_pending
        self.admission: Admission[asyncio.Future[None]] = Admission(max_connections)
        self.failure_budget = FailureBudget()
        self.rejected = 0  # 503s for want of a worker
        self.refused: Counter[str] = Counter()  # every refusal, by kind
        self._abuse = AbuseLog()
        self._rooms = Rooms(self._note)
        self._auth_pool: ThreadPoolExecutor | None = None
        self._auth_waiting = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._shutdown = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()

    @property
    def auth(self) -> BasicAuth | None:
        return self.web.current().auth

    # --- running ---
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until :meth:`shutdown` (``poll_interval`` is unused: the loop wakes for what it waits on)."""
        self._stopped.clear()
        try:
            asyncio.run(self._serve())
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serve_forever and wait for it (returns at once if it is not running)."""
        self._shutdown.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass  # the loop has ended
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_quiet_loop_errors)
        self._wake = asyncio.Event()
        self._loop = loop
        if self._shutdown.is_set():
            return
        self._auth_pool = ThreadPoolExecutor(1, "vramwatch-http-auth")
        tasks: set[asyncio.Task[None]] = set()
        accepting = asyncio.create_task(self._accept(tasks))
        try:
            await self._wake.wait()
        finally:
            accepting.cancel()
            for t in [accepting, *tasks]:
                t.cancel()
            await asyncio.gather(accepting, *tasks, return_exceptions=True)
            for waiting in self.admission.drop_all():
                waiting.cancel()
            self._auth_pool.shutdown(wait=False, cancel_futures=True)
            self._loop = None

    async def _accept(self, tasks: set[asyncio.Task[None]]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(self.socket)
            except OSError as e:
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue  # the client gave up before we took it
                # out of descriptors (EMFILE) or anything else: never a busy loop; the connection waits in the backlog
                self._abuse("accept", "cannot accept a connection: %s; trying again in %g s", e.strerror, ACCEPT_RETRY)
                await asyncio.sleep(ACCEPT_RETRY)
                continue
            task = loop.create_task(self._connection(sock, addr))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    # --- one connection ---
    async def _connection(self, sock: socket.socket, addr: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        conn = Conn(addr, task)
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            self._rooms.enter(conn, self._rooms.head, self.max_pending)
            try:
                async with asyncio.timeout(self.conn_timeout):
                    opened = await self._open(sock, conn)
                    if opened is None:
                        return
                    reader, writer = opened
                    req = await self._read_request(conn, reader, b"")
            except TimeoutError:
                self._slow(conn, "request head" if writer is not None else "TLS handshake")
                return
            while req is not None:
                if not await self._answer(conn, req, writer):
                    return
                req = await self._next_request(conn, reader)
        except Refusal as r:
            if reader is not None and writer is not None:
                await self._refuse(conn, reader, writer, r)
        except (OSError, EOFError, asyncio.IncompleteReadError):
            pass  # resets, TLS alerts mid-stream: the client's problem
        except Exception:
            log.warning("vramwatch http: handling %s failed", conn.peer, exc_info=True)
        finally:
            self._rooms.leave(conn)
            if writer is None:
                sock.close()
            elif writer.transport.get_write_buffer_size():
                writer.transport.abort()  # an answer never taken: no close that waits for it
            else:
                writer.close()

    async def _open(self, sock: socket.socket, conn: Conn) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Streams over the connection, after its TLS handshake if the web config asks for TLS."""
        loop = asyncio.get_running_loop()
        ctx = self.web.current().ssl_context  # read on use: rotated certificates take the next connection
        if ctx is not None and await self._plain_to_tls(sock, conn):
            return None
        reader = asyncio.StreamReader(limit=MAX_REQUEST_HEAD)
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            if ctx is None:
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
            else:  # the handshake: our own deadline (conn_timeout) comes first, asyncio's is a backstop
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol,
                    sock,
                    ssl=ctx,
                    ssl_handshake_timeout=self.conn_timeout + 1,
                    ssl_shutdown_timeout=LINGER,
                )
        except ssl.SSLError as e:
            self._note("tls", "%s failed the TLS handshake: %s", conn.peer, e.reason or e)
            return None
        transport.set_write_buffer_limits(high=0)  # drain() waits for the whole answer: written within a deadline
        return reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    async def _plain_to_tls(self, sock: socket.socket, conn: Conn) -> bool:
        """Answer plain HTTP sent to the TLS port with a hint (as Go's servers do); whether it was that."""
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(sock, ready)
        try:
            await readable
        finally:
            loop.remove_reader(sock)
        first = sock.recv(1, socket.MSG_PEEK)
        if not first.isalpha():  # a TLS record (0x16), or nothing: the handshake says what it is
            return False
        self._note("plain-to-tls", "%s sent plain HTTP to the TLS port; answered 400", conn.peer)
        try:
            await loop.sock_sendall(sock, _PLAIN_TO_TLS % (len(_TLS_HINT), _TLS_HINT))
            sock.shutdown(socket.SHUT_WR)
            async with asyncio.timeout(LINGER):
                await _drain(lambda n: loop.sock_recv(sock, n))
        except OSError:
            pass
        return True

    async def _next_request(self, conn: Conn, reader: asyncio.StreamReader) -> Request | None:
        """The connection's next request: it may idle until its first byte, then has a head's deadline."""
        self._rooms.enter(conn, self._rooms.idle, self.max_pending)
        try:
            async with asyncio.timeout(KEEPALIVE_IDLE) as deadline:
                first = await reader.read(1)
                if not first:
                    return None
                self._rooms.enter(conn, self._rooms.head, self.max_pending)
                deadline.reschedule(asyncio.get_running_loop().time() + self.conn_timeout)
                return await self._read_request(conn, reader, first)
        except TimeoutError:
            if conn.room is self._rooms.head:
                self._slow(conn, "request head")
            return None  # else nobody used it again: closed quietly

    async def _read_request(self, conn: Conn, reader: asyncio.StreamReader, first: bytes) -> Request | None:
        """One request: its head, parsed, and its body read and dropped. None: the client sent nothing."""
        try:
            head = first + await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise Refusal(431, "too-large", f"request head over {MAX_REQUEST_HEAD} bytes") from None
        except asyncio.IncompleteReadError as e:  # the client stopped sending: answer what came, if anything
            head = first + e.partial
            if not head:
                return None
        if len(head) > MAX_REQUEST_HEAD:
            raise Refusal(431, "too-large", f"request head over {MAX_REQUEST_HEAD} bytes")
        lines = head.rstrip(b"\r\n").split(b"\r\n")
        conn.first = lines[0][:80]
        req = parse_head(lines)
        if req.body_length:
            await reader.readexactly(req.body_length)  # dropped: no answer depends on it
        return req

    def _slow(self, conn: Conn, what: str) -> None:
        self._note("slow", "%s sent no complete %s within %g s; closed it (a slow or stalled client)", conn.peer, what,
                   self.conn_timeout)  # fmt: skip

    # --- deciding and answering ---
    async def _answer(self, conn: Conn, req: Request, writer: asyncio.StreamWriter) -> bool:
        """Answer ``req``; whether the connection serves another request."""
        self._rooms.leave(conn)
        if req.method not in ("GET", "HEAD"):
            raise Refusal(405, "method", "method not allowed")
        served = self.web.current()
        if served.auth is not None:
            await self._authenticate(conn, req, served.auth)
        if req.route == "/metrics":
            data = await self._metrics(req, served)
        elif req.route == "/":
            data = self._response(200, LANDING, "text/html; charset=utf-8", req, served)
        elif req.route in ("/-/healthy", "/-/ready"):
            data = self._response(200, b"OK\n", "text/plain", req, served)
        else:
            data = self._response(404, b"not found; see /metrics\n", "text/plain", req, served)
        await self._write(conn, writer, data)
        return req.keep_alive

    async def _authenticate(self, conn: Conn, req: Request, auth: BasicAuth) -> None:
        result, creds = auth.check(req.headers.get("authorization"))
        if result is Check.VERIFIED:
            return
        if creds is None:
            raise Refusal(401, "no-credentials", "unauthorized")
        if not self.failure_budget.take(conn.source):
            raise Refusal(429, "auth-throttled", "too many failed authentications; retry later")
        if self._auth_waiting >= AUTH_QUEUE:
            raise Refusal(503, "auth-busy", "too many authentications in progress")
        self._auth_waiting += 1
        try:
            ok = await asyncio.get_running_loop().run_in_executor(self._auth_pool, _verify, auth, creds)
        finally:
            self._auth_waiting -= 1
        if not ok:
            raise Refusal(401, "auth-failed", "unauthorized")

    async def _metrics(self, req: Request, served: Served) -> bytes:
        accept, gzip_ok = req.headers.get("accept", ""), req.gzip_ok
        reply_now = getattr(self.exposition, "reply_now", None)
        reply: Reply | None = None
        if reply_now is not None:
            try:
                reply = reply_now(accept, gzip_ok)
            except Exception:  # a worker's reply() answers (or says 500, and logs why)
                log.debug("vramwatch: serving /metrics from the cache failed", exc_info=True)
        if reply is None:
            scrape = is_scrape(req.method, req.target, req.headers)
            await self._admitted(scrape, req)
            try:
                reply = await self._in_thread(self.exposition.reply, accept, gzip_ok)
            except Refusal:
                raise
            except Exception:
                log.warning("vramwatch: rendering /metrics failed", exc_info=True)
                return self._response(500, b"collection failed; see the server log\n", "text/plain", req, served)
            finally:
                self._release(scrape)
        extra = {"Content-Encoding": reply.encoding} if reply.encoding else {}
        return self._response(200, reply.body, reply.content_type, req, served, extra)

    async def _admitted(self, scrape: bool, req: Request) -> None:
        """Wait for a worker slot (a scrape waits its turn briefly); Refusal 503 when none is to be had."""
        deadline = time.monotonic() + scrape_wait(req.headers)
        waiter = asyncio.get_running_loop().create_future()
        decision = self.admission.offer(waiter, scrape, deadline)
        if decision is Decision.QUEUED:
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
                return
            except TimeoutError:
                self.admission.expire(deadline)
                self._busy("a scrape that waited its turn")
        elif decision is Decision.REFUSE:
            self._busy("a scrape" if scrape else "not a Prometheus scrape")

    def _busy(self, what: str) -> None:
        self.rejected += 1
        raise Refusal(503, "busy", f"too many requests; all {self.admission.total} workers busy; {what}")

    def _release(self, scrape: bool) -> None:
        for waiter in self.admission.release(scrape):
            if waiter.done():  # its scrape gave up meanwhile: the slot goes on
                self._release(True)
            else:
                waiter.set_result(None)

    def _in_thread(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` on a thread of its own (ended with it), as a future of the loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result)

        def run() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the loop, which answers 500
                result, error = None, e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:
                pass  # the loop has ended (shutdown)

        try:
            threading.Thread(target=run, name="vramwatch-http", daemon=True).start()
        except RuntimeError:
            self._busy("no thread could be started")
        return fut

    def _response(
        self, code: int, body: bytes, ctype: str, req: Request, served: Served, extra: dict[str, str] | None = None
    ) -> bytes:
        version = "HTTP/1.1" if req.keep_alive else "HTTP/1.0"
        fields = {"Server": "vramwatch", "Date": email.utils.formatdate(usegmt=True), "Content-Type": ctype}
        fields |= {"Content-Length": str(len(body)), **(extra or {}), **served.headers}
        head = f"{version} {code} {_REASONS[code]}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        return head.encode("latin-1") + b"\r\n" + (b"" if req.method == "HEAD" else body)

    async def _write(self, conn: Conn, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        if writer.transport.get_write_buffer_size():  # the client is not taking it all at once
            self._rooms.enter(conn, self._rooms.write, self.max_pending)
            async with asyncio.timeout(self.conn_timeout):
                await writer.drain()
            self._rooms.leave(conn)

    async def _refuse(self, conn: Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, r: Refusal) -> None:
        """Answer ``r``, then read what the client still sends (briefly) before closing, so it gets no RST."""
        why = f"{r.body}: {conn.first!r}" if conn.first else r.body
        self._note(r.kind, "%s: answered %d (%s)", conn.peer, r.code, why)
        fields = {"Content-Type": "text/plain; charset=utf-8", "Content-Length": str(len(r.body) + 1)}
        fields["Connection"] = "close"
        if r.code == 401:
            fields["WWW-Authenticate"] = 'Basic realm="vramwatch"'
        elif r.code == 405:
            fields["Allow"] = "GET, HEAD"
        elif r.code == 503:
            fields["Retry-After"] = "1"
        fields |= self.web.current().headers
        head = f"HTTP/1.0 {r.code} {_REASONS[r.code]}\r\nServer: vramwatch\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        # a well-formed HEAD (refused after parsing: auth, overload) gets no body, anything else does
        head_only = r.code in (401, 429, 503) and conn.first.startswith(b"HEAD ")
        body = b"" if head_only else r.body.encode() + b"\n"
        try:
            await self._write(conn, writer, head.encode("latin-1") + b"\r\n" + body)
            if writer.can_write_eof():  # TLS cannot: its close (close_notify) waits for the client's, reading
                writer.write_eof()
                async with asyncio.timeout(LINGER):
                    await _drain(reader.read)
        except OSError:  # a timeout too
            pass

    def _note(self, kind: str, msg: str, *args: object) -> None:
        self.refused[kind] += 1
        self._abuse(kind, msg, *args)


async def _drain(read: Callable[[int], Awaitable[bytes]]) -> None:
    """Read and drop what the client still sends, up to ``_DRAIN_BYTES`` (after our answer and FIN)."""
    left = _DRAIN_BYTES
    while left > 0 and (chunk := await read(min(left, 16384))):
        left -= len(chunk)


def _verify(auth: BasicAuth, creds: tuple[bytes, bytes]) -> bool:
    try:
        return auth.verify(creds)
    except Exception:  # noqa: BLE001 - a hash bcrypt chokes on is a refusal, never a crash
        return False


def _quiet_loop_errors(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    # what asyncio reports of a connection (a reset mid-handshake, a task ended by shutdown) is the client's
    log.debug("vramwatch http: %s", context.get("message"), exc_info=context.get("exception"))

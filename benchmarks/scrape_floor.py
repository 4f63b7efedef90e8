"""What a scrape's CPU is made of on this machine: two servers of one thread each, same body, same client.

    python benchmarks/scrape_floor.py [--rate 10] [--scrapes 100] [--busy 3000] [--bytes 26000] [--out F]

- ``floor``: the least a Python server can do per scrape: a blocking ``accept``, one ``recv``,
  ``sendall`` of the body, ``shutdown``, ``close``; no parsing, no event loop;
- ``http``: vramwatch's ``ExporterHTTPServer`` (its event loop, head parse, admission, linger) over a
  static exposition, so the loop answers every scrape from ``reply_now`` and no cache is involved
  (``scrape.py`` measures the whole server, cache and all);
- ``floor_kept`` and ``http_kept``: the same two over one kept-alive connection (an HTTP/1.1 request
  without ``Connection: close``, as Prometheus sends to an IP target): ``floor_kept`` is one ``recv``
  and one ``sendall`` a scrape, no ``accept``, no close;
- ``epoll_kept``: the least event-loop server over that connection (``select.epoll``, ``recv``,
  ``send``): what waiting in epoll, as any server of many clients on one thread does, adds to
  ``floor_kept``; ``http_kept`` less this is what vramwatch's own Python costs.

Each is scraped ``--scrapes`` times at ``--rate`` a second (a thread that sleeps between scrapes: the
cold path, the way Prometheus scrapes) and ``--busy`` times back to back (the warm path), and the
serving thread's own CPU (``/proc/self/task/TID/schedstat``) is divided by the scrapes. The ratio of
the cold to the warm figure is the machine's (caches, clock ramp-up after idle); the difference
between ``http`` and ``floor`` is what vramwatch's loop adds. Medians of ``--repeats`` rounds, with
their spread.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # puts the repository root on sys.path too

from vramwatch.server.exposition_cache import Reply
from vramwatch.server.http import ExporterHTTPServer

REQUEST = (
    b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: Prometheus/3.0.0\r\n"
    b"Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n"
    b"X-Prometheus-Scrape-Timeout-Seconds: 10\r\nConnection: close\r\n\r\n"
)
KEPT_REQUEST = REQUEST.replace(b"Connection: close\r\n", b"")


class _Static:
    """An exposition that is always current: the loop answers every scrape itself."""

    def __init__(self, body: bytes) -> None:
        self.answer = Reply(body, "text/plain; version=0.0.4; charset=utf-8")

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        return self.answer

    def reply_now(self, accept: str, gzip_ok: bool) -> Reply:
        return self.answer


def _thread_cpu(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def floor_server(body: bytes) -> tuple[int, int, Callable[[], None]]:
    """(port, serving thread's id, stop) of the least server."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=64)
    answer = b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    tid: list[int] = []
    ready = threading.Event()

    def loop() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return  # closed: stop
            with c:
                c.recv(16384)
                c.sendall(answer)
                c.shutdown(socket.SHUT_WR)
                c.recv(16384)

    threading.Thread(target=loop, daemon=True).start()
    ready.wait(10)
    return srv.getsockname()[1], tid[0], srv.close


def floor_kept_server(body: bytes) -> tuple[int, int, Callable[[], None]]:
    """(port, serving thread's id, stop) of the least server that keeps its connections (one at a time)."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=64)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    tid: list[int] = []
    ready = threading.Event()

    def loop() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return  # closed: stop
            with c:
                while c.recv(16384):
                    c.sendall(answer)

    threading.Thread(target=loop, daemon=True).start()
    ready.wait(10)
    return srv.getsockname()[1], tid[0], srv.close


def epoll_kept_server(body: bytes) -> tuple[int, int, Callable[[], None]]:
    """(port, serving thread's id, stop) of the least event-loop server: ``select.epoll`` over the
    listening socket and its kept-alive connections, one ``recv`` and one ``send`` a scrape, no parsing.
    What any server that waits in epoll (as vramwatch's loop does, to serve many clients from one
    thread) pays on top of ``floor_kept``'s blocking ``recv``."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=64)
    srv.setblocking(False)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    tid: list[int] = []
    ready = threading.Event()
    stopping = threading.Event()
    conns: dict[int, socket.socket] = {}

    def loop() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        with select.epoll() as ep:
            ep.register(srv.fileno(), select.EPOLLIN)
            while not stopping.is_set():
                for fd, _ in ep.poll(0.2):
                    if fd == srv.fileno():
                        c, _ = srv.accept()
                        c.setblocking(False)
                        conns[c.fileno()] = c
                        ep.register(c.fileno(), select.EPOLLIN)
                    elif (c := conns[fd]).recv(16384):
                        c.send(answer)  # fits the loopback send buffer
                    else:
                        ep.unregister(fd)
                        conns.pop(fd).close()
        for c in conns.values():
            c.close()
        srv.close()

    threading.Thread(target=loop, daemon=True).start()
    ready.wait(10)
    return srv.getsockname()[1], tid[0], stopping.set


def http_server(body: bytes) -> tuple[int, int, Callable[[], None]]:
    srv = ExporterHTTPServer(("127.0.0.1", 0), _Static(body), max_connections=8, timeout=5.0)
    tid: list[int] = []
    ready = threading.Event()

    def run() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        srv.serve_forever(poll_interval=1.0)

    threading.Thread(target=run, daemon=True).start()
    ready.wait(10)

    def stop() -> None:
        srv.shutdown()
        srv.server_close()

    return srv.server_address[1], tid[0], stop


def _get(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(REQUEST)
        n = 0
        while chunk := s.recv(65536):
            n += len(chunk)
    return n


class _Kept:
    """One kept-alive connection: each call sends a request and reads its answer by Content-Length."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def __call__(self, port: int) -> int:
        self.sock.sendall(KEPT_REQUEST)
        return len(common.read_answer(self.sock))

    def close(self) -> None:
        self.sock.close()


def per_scrape(port: int, tid: int, n: int, rate: float | None, get: Callable[[int], int] = _get) -> float:
    """The serving thread's CPU seconds per scrape over ``n`` scrapes (at ``rate``/s; None: back to back)."""
    c0 = _thread_cpu(tid)
    nxt = time.monotonic()
    for _ in range(n):
        if get(port) <= 0:
            raise SystemExit("a scrape got nothing back")
        if rate:
            nxt += 1.0 / rate
            time.sleep(max(0.0, nxt - time.monotonic()))
    return (_thread_cpu(tid) - c0) / n


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(xs) * 1e3, "min_ms": min(xs) * 1e3, "max_ms": max(xs) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=10.0, help="scrapes a second on the cold path (default 10)")
    ap.add_argument("--scrapes", type=int, default=100, help="cold scrapes per round (default 100)")
    ap.add_argument("--busy", type=int, default=3000, help="back-to-back scrapes per round (default 3000)")
    ap.add_argument("--bytes", type=int, default=26000, help="body size (default 26000: 1 rank, 1 GPU)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds, alternating the servers (default 3)")
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.scrapes < 1 or args.busy < 1 or args.repeats < 1 or args.bytes < 1:
        ap.error("--rate, --scrapes, --busy, --bytes and --repeats must be positive")
    body = b"x" * args.bytes
    http = http_server(body)
    servers = {
        "floor": floor_server(body),
        "http": http,
        "floor_kept": floor_kept_server(body),
        "epoll_kept": epoll_kept_server(body),
        "http_kept": http,
    }
    got: dict[str, dict[str, list[float]]] = {k: {"cold": [], "warm": []} for k in servers}
    try:
        for i in range(args.repeats):
            for name, (port, tid, _) in servers.items():  # floor, http, ... in turn: paired rounds
                get: Callable[[int], int] = _Kept(port) if name.endswith("_kept") else _get
                got[name]["cold"].append(per_scrape(port, tid, args.scrapes, args.rate, get))
                got[name]["warm"].append(per_scrape(port, tid, args.busy, None, get))
                if isinstance(get, _Kept):
                    get.close()
                print(
                    f"[scrape_floor] round {i + 1}/{args.repeats} {name}: "
                    f"{got[name]['cold'][-1] * 1e3:.3f} ms at {args.rate:g}/s, "
                    f"{got[name]['warm'][-1] * 1e3:.3f} ms back to back",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for name, (_, _, stop) in servers.items():
            if name != "http_kept":  # the same server as http's
                stop()
    result: dict[str, Any] = {
        "rate_per_s": args.rate,
        "bytes": args.bytes,
        "repeats": args.repeats,
        "what": "the serving thread's CPU per scrape (schedstat), medians of the rounds with min and max",
    }
    for name, v in got.items():
        result[name] = {"cold": _summary(v["cold"]), "warm": _summary(v["warm"])}
    for name in servers:
        c, w = result[name]["cold"]["median_ms"], result[name]["warm"]["median_ms"]
        print(f"{name}: {c:.3f} ms a scrape at {args.rate:g}/s, {w:.3f} ms back to back ({c / w:.1f}x)")
    for ours, least in (("http", "floor"), ("http_kept", "floor_kept"), ("http_kept", "epoll_kept")):
        added = result[ours]["cold"]["median_ms"] - result[least]["cold"]["median_ms"]
        print(f"vramwatch's loop adds {added:.3f} ms a cold scrape to {least}'s")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

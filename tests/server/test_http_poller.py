"""The loop's poller: epoll where the system has it, else ``select.poll`` behind the same calls (``_Poll``).
Both serve the same bytes through every way a connection is watched: read (a head, a kept-alive wait),
write (an answer larger than the socket takes at once: ``modify``), and neither (closed: ``unregister``).
"""

from __future__ import annotations

import select

import pytest
from test_http_exact import connect, make_server  # noqa: F401 - the fixture
from test_http_kept_answer import SCRAPE, TEXT, Ready, _ask, _until

from harness import read_answer
from vramwatch.server import http as http_module

CLOSE = SCRAPE.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
BIG = b"x" * (8 << 20)  # more than loopback's send buffer: the answer waits to be writable


def _served(make_server, monkeypatch, poller) -> list[bytes]:  # noqa: F811
    monkeypatch.setattr(http_module, "_poller", poller)
    srv = make_server(Ready())
    got = []
    with connect(srv) as s:
        got += [_ask(srv, s, SCRAPE), _ask(srv, s, SCRAPE)]  # the second in the kept-alive step
    with connect(srv) as s:
        s.sendall(CLOSE)
        got.append(read_answer(s))
        assert s.recv(1) == b""  # closed after the answer
    srv.exposition.body = BIG
    with connect(srv) as s:
        s.sendall(SCRAPE)
        got.append(read_answer(s))
    assert isinstance(srv._sel, http_module._Poll if poller is http_module._Poll else select.epoll)
    _until(lambda: len(srv._by_fd) == 2, "a closed connection is still watched")  # the listener and the wake
    return got


def test_poll_serves_what_epoll_serves(make_server, monkeypatch):  # noqa: F811
    if not hasattr(select, "epoll"):
        pytest.skip("no epoll here: _Poll is the poller")
    with_epoll = _served(make_server, monkeypatch, http_module._poller)
    with_poll = _served(make_server, monkeypatch, http_module._Poll)
    assert with_poll == with_epoll
    assert with_epoll[0] == with_epoll[1] and with_epoll[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert f"Content-Type: {TEXT}\r\n".encode() in with_epoll[0]
    assert with_epoll[2].startswith(b"HTTP/1.0 200 OK\r\n")
    assert with_epoll[3].endswith(BIG) and len(with_epoll[3]) > len(BIG)


def test_poll_waits_its_timeout_in_milliseconds(monkeypatch):
    waited = []

    class Fake:
        register = modify = unregister = None

        def poll(self, timeout_ms):
            waited.append(timeout_ms)
            return []

    monkeypatch.setattr(select, "poll", Fake)
    assert http_module._Poll().poll(0.25, 64) == [] and waited == [250.0]

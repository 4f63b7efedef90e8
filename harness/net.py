"""Loopback networking: a free port, a GET, and bounded waits."""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any


class WaitTimeout(AssertionError):
    """A bounded wait ran out; the message says what it waited for and what it saw last.

    An AssertionError, so a test that times out reads as a failed check rather than an error."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_get(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """(status, body); an HTTP error status is returned, a connection error raises OSError."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` s pass (WaitTimeout)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - keep polling, report the last failure
            last = e
        time.sleep(interval)
    raise WaitTimeout(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def wait_http(url: str, timeout: float, interval: float = 0.05) -> bool:
    """True once ``url`` answers 200, False when ``timeout`` s pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if http_get(url, timeout=1.0)[0] == 200:
                return True
        except (OSError, ValueError):
            pass
        time.sleep(interval)
    return False


def wait_port_closed(port: int, timeout: float) -> None:
    """Until nothing listens on 127.0.0.1:``port`` (WaitTimeout after ``timeout`` s)."""
    wait_until(lambda: not port_open(port), timeout, f"port {port} to close")


# Reading one HTTP answer off a raw socket the way a keep-alive client does (the server may keep it open).
_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.I)


def read_answer(s: socket.socket, head_request: bool = False, quiet: tuple[type[BaseException], ...] = ()) -> bytes:
    """Bytes up to the end of one answer: its ``Content-Length`` after the head when the server keeps
    the connection (an HTTP/1.1 status line), else up to the server's close. ``head_request``: the
    answer to a HEAD has no body whatever its length says. ``quiet``: errors that end the read with
    what came so far (a reset after a refusal)."""
    out = bytearray()
    try:
        while not _complete(out, head_request):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except quiet:
        pass
    return bytes(out)


def _complete(out: bytearray, head_request: bool) -> bool:
    end = out.find(b"\r\n\r\n")
    if end < 0 or not out.startswith(b"HTTP/1.1 "):
        return False  # an HTTP/1.0 answer ends with the connection
    m = _LENGTH.search(out[: end + 2])
    return len(out) >= end + 4 + (0 if head_request or m is None else int(m.group(1)))

"""Reading one HTTP answer off a raw socket the way a keep-alive client does (the server may keep it open)."""

from __future__ import annotations

import re
import socket

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

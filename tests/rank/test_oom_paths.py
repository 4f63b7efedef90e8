"""The OOM log line and its byte counts, called directly (test_oom.py drives the observer end to end)."""

from __future__ import annotations

import logging

from vramwatch.rank.oom import OomWatcher, _fmt

GIB = 1 << 30


def test_byte_counts_in_the_log_line():
    assert [_fmt(n) for n in (0, 1023, 1024, 1536, 5 << 20, 3 * GIB, GIB - 1, -2048, 1.5, 1 << 40)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "1.50 KiB",
        "5.00 MiB",
        "3.00 GiB",
        "1024.00 MiB",  # just under a GiB
        "-2.00 KiB",
        "1 B",
        "1024.00 GiB",  # the largest unit: a TiB stays in GiB
    ]


def test_the_oom_line_is_rate_limited_and_counts_what_it_left_out(caplog):
    w = OomWatcher()
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        w._log_oom(100.0, 1, 2 * GIB, 512 << 20, None)
        w._log_oom(105.0, 1, GIB, 0, None)  # within 10 s of the last line: counted, not logged
        w._log_oom(106.0, 1, GIB, 0, None)
        w._log_oom(110.0, 0, 1536, 100, None)  # 10 s after the first: logged, with the two left out
        w._log_oom(111.0, 0, GIB, 0, "/snap/x.pickle")  # a snapshot is always said
    assert caplog.messages == [
        "vramwatch: CUDA out of memory on device 1: tried to allocate 2.00 GiB with 512.00 MiB free",
        "vramwatch: CUDA out of memory on device 0: tried to allocate 1.50 KiB with 100 B free"
        " (2 more since the last report)",
        "vramwatch: CUDA out of memory on device 0: tried to allocate 1.00 GiB with 0 B free"
        "; memory snapshot: /snap/x.pickle",
    ]

"""The status line's start line (which rank of which job, where it goes) and a one-byte limit's headroom."""

from __future__ import annotations

import logging
import os
import types

import pytest

from vramwatch.rank import status
from vramwatch.rank.heartbeat import Heartbeat
from vramwatch.rank.status import StatusLine
from vramwatch.spool import DeviceSample

NS = types.SimpleNamespace


@pytest.fixture
def status_records(caplog):
    log = status.status_log
    saved = log.propagate
    log.propagate = True  # an earlier StatusLine may have printed to stderr itself; caplog listens at the root
    with caplog.at_level(logging.INFO, logger="vramwatch.status"):
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "vramwatch.status"]
    log.propagate = saved


def test_for_rank_says_the_rank_the_world_size_and_the_job_on_the_console(status_records):
    ctx = NS(
        heartbeat=Heartbeat(),
        settings=NS(status_every=3, status_all_ranks=True),
        identity=NS(rank=4, world_size=8, job_id="7.0"),
        spool_dir="",
    )
    StatusLine.for_rank(ctx)
    assert status_records() == [f"vramwatch: rank 4 of 8, job_id 7.0, pid {os.getpid()}"]


def test_the_start_line_goes_to_the_callers_emit_with_its_own_head():
    got = []
    s = StatusLine(Heartbeat(), 5, rank=2, emit=lambda lines, head: got.append((lines, head)))
    text = s.start(4, "j")
    assert text == f"vramwatch: rank 2 of 4, job_id j, pid {os.getpid()}"
    assert got == [([text], "start")]


def test_the_start_line_is_logged(status_records):
    s = StatusLine(Heartbeat(), 5)
    text = s.start(1, "j")
    assert status_records() == [text]


def test_a_one_byte_limit_still_shows_headroom():
    d = DeviceSample(0, "GPU-a", {"torch_cuda_memory_limit_bytes": 1.0})
    assert "headroom 0.00 GiB" in status.format_device(d, {})

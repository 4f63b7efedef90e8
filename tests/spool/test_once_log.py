"""OnceLog stays bounded whatever the keys: a node daemon logs what local users plant, and they choose the keys."""

from __future__ import annotations

import logging

import pytest

from vramwatch._once import OnceLog


def test_a_flood_of_distinct_problems_gives_bounded_lines_and_memory(caplog: pytest.LogCaptureFixture) -> None:
    once = OnceLog(logging.getLogger("vramwatch"), max_keys=1000, burst=50, refill=3600.0)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        for i in range(100_000):  # 100,000 junk names in the node root: one refusal each
            once(("refused", f"/run/vramwatch/junk-{i}"), "vramwatch: refused junk-%d", i)
    assert len(caplog.records) == 50
    assert len(once._seen) <= 1000
    assert once.suppressed == 100_000 - 50


def test_a_key_seen_again_logs_nothing_and_the_left_out_lines_are_said(caplog: pytest.LogCaptureFixture) -> None:
    once = OnceLog(logging.getLogger("vramwatch"), burst=2, refill=0.001)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        assert once("a", "first a") and not once("a", "first a")
        assert once("b", "first b")
        assert not once("c", "first c")  # the burst is spent: left out, not remembered
        once._tokens = 1.0  # time passed
        assert once("c", "first c")
    assert [r.getMessage() for r in caplog.records] == [
        "first a",
        "first b",
        "vramwatch: 1 more distinct problems were not logged (too many at once)",
        "first c",
    ]


def test_the_least_recently_seen_key_is_forgotten_first() -> None:
    once = OnceLog(logging.getLogger("vramwatch"), max_keys=2, burst=100)
    once("a", "a")
    once("b", "b")
    once("a", "a")  # seen again: kept
    once("c", "c")
    assert list(once._seen) == ["a", "c"]

"""vramwatch.server.auth: what a header is worth, what is cached, and the bcrypt budget per source address."""

from __future__ import annotations

import base64
import logging

import bcrypt
import pytest

from vramwatch.server.auth import BasicAuth, Check, FailureBudget

HASH4 = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()  # cost 4: fast tests


def token(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_a_password_may_hold_colons_the_user_may_not():  # RFC 7617: the first colon ends the user-id
    h = bcrypt.hashpw(b"pa:ss:", bcrypt.gensalt(4)).decode()
    auth = BasicAuth((("alice", h),))
    assert auth("Basic " + token(b"alice:pa:ss:"))
    assert BasicAuth.credentials("Basic " + token(b"alice:pa:ss:")) == (b"alice", b"pa:ss:")


@pytest.mark.parametrize(
    "header",
    [
        "Bearer " + token(b"alice:s3cret"),  # the right pair under another scheme
        "Basic " + token(b"alice:s3cret")[:4] + "*" + token(b"alice:s3cret")[4:],  # not base64 (Go refuses it too)
        "Basic " + token(b"alice"),  # no colon: no pair
        "Basic " + token(b"alice:s3cret" + b"x" * 4000),  # over 4 KB: refused before any work
    ],
)
def test_malformed_headers_are_refused_without_a_bcrypt(header):
    auth = BasicAuth((("alice", HASH4),))
    assert auth.check(header) == (Check.NO_CREDENTIALS, None)
    assert not auth(header)


def test_every_verified_pair_is_recognised_not_only_the_last():
    """Two users (two Prometheus servers, or a Prometheus and a person): neither costs a bcrypt per scrape."""
    auth = BasicAuth((("alice", HASH4), ("bob", HASH4)))
    for user in (b"alice", b"bob"):
        assert auth.verify((user, b"s3cret"))
    for user in ("alice", "bob"):
        assert auth.check("Basic " + token(f"{user}:s3cret".encode()))[0] is Check.VERIFIED


def test_a_full_cache_forgets_the_oldest_pair_and_keeps_the_newest(monkeypatch):
    h = {u: bcrypt.hashpw(u.encode(), bcrypt.gensalt(4)).decode() for u in ("a", "b", "c")}
    auth = BasicAuth(tuple(h.items()))
    monkeypatch.setattr(auth, "CACHE_SIZE", 2)
    for u in ("a", "b", "c"):
        assert auth.verify((u.encode(), u.encode()))
    got = {u: auth.check("Basic " + token(f"{u}:{u}".encode()))[0] for u in h}
    assert got == {"a": Check.UNVERIFIED, "b": Check.VERIFIED, "c": Check.VERIFIED}


def test_an_unknown_user_with_a_long_password_is_refused_not_an_error():
    # bcrypt 5 raises for more than 72 bytes: the dummy check cuts the password as the real one does
    auth = BasicAuth((("alice", HASH4),))
    assert auth.verify((b"mallory", b"x" * 100)) is False


def test_a_failing_bcrypt_refuses():
    auth = BasicAuth((("alice", HASH4),))

    class Broken:
        @staticmethod
        def checkpw(password: bytes, hashed: bytes) -> bool:
            raise ValueError("Invalid salt")

    auth._bcrypt = Broken
    assert auth("Basic " + token(b"alice:s3cret")) is False


def test_only_users_at_different_costs_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        BasicAuth((("a", HASH4), ("b", HASH4)))
    assert caplog.messages == []
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        BasicAuth((("a", HASH4), ("b", bcrypt.hashpw(b"x", bcrypt.gensalt(5)).decode())))
    assert caplog.messages == [
        "vramwatch: basic_auth_users are hashed at different bcrypt costs (4, 5): the time to refuse tells "
        "those users apart; hash them all at one cost"
    ]


def test_the_budget_refills_at_its_rate():
    budget = FailureBudget(rate=2.0, burst=2.0)
    assert [budget.take("a", 0.0) for _ in range(3)] == [True, True, False]
    assert budget.take("a", 0.5) and not budget.take("a", 0.5)  # 2 a second: one back after 0.5 s
    assert budget.take("a", 10.0) and budget.take("a", 10.0) and not budget.take("a", 10.0)  # never beyond burst


def test_a_full_table_of_sources_forgets_the_least_recently_seen():
    """An attacker cycling through addresses cannot reset its own bucket; only the longest-quiet source goes."""
    budget = FailureBudget(rate=0.0, burst=1.0, max_sources=2)
    assert budget.take("a", 0.0) and budget.take("b", 0.0)
    assert not budget.take("a", 1.0)  # two sources fit: a is remembered (and is now the most recent)
    assert budget.take("c", 1.0)  # a third: b, seen longest ago, is forgotten
    assert not budget.take("c", 2.0) and not budget.take("a", 2.0)
    assert budget.take("b", 2.0)  # b starts over

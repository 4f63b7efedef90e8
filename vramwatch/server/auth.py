"""Basic auth that a password-guessing flood cannot turn against Prometheus.

Two steps, so the HTTP server can run the cheap one on its event loop and keep the expensive
one on a budget of its own:

- :meth:`BasicAuth.check` (microseconds): parses the header and looks the pair up among the
  pairs already verified. A Prometheus that authenticated once is recognised here on every
  later scrape, whatever else is hammering the port.
- :meth:`BasicAuth.verify` (one bcrypt, tens to hundreds of ms): the same work for unknown and
  known users. An unknown user is checked against a dummy hash of the users' own cost, so the
  time to refuse does not tell which names exist. Name and cache compares are constant-time.

:class:`FailureBudget` bounds the bcrypt work each source address can cause: a few checks a
second (a token bucket per address), so one attacker cannot keep the bcrypt worker to itself.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from base64 import b64decode
from binascii import Error as BinasciiError
from collections import OrderedDict
from enum import Enum

log = logging.getLogger("vramwatch")

__all__ = ["BasicAuth", "Check", "FailureBudget"]

Credentials = tuple[bytes, bytes]  # (user, password)


class Check(Enum):
    NO_CREDENTIALS = "no credentials"  # missing or malformed header: refused without a bcrypt
    VERIFIED = "verified"  # a pair verified before: allowed without a bcrypt
    UNVERIFIED = "unverified"  # well-formed but not seen: needs verify()


def _cost(hashed: bytes) -> int:
    return int(hashed.split(b"$")[2])


class BasicAuth:
    """``Authorization`` header -> allowed. Verified pairs are cached as HMACs under a per-process key."""

    CACHE_SIZE = 256

    def __init__(self, users: tuple[tuple[str, str], ...]) -> None:
        import hashlib  # lazily, with hmac: hashlib loads libcrypto (about 3 MB resident)
        import hmac

        import bcrypt  # lazily: only when basic_auth_users is set

        self._bcrypt = bcrypt
        self._compare = hmac.compare_digest
        self._hmac = hmac.new
        self._sha256 = hashlib.sha256
        self.users = users  # as the web config gave them: a reload with the same users keeps this cache
        self._users = [(name.encode("utf-8"), hashed.encode("ascii")) for name, hashed in users]
        costs = sorted({_cost(h) for _, h in self._users})
        if len(costs) > 1:
            log.warning(
                "vramwatch: basic_auth_users are hashed at different bcrypt costs (%s): the time to refuse "
                "tells those users apart; hash them all at one cost",
                ", ".join(map(str, costs)),
            )
        self._dummy_cost = costs[-1] if costs else 10
        self._dummy: bytes | None = None  # made at the first unknown user: one bcrypt of that cost
        self._key = os.urandom(32)  # cache keys are worthless outside this process
        self._ok: OrderedDict[bytes, None] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()  # bcrypt is slow by design: at most one core on it

    @staticmethod
    def credentials(header: str | None) -> Credentials | None:
        if not header:
            return None
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "basic" or not token or len(token) > 4096:
            return None
        try:
            raw = b64decode(token.strip(), validate=True)
        except (BinasciiError, ValueError):
            return None
        user, sep, password = raw.partition(b":")
        return (user, password) if sep else None

    def _lookup(self, user: bytes) -> bytes | None:
        hashed = None
        for name, h in self._users:  # every name compared, in constant time each
            if self._compare(name, user):
                hashed = h
        return hashed

    def _cache_key(self, user: bytes, hashed: bytes, password: bytes) -> bytes:
        msg = b"".join(struct.pack(">I", len(x)) + x for x in (user, hashed, password))
        return self._hmac(self._key, msg, self._sha256).digest()

    def check(self, header: str | None) -> tuple[Check, Credentials | None]:
        """The cheap step: no bcrypt, ever."""
        creds = self.credentials(header)
        if creds is None:
            return Check.NO_CREDENTIALS, None
        user, password = creds
        key = self._cache_key(user, self._lookup(user) or b"", password)
        with self._cache_lock:
            cached = False
            for k in self._ok:
                cached |= self._compare(k, key)
        return (Check.VERIFIED if cached else Check.UNVERIFIED), creds

    def verify(self, creds: Credentials) -> bool:
        """The expensive step: one bcrypt, for known and unknown users alike; caches a success."""
        user, password = creds
        hashed = self._lookup(user)
        with self._bcrypt_lock:
            if hashed is None:  # unknown users cost what (the most expensive) known ones do
                if self._dummy is None:
                    self._dummy = self._bcrypt.hashpw(os.urandom(16), self._bcrypt.gensalt(self._dummy_cost))
                self._bcrypt.checkpw(password[:72], self._dummy)
                return False
            # bcrypt reads 72 bytes; htpasswd and Go truncate longer passwords the same way
            ok = self._bcrypt.checkpw(password[:72], hashed)
        if ok:
            key = self._cache_key(user, hashed, password)
            with self._cache_lock:
                self._ok[key] = None
                while len(self._ok) > self.CACHE_SIZE:
                    self._ok.popitem(last=False)
        return ok

    def __call__(self, header: str | None) -> bool:
        """Both steps in one call (for callers without an event loop)."""
        try:
            result, creds = self.check(header)
            if result is Check.VERIFIED:
                return True
            return creds is not None and self.verify(creds)
        except Exception:  # noqa: BLE001 - a malformed header is a refusal, never a crash
            return False


class FailureBudget:
    """A token bucket per source address for bcrypt checks: ``rate`` a second, ``burst`` at once.

    Only checks of pairs not verified before spend tokens, so a source whose Prometheus
    authenticated once keeps scraping while its guesses are refused without a bcrypt.
    At most ``max_sources`` addresses are tracked (the least recently seen is forgotten).
    """

    def __init__(self, rate: float = 2.0, burst: float = 4.0, max_sources: int = 4096) -> None:
        self.rate, self.burst, self.max_sources = rate, burst, max_sources
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # source -> (tokens, when)

    def take(self, source: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        tokens, then = self._buckets.pop(source, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        ok = tokens >= 1.0
        self._buckets[source] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)
        return ok

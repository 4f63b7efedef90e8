"""The server's side of the spool: the live ranks' newest samples, dead ranks' final ones, bounded."""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

from vramwatch.spool import files, limits
from vramwatch.spool.codec import SampleRejected, decode_sample
from vramwatch.spool.schema import SCHEMA_VERSION, RankSample


@dataclass(frozen=True, slots=True)
class Rejected:
    """A rank file whose sample this reader could not use."""

    file: str  # the file's name in the spool
    reason: str  # older_version, newer_version, malformed
    detail: str
    version: int | None = None

    def describe(self) -> str:
        if self.reason in ("older_version", "newer_version"):
            return (
                f"{self.file} holds a sample of spool schema version {self.version}, this server reads "
                f"version {SCHEMA_VERSION}; its rank is not exported (run one vramwatch version per node)"
            )
        return f"{self.file} holds a malformed sample ({self.detail}); its rank is not exported"


@dataclass
class SpoolRead:
    """One read of the spool by the scrape path."""

    live: list[RankSample] = field(default_factory=list)  # the newest sample per live (job, rank), in that order
    final: list[RankSample] = field(default_factory=list)  # dead ranks' final samples in their grace, newest first
    evicted: list[RankSample] = field(default_factory=list)  # final samples the cap dropped (removed) this read
    rejected: list[Rejected] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)  # what the bounds cut, by reason (limits.DROP_REASONS)


def read_spool(spool_dir: str, max_ranks: int, grace: float, now: float | None = None, reap: bool = True) -> SpoolRead:
    """Live ranks' newest samples, and the final samples of dead ranks for ``grace`` seconds.

    A rank is dead once the lock beside its file is free, however it ended. Its file stays in the
    spool, served as its final sample (the OOM that killed it) until ``grace`` seconds after that
    sample was taken; then ``reap`` removes it. Keeping it on disk rather than in the server makes
    the window a matter of time alone: no request, aborted or not, uses it up, and a restarted
    server still serves it. A rank is its (job id, rank): the same rank of two jobs on the node is two.
    Live and final samples together are at most ``max_ranks``, of all jobs: final ones are dropped
    first, oldest first, counted as ``dead_rank``; live ones beyond the cap as ``rank``.
    """
    now = time.time() if now is None else now
    out = SpoolRead()
    try:
        names = os.listdir(spool_dir)
    except OSError:
        return out
    best: dict[tuple[str, int], RankSample] = {}
    dead: list[tuple[RankSample, str]] = []
    present = set(names)
    for name in names:
        m = files.RANK_FILE.match(name)
        if not m:
            if reap and name.endswith(".tmp") and name[:-4] not in present and files.RANK_FILE.match(name[:-4]):
                _reap_unpublished(os.path.join(spool_dir, name[:-4]))
            continue
        path = os.path.join(spool_dir, name)
        lock = files.lock_path_of(path)
        if files.lock_is_free(lock):  # owner gone
            last = _read(path, name, None, out.dropped, tries=1)
            if last is not None and abs(now - last.time) < grace:  # a stamp in the future expires too
                dead.append((last, path))
            elif reap:
                files.remove_quietly(path, lock, path + ".tmp")
            continue
        sample = _read(path, name, out.rejected, out.dropped)
        if sample is None:
            continue
        key = (sample.job_id, sample.rank)  # the labels it renders with: one label set per exposition
        if key not in best or sample.time > best[key].time:
            best[key] = sample
    ranks = sorted(best)
    if len(ranks) > max_ranks:
        out.dropped["rank"] += len(ranks) - max_ranks
    out.live = [best[r] for r in ranks[:max_ranks]]
    dead.sort(key=lambda d: d[0].time, reverse=True)
    room = max(0, max_ranks - len(out.live))
    for sample, path in dead[room:]:  # the oldest final samples make way
        out.dropped["dead_rank"] += 1
        out.evicted.append(sample)
        if reap:
            files.remove_quietly(path, files.lock_path_of(path), path + ".tmp")
    out.final = [s for s, _ in dead[:room]]
    return out


def _reap_unpublished(path: str) -> None:
    """A rank that died inside its first publish left a temporary file and its lock, and no sample:
    nothing to serve, so both go once the lock is free (a live rank mid-publish still holds it)."""
    lock = files.lock_path_of(path)
    if files.lock_is_free(lock):
        files.remove_quietly(path + ".tmp", lock)


def read_samples(
    spool_dir: str, max_ranks: int, reap: bool = True, rejected: list[Rejected] | None = None
) -> list[RankSample]:
    """Live ranks' newest samples, one per rank (dead ranks' files removed when ``reap``)."""
    read = read_spool(spool_dir, max_ranks, 0.0, reap=reap)
    if rejected is not None:
        rejected += read.rejected
    return read.live


def _read(
    path: str, name: str, rejected: list[Rejected] | None, dropped: Counter[str], tries: int = 5
) -> RankSample | None:
    for _ in range(tries):
        try:
            with open(path, "rb") as fh:
                raw = fh.read(limits.MAX_SAMPLE_BYTES + 1)
        except OSError:
            return None
        if len(raw) > limits.MAX_SAMPLE_BYTES:
            dropped["oversized"] += 1
            return None
        payload = files.unframe(raw)
        if payload is not None:
            try:
                return limits.bounded(decode_sample(payload), dropped)
            except SampleRejected as e:
                if rejected is not None:
                    rejected.append(Rejected(name, e.reason, e.detail, e.version))
                return None
        time.sleep(0.0005)  # a write in progress: it takes microseconds
    if rejected is not None:
        rejected.append(Rejected(name, "malformed", "no complete record"))
    return None


def any_rank_files(spool_dir: str) -> bool:
    """Whether any rank, alive or dead and not yet reaped, has published here."""
    try:
        return any(files.RANK_FILE.match(n) for n in os.listdir(spool_dir))
    except OSError:
        return False


def sample_age(sample: RankSample, now: float | None = None) -> float:
    return sample.age(time.time() if now is None else now)

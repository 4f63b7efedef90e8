"""The server's side of the spool: the live ranks' newest samples, dead ranks' final ones, bounded."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from vramwatch.spool import files, limits, node
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
    refused: list[node.Refused] = field(default_factory=list)  # node spool entries not trusted (node.Refused)
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

    ``spool_dir`` is a rank-started server's private spool, or a node daemon's root: then each user's
    directory in it is read, a rank is that user's (the kernel's owner of the directory and file), and
    entries that cannot be trusted are refused (:mod:`.node`), listed in ``refused``.
    """
    now = time.time() if now is None else now
    out = SpoolRead()
    best: dict[tuple[str, int], RankSample] = {}  # by (job id, rank): the label set it renders with
    dead: list[tuple[RankSample, node.SpoolDir, str]] = []
    try:
        dirs = node.open_dirs(spool_dir, out.refused)
    except OSError:
        return out
    for d in dirs:
        try:
            names = d.names()
        except OSError:
            continue  # a user's directory gone since the root's listing: the others are read
        _read_dir(d, names, now, grace, reap, out, best, dead)
        if reap and not names:
            d.remove_if_stale(now)
    keys = sorted(best)
    if len(keys) > max_ranks:
        out.dropped["rank"] += len(keys) - max_ranks
    out.live = [best[k] for k in keys[:max_ranks]]
    dead.sort(key=lambda d: d[0].time, reverse=True)
    room = max(0, max_ranks - len(out.live))
    for sample, _, _ in dead[room:]:  # the oldest final samples make way
        out.dropped["dead_rank"] += 1
        out.evicted.append(sample)
    if reap and dead[room:]:
        _evict(spool_dir, {(d.uid, name) for _, d, name in dead[room:]})
    out.final = [s for s, _, _ in dead[:room]]
    out.dropped["refused"] += len(out.refused)
    return out


def _read_dir(
    d: node.SpoolDir,
    names: list[str],
    now: float,
    grace: float,
    reap: bool,
    out: SpoolRead,
    best: dict[tuple[str, int], RankSample],
    dead: list[tuple[RankSample, node.SpoolDir, str]],
) -> None:
    present = set(names)
    for name in names:
        m = files.RANK_FILE.match(name)
        if not m:
            if reap and name.endswith(".tmp") and name[:-4] not in present and files.RANK_FILE.match(name[:-4]):
                _reap_unpublished(d, name[:-4])
            continue
        lock = files.lock_path_of(name)
        if d.lock_free(lock):  # owner gone
            last = _read(d, name, None, out.dropped, tries=1)
            if last is not None and abs(now - last.time) < grace:  # a stamp in the future expires too
                dead.append((last, d, name))
            elif reap:
                d.remove(name, lock, name + ".tmp")
            continue
        sample = _read(d, name, out.rejected, out.dropped)
        if sample is None:
            continue
        key = (sample.job_id, sample.rank)  # the labels it renders with: one label set per exposition
        if key not in best or sample.time > best[key].time:
            best[key] = sample


def _evict(spool_dir: str, victims: set[tuple[int | None, str]]) -> None:
    """Remove the final samples the cap dropped (their directories are open again for it)."""
    try:
        dirs = node.open_dirs(spool_dir)
    except OSError:
        return  # the spool is gone: so are they
    for d in dirs:
        for uid, name in victims:
            if uid == d.uid:
                d.remove(name, files.lock_path_of(name), name + ".tmp")


def _reap_unpublished(d: node.SpoolDir, name: str) -> None:
    """A rank that died inside its first publish left a temporary file and its lock, and no sample:
    nothing to serve, so both go once the lock is free (a live rank mid-publish still holds it)."""
    lock = files.lock_path_of(name)
    if d.lock_free(lock):
        d.remove(name + ".tmp", lock)


def read_samples(
    spool_dir: str, max_ranks: int, reap: bool = True, rejected: list[Rejected] | None = None
) -> list[RankSample]:
    """Live ranks' newest samples, one per rank (dead ranks' files removed when ``reap``)."""
    read = read_spool(spool_dir, max_ranks, 0.0, reap=reap)
    if rejected is not None:
        rejected += read.rejected
    return read.live


def _read(
    d: node.SpoolDir, name: str, rejected: list[Rejected] | None, dropped: Counter[str], tries: int = 5
) -> RankSample | None:
    for _ in range(tries):
        raw = d.read(name, limits.MAX_SAMPLE_BYTES + 1)
        if raw is None:
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
        return any(any(files.RANK_FILE.match(n) for n in d.names()) for d in node.open_dirs(spool_dir))
    except OSError:
        return False


def sample_age(sample: RankSample, now: float | None = None) -> float:
    return sample.age(time.time() if now is None else now)

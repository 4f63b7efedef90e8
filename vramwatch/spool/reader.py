"""The server's side of the spool: the live ranks' newest samples, dead ranks' final ones, bounded."""

from __future__ import annotations

import threading
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
    expires: float | None = None  # wall time when the first of ``final`` leaves its window (None: no final)


# a jump of the wall clock against the monotonic one, between two reads, beyond this is a clock step
CLOCK_STEP = 1.0

Owner = int | None  # the kernel's owner of a node daemon's user directory; None: a private spool's one user


@dataclass
class _Ranks:
    """What one owner (one user of a node daemon) published, before the bounds."""

    live: dict[tuple[str, int], tuple[RankSample, str]] = field(default_factory=dict)  # (job id, rank) -> newest
    dead: list[tuple[RankSample, str]] = field(default_factory=list)  # final samples and their entries
    claimed: dict[str, float] = field(default_factory=dict)  # job id -> when its first rank started here


class SpoolReader:
    """Reads one spool, again and again: the server's scrape path.

    A rank is dead once the lock beside its file is free, however it ended. Its file stays in the
    spool, served as its final sample (the OOM that killed it) until ``grace`` seconds after that
    sample was taken; then ``reap`` removes it. Keeping it on disk rather than in the server makes
    the window a matter of time alone: no request, aborted or not, uses it up, and a restarted
    server still serves it. The window is measured on the wall clock when a final sample is first
    seen, then on the monotonic clock: a step of the wall clock (NTP, a VM resumed) does not end
    every window at once; a step seen between two reads is taken off the age of a final sample first
    seen then whose age makes sense only across it. A rank is its (job id, rank): the same rank of two
    jobs on the node is two.

    ``spool_dir`` is a rank-started server's private spool, or a node daemon's root: then each user's
    directory in it is read, a rank is that user's (the kernel's owner of the directory and file), and
    entries that cannot be trusted are refused (:mod:`.node`), listed in ``refused``. No user blinds
    another: ``max_ranks`` live ranks, and as many final samples apart from them, are shared among the
    owners max-min fairly (each gets what it asks up to an equal share of what the smaller ones left), and
    so is the series budget (:data:`.limits.SERIES_PER_RANK` a rank); an owner's ranks beyond its share are
    dropped (``rank``; its oldest final samples, ``dead_rank``). A job id is one owner's: a second owner
    publishing under it is refused while the first one's ranks are there (the first: the one seen
    earlier, or whose rank's lock is older).
    """

    def __init__(self, spool_dir: str, max_ranks: int, grace: float) -> None:
        self.spool_dir, self.max_ranks, self.grace = spool_dir, max_ranks, grace
        self._deadline: dict[str, tuple[float, float]] = {}  # entry -> (its sample's time, monotonic deadline)
        self._owner_of: dict[str, Owner] = {}  # job id -> the owner it was attributed to
        self._offset: float | None = None  # wall - monotonic at the last read

    def read(self, now: float | None = None, mono: float | None = None, reap: bool = True) -> SpoolRead:
        """Live ranks' newest samples, and the final samples of dead ranks for their window.

        ``now`` is the wall clock, ``mono`` the monotonic one; a caller that gives ``now`` alone runs both
        clocks as one (tests)."""
        if mono is None:
            mono = time.monotonic() if now is None else now
        now = time.time() if now is None else now
        offset, step = now - mono, 0.0
        if self._offset is not None and abs(offset - self._offset) > CLOCK_STEP:
            step = offset - self._offset
        self._offset = offset
        out = SpoolRead()
        owners: dict[Owner, _Ranks] = {}
        deadlines: dict[str, tuple[float, float]] = {}
        try:
            dirs = node.open_dirs(self.spool_dir, out.refused)
        except OSError:
            return out
        for d in dirs:
            try:
                names = d.names()
            except OSError:
                continue  # a user's directory gone since the root's listing: the others are read
            mine = owners.setdefault(d.uid, _Ranks())
            self._read_dir(d, names, now, mono, step, reap, out, mine, deadlines)
            if reap and not names:
                d.remove_if_stale(now)
        self._deadline = deadlines
        self._attribute_jobs(owners, out)
        # live ranks in (job id, rank) order; final samples newest first: each owner's first ones are kept
        live, cut = _fair({o: [v for _, v in sorted(r.live.items())] for o, r in owners.items()}, self.max_ranks)
        out.dropped["rank"] += len(cut)
        out.live = sorted((s for s, _ in live), key=lambda s: (s.job_id, s.rank))
        newest = {o: sorted(r.dead, key=lambda x: x[0].time, reverse=True) for o, r in owners.items()}
        final, evicted = _fair(newest, self.max_ranks)
        out.final = sorted((s for s, _ in final), key=lambda s: s.time, reverse=True)
        out.dropped["dead_rank"] += len(evicted)
        out.evicted = [s for s, _ in evicted]
        if reap and evicted:
            _evict(self.spool_dir, {entry for _, entry in evicted})
        if final:
            out.expires = now + min(deadlines[entry][1] for _, entry in final) - mono
        out.dropped["refused"] += len(out.refused)
        return out

    def _read_dir(
        self,
        d: node.SpoolDir,
        names: list[str],
        now: float,
        mono: float,
        step: float,
        reap: bool,
        out: SpoolRead,
        mine: _Ranks,
        deadlines: dict[str, tuple[float, float]],
    ) -> None:
        present = set(names)
        for name in names:
            m = files.RANK_FILE.match(name)
            if not m:
                if reap and name.endswith(".tmp") and name[:-4] not in present and files.RANK_FILE.match(name[:-4]):
                    _reap_unpublished(d, name[:-4])
                continue
            lock = files.lock_path_of(name)
            entry = f"{d.path}/{name}"
            if d.lock_free(lock):  # owner gone
                last = _read(d, name, None, out.dropped, tries=1)
                window = None if last is None else self._window(entry, last, now, mono, step)
                if last is not None and window is not None:
                    deadlines[entry] = window
                    mine.dead.append((last, entry))
                    _claim(mine, last.job_id, d.ctime.get(name, 0.0))
                elif reap:
                    d.remove(name, lock, name + ".tmp")
                continue
            sample = _read(d, name, out.rejected, out.dropped)
            if sample is None:
                continue
            _claim(mine, sample.job_id, d.ctime.get(lock, 0.0))
            key = (sample.job_id, sample.rank)  # the labels it renders with: one label set per exposition
            if key not in mine.live or sample.time > mine.live[key][0].time:
                mine.live[key] = (sample, entry)

    def _window(self, entry: str, last: RankSample, now: float, mono: float, step: float) -> tuple[float, float] | None:
        """(sample time, monotonic deadline) of a final sample, or None once its window is over."""
        seen = self._deadline.get(entry)
        if seen is None or seen[0] != last.time:  # first seen dead (or dead again, with a newer sample)
            age = now - last.time
            if step and not 0.0 <= age < self.grace:  # taken before the step this read saw: measured across it
                age -= step
            if abs(age) >= self.grace:  # a stamp too far in the future expires too: never kept for ever
                return None
            seen = (last.time, mono + self.grace - max(0.0, age))
        return seen if mono < seen[1] else None

    def _attribute_jobs(self, owners: dict[Owner, _Ranks], out: SpoolRead) -> None:
        """One owner per job id: a second one's samples under it are refused, so a user who names another
        job's id cannot replace that job's series (two label sets would be one)."""
        claims: dict[str, dict[Owner, float]] = {}
        for o, r in owners.items():
            for job, since in r.claimed.items():
                claims.setdefault(job, {})[o] = since
        attributed: dict[str, Owner] = {}
        for job, by in claims.items():
            holder = self._owner_of.get(job, -2)
            if holder not in by:  # nobody held it, or its holder is gone: the earliest claim
                holder = min(by, key=lambda o: (by[o], -1 if o is None else o))
            attributed[job] = holder
            for o in by:
                if o == holder:
                    continue
                r = owners[o]
                why = f"publishes under job_id {job!r}, which uid {holder}'s ranks publish under here"
                for key in [k for k in r.live if k[0] == job]:
                    out.refused.append(node.Refused(r.live.pop(key)[1], why))
                out.refused += [node.Refused(e, why) for s, e in r.dead if s.job_id == job]
                r.dead = [x for x in r.dead if x[0].job_id != job]
        self._owner_of = attributed


def _claim(mine: _Ranks, job: str, since: float) -> None:
    if job not in mine.claimed or since < mine.claimed[job]:
        mine.claimed[job] = since


def _shares(demands: dict[Owner, int], budget: int) -> dict[Owner, int]:
    """Max-min fair shares of ``budget``: the smallest demands are met first, each up to an equal share of
    what is left, so an owner asking for everything gets only what the others leave."""
    out: dict[Owner, int] = {}
    left = budget
    order = sorted(demands, key=lambda o: (demands[o], -1 if o is None else o))
    for i, o in enumerate(order):
        out[o] = min(demands[o], left // (len(order) - i))
        left -= out[o]
    return out


_Entry = tuple[RankSample, str]  # a sample and its entry (path) in the spool


def _fair(wanted: dict[Owner, list[_Entry]], max_ranks: int) -> tuple[list[_Entry], list[_Entry]]:
    """(kept, cut) of each owner's samples, given in its order of preference: at most ``max_ranks`` ranks
    and ``max_ranks * SERIES_PER_RANK`` series, each shared fairly among the owners."""
    wanted = {o: v for o, v in wanted.items() if v}
    ranks = _shares({o: len(v) for o, v in wanted.items()}, max_ranks)
    heads = {o: v[: ranks[o]] for o, v in wanted.items()}
    cost = {o: [limits.series(s) for s, _ in v] for o, v in heads.items()}
    series = _shares({o: sum(c) for o, c in cost.items()}, max_ranks * limits.SERIES_PER_RANK)
    kept: list[_Entry] = []
    cut: list[_Entry] = []
    for o, v in wanted.items():
        n, total = 0, 0
        while n < len(heads[o]) and total + cost[o][n] <= series[o]:
            total += cost[o][n]
            n += 1
        kept += v[:n]
        cut += v[n:]
    return kept, cut


_READERS: dict[tuple[str, int, float], SpoolReader] = {}  # the process's readers of the clock's time
_READERS_LOCK = threading.Lock()


def read_spool(spool_dir: str, max_ranks: int, grace: float, now: float | None = None, reap: bool = True) -> SpoolRead:
    """One read of the spool. At a given ``now``, by a reader that has seen nothing before; at the clock's
    time, by this process's reader of that spool, which remembers the final samples' windows on the monotonic
    clock (a rank-started server's idle loop reads every second: a wall step must not end its windows)."""
    if now is not None:
        return SpoolReader(spool_dir, max_ranks, grace).read(now, reap=reap)
    key = (spool_dir, max_ranks, grace)
    with _READERS_LOCK:
        reader = _READERS.get(key)
        if reader is None:
            if len(_READERS) >= 8:  # a process reads one spool or two: bounded all the same
                _READERS.pop(next(iter(_READERS)))
            reader = _READERS[key] = SpoolReader(spool_dir, max_ranks, grace)
        return reader.read(reap=reap)


def _evict(spool_dir: str, victims: set[str]) -> None:
    """Remove the final samples the cap dropped, by entry (their directories are open again for it)."""
    try:
        dirs = node.open_dirs(spool_dir)
    except OSError:
        return  # the spool is gone: so are they
    for d in dirs:
        for entry in victims:
            folder, _, name = entry.rpartition("/")
            if folder == d.path:
                d.remove(name, files.lock_path_of(name), name + ".tmp")


def _reap_unpublished(d: node.SpoolDir, name: str) -> None:
    """A rank that died inside its first publish left a temporary file and its lock, and no sample:
    nothing to serve, so both go once the lock is free (a live rank mid-publish still holds it)."""
    lock = files.lock_path_of(name)
    if d.lock_free(lock):
        d.remove(name + ".tmp", lock)


def read_samples(spool_dir: str, max_ranks: int, reap: bool = True) -> list[RankSample]:
    """Live ranks' newest samples, one per rank (dead ranks' files removed when ``reap``)."""
    return read_spool(spool_dir, max_ranks, 0.0, reap=reap).live


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

"""The server's side of the spool: the live ranks' newest samples, dead ranks reaped."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from vramwatch.spool import files
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


def read_samples(
    spool_dir: str,
    max_ranks: int,
    reaped: list[RankSample] | None = None,
    reap: bool = True,
    rejected: list[Rejected] | None = None,
) -> list[RankSample]:
    """Live ranks' newest samples, one per rank; dead ranks' files are removed.

    A dead rank's final sample is appended to ``reaped`` when given, so the server can
    serve it once more (a rank killed by an OOM still gets its last OOM count scraped).
    Only the scrape path reaps; other readers pass ``reap=False`` and just skip the dead.
    Samples this reader cannot decode are skipped, and appended to ``rejected`` when given.
    """
    try:
        names = os.listdir(spool_dir)
    except OSError:
        return []
    best: dict[int, RankSample] = {}
    for name in names:
        m = files.RANK_FILE.match(name)
        if not m:
            continue
        path = os.path.join(spool_dir, name)
        lock = files.lock_path_of(path)
        if files.lock_is_free(lock):  # owner gone: reap
            if not reap:
                continue
            if reaped is not None:
                last = _read(path, name, None, tries=1)
                if last is not None:
                    reaped.append(last)
            files.remove_quietly(path, lock, path + ".tmp")
            continue
        sample = _read(path, name, rejected)
        if sample is None:
            continue
        rank = int(m.group(1))
        if rank not in best or sample.time > best[rank].time:
            best[rank] = sample
    return [best[r] for r in sorted(best)[:max_ranks]]


def _read(path: str, name: str, rejected: list[Rejected] | None, tries: int = 5) -> RankSample | None:
    for _ in range(tries):
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError:
            return None
        payload = files.unframe(raw)
        if payload is not None:
            try:
                return decode_sample(payload)
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

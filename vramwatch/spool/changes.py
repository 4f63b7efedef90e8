"""Whether the spool changed since a read, without decoding a sample: for a server that caches its render."""

from __future__ import annotations

import os

from vramwatch.spool import files

SpoolState = tuple[tuple[str, bytes | None, bool], ...]  # (file name, record header, alive)


def spool_state(spool_dir: str, headers: bool = True) -> SpoolState | None:
    """What names the ranks' samples now: each rank file with its record header (length + CRC32;
    None without ``headers``: then only which ranks are there) and whether its rank is alive (its
    lock held; a dead rank's file is its final sample, served for its grace window).

    Equal states mean equal samples (up to a CRC32 collision), so a reader may reuse what it decoded
    last time. None when only a read will do: an unreadable spool. A header rather than the file's
    mtime, which the kernel keeps at timer-tick granularity: two publishes of the same size within a
    tick would look unchanged.
    """
    try:
        names = os.listdir(spool_dir)
    except OSError:
        return None
    state = []
    for name in names:
        if not files.RANK_FILE.match(name):
            continue
        path = os.path.join(spool_dir, name)
        alive = not files.lock_is_free(files.lock_path_of(path))
        state.append((name, files.record_header(path) if headers else None, alive))
    state.sort()
    return tuple(state)

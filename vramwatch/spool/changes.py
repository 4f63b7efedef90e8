"""Whether the spool changed since a read, without decoding a sample: for a server that caches its render."""

from __future__ import annotations

from vramwatch.spool import files, node

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
    state = []
    try:
        for d in node.open_dirs(spool_dir):
            owner = "" if d.uid is None else f"{d.uid}/"  # the same name in two users' directories
            for name in d.names():
                if not files.RANK_FILE.match(name):
                    continue
                alive = not d.lock_free(files.lock_path_of(name))
                state.append((owner + name, d.read(name, files.HEADER_SIZE) if headers else None, alive))
    except OSError:
        return None
    state.sort()
    return tuple(state)

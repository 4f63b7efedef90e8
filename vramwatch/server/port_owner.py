"""Who holds a TCP port on this host: for the log line when ``bind`` finds it taken.

``/proc/net/tcp`` and ``tcp6`` are readable by every user and give each listening socket's
owner uid and inode; the owning process is found by matching that inode among ``/proc/*/fd``,
which works for our own processes (and for all as root). For another user's process the uid is
what we can tell.
"""

from __future__ import annotations

import os
import pwd

__all__ = ["PortOwner", "describe_port_owner", "port_owners"]

_LISTEN = "0A"


class PortOwner:
    def __init__(self, uid: int, inode: int, address: str) -> None:
        self.uid, self.inode, self.address = uid, inode, address
        self.pid: int | None = None
        self.comm: str | None = None

    def describe(self) -> str:
        try:
            user = f"uid {self.uid} ({pwd.getpwuid(self.uid).pw_name})"
        except KeyError:
            user = f"uid {self.uid}"
        if self.pid is not None:
            return f"{user}, pid {self.pid} ({self.comm or '?'}), listening on {self.address}"
        return f"{user}, listening on {self.address} (its process is not visible to uid {os.getuid()})"


def _address(hex_addr: str, v6: bool) -> str:
    ip, _, port = hex_addr.partition(":")
    raw = bytes.fromhex(ip)
    if v6:
        import socket

        # /proc writes each 32-bit word in host order
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        return f"[{socket.inet_ntop(socket.AF_INET6, words)}]:{int(port, 16)}"
    return f"{'.'.join(str(b) for b in raw[::-1])}:{int(port, 16)}"


def port_owners(port: int, proc: str = "/proc") -> list[PortOwner]:
    """Listening sockets on ``port`` (any address), with pid and command where this user may see them."""
    owners: dict[int, PortOwner] = {}
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(os.path.join(proc, "net", name), encoding="ascii") as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != _LISTEN or int(f[1].rpartition(":")[2], 16) != port:
                continue
            try:
                owners.setdefault(int(f[9]), PortOwner(int(f[7]), int(f[9]), _address(f[1], v6)))
            except ValueError:
                continue
    if owners:
        _find_processes(owners, proc)
    return list(owners.values())


def _find_processes(owners: dict[int, PortOwner], proc: str) -> None:
    wanted = {f"socket:[{inode}]": owner for inode, owner in owners.items()}
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return
    for pid in pids:
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # another user's process: not ours to look into
        for fd in fds:
            try:
                owner = wanted.get(os.readlink(os.path.join(fd_dir, fd)))
            except OSError:
                continue
            if owner is not None and owner.pid is None:
                owner.pid = int(pid)
                try:
                    with open(os.path.join(proc, pid, "comm"), encoding="utf-8", errors="replace") as fh:
                        owner.comm = fh.read().strip()
                except OSError:
                    pass


def describe_port_owner(port: int) -> str:
    """'held by uid 1001 (bob), pid 4242 (python3), listening on 0.0.0.0:9488', or why that is unknown."""
    try:
        owners = port_owners(port)
    except Exception as e:  # noqa: BLE001 - a diagnosis must never make the failure worse
        return f"its owner is unknown ({e})"
    if not owners:
        return "no listening socket on it is visible in /proc/net/tcp{,6}"
    return "held by " + "; ".join(o.describe() for o in owners)

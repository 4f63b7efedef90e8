"""A port another process holds: the server's log names the port and its owner (uid, pid, command)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from harness import free_port, vramwatch_env
from vramwatch.rank.server_spawn import last_error
from vramwatch.server.port_owner import describe_port_owner, port_owners


def test_a_listening_socket_of_ours_is_named_with_pid_and_command():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        text = describe_port_owner(port)
    assert f"uid {os.getuid()}" in text and f"pid {os.getpid()}" in text, text
    assert f"127.0.0.1:{port}" in text


def test_another_users_socket_is_named_by_uid_from_proc_net_tcp(tmp_path):
    # a /proc where the socket's process is out of sight (another user's): the uid still comes through
    (tmp_path / "net").mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    row = "   0: 0100007F:2508 00000000:0000 0A 00000000:00000000 00:00000000 00000000  4321        0 99999 1\n"
    (tmp_path / "net" / "tcp").write_text(header + row)
    (tmp_path / "net" / "tcp6").write_text(header)
    (tmp_path / "1234").mkdir()  # a process whose fd directory we may not read
    owners = port_owners(0x2508, proc=str(tmp_path))
    assert [(o.uid, o.inode, o.address, o.pid) for o in owners] == [(4321, 99999, "127.0.0.1:9480", None)]
    assert "uid 4321, listening on 127.0.0.1:9480 (its process is not visible" in owners[0].describe()


def test_serve_on_a_squatted_port_says_who_holds_it(tmp_path):
    port = free_port()
    squatter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import socket,time; s=socket.socket(); s.bind(('0.0.0.0',{port})); s.listen(); "
            "print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert squatter.stdout.readline() == b"up\n"
        spool = tmp_path / "spool"
        spool.mkdir()
        env = vramwatch_env(str(spool), port, simulate=True)
        r = subprocess.run([sys.executable, "-m", "vramwatch", "serve"], env=env, capture_output=True, timeout=60)
    finally:
        squatter.kill()
        squatter.wait()
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert f"port {port} is in use, held by uid {os.getuid()}" in err, err
    assert f"pid {squatter.pid} (python" in err and f"0.0.0.0:{port}" in err, err
    log = tmp_path / "server.log"
    log.write_bytes(r.stderr)
    assert f"pid {squatter.pid}" in last_error(str(log))  # what the rank's one line about it carries


def _v6_hex(address: str) -> str:
    """An IPv6 address as /proc/net/tcp6 writes it: each 32-bit word in host (little-endian) order."""
    raw = socket.inet_pton(socket.AF_INET6, address)
    return b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)).hex().upper()


def _row(local: str, state: str, uid: int | str, inode: int | str) -> str:
    return f"   0: {local} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000 {uid} 0 {inode} 1\n"


def test_a_proc_with_both_families_odd_lines_and_unreadable_entries(tmp_path, monkeypatch):
    """Each listening socket on the port, v4 and v6, with its process and command where they can be seen."""
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(
        header
        + "   garbage\n"  # a short line: skipped, the next ones still read
        + _row("0100007F:2508", "01", 4321, 7)  # an established connection on the port: not a listener
        + _row("0100007F:2509", "0A", 4321, 8)  # a listener on another port
        + _row("0100007F:2508", "0A", 4321, "x")  # an unreadable inode: skipped, the next ones still read
        + _row("0100007F:2508", "0A", 4321, 111)
    )
    (tmp_path / "net" / "tcp6").write_text(header + _row(f"{_v6_hex('2001:db8::1:2')}:2508", "0A", 4322, 222))
    for pid in ("100", "101"):
        (tmp_path / pid).mkdir()  # other users' processes: no fd directory to read
    fd = tmp_path / "500" / "fd"
    fd.mkdir(parents=True)
    (fd / "0").write_text("")  # not a link: readlink fails, the next descriptors are still read
    (fd / "1").symlink_to("pipe:[5]")
    (fd / "2").symlink_to("socket:[111]")
    (tmp_path / "500" / "comm").write_bytes(b"py\xfftrainer\n")  # comm is bytes: an undecodable one is replaced
    (tmp_path / "600" / "fd").mkdir(parents=True)
    (tmp_path / "600" / "fd" / "3").symlink_to("socket:[222]")  # no comm file: "?"
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: sorted(real(p)))  # the unreadable ones first
    owners = port_owners(0x2508, proc=str(tmp_path))
    assert [o.describe() for o in owners] == [
        "uid 4321, pid 500 (py\ufffdtrainer), listening on 127.0.0.1:9480",
        "uid 4322, pid 600 (?), listening on [2001:db8::1:2]:9480",
    ]
    (tmp_path / "net" / "tcp").unlink()  # no IPv4 table: the IPv6 one is still read
    assert [o.address for o in port_owners(0x2508, proc=str(tmp_path))] == ["[2001:db8::1:2]:9480"]


def test_the_log_line_joins_every_owner_or_says_none_is_visible(monkeypatch):
    from vramwatch.server import port_owner

    a, b = port_owner.PortOwner(4321, 1, "127.0.0.1:9480"), port_owner.PortOwner(4322, 2, "[::]:9480")
    a.pid, a.comm = 500, "python3"
    monkeypatch.setattr(port_owner, "port_owners", lambda port: [a, b])
    assert describe_port_owner(9480) == (
        f"held by uid 4321, pid 500 (python3), listening on 127.0.0.1:9480; "
        f"uid 4322, listening on [::]:9480 (its process is not visible to uid {os.getuid()})"
    )
    monkeypatch.setattr(port_owner, "port_owners", lambda port: [])
    assert describe_port_owner(9480) == "no listening socket on it is visible in /proc/net/tcp{,6}"

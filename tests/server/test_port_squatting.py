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

"""`python -m vramwatch ARGS`, each run a process forked from one that has imported the command's modules.

A test that runs a command many times (`vramwatch report`: ~1.4 s of CPU to import matplotlib and the
report, ~0.5 s to draw a dashboard) pays the imports once. Each run is still a process of its own, with its
own stdout, stderr, logging set-up and exit status, as from `subprocess.run`; only the start-up is shared.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# The forking process: imports what argv names, then one JSON request a line on stdin -> a child runs
# vramwatch's main() on the request's arguments with fds 1 and 2 on the request's files -> one line back,
# the child's exit status.
_FORKER = r"""
import importlib, json, os, sys, traceback
for name in sys.argv[1:]:
    importlib.import_module(name)
from vramwatch.cli import main
reply = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            sys.argv = ["vramwatch", *req["args"]]
            try:
                rc = main(req["args"]) or 0
            except SystemExit as e:  # argparse's exit 2, and sys.exit() anywhere
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()  # as an uncaught exception in `python -m vramwatch` (exit 1)
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(rc)
    status = os.waitpid(pid, 0)[1]
    reply.write(json.dumps(os.waitstatus_to_exitcode(status)) + "\n")
    reply.flush()
"""


class ForkedCLI:
    """One forking process for a test module's runs; `run` answers like `subprocess.run(capture_output=True,
    text=True)`."""

    def __init__(self, preload: list[str], cwd: Path) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _FORKER, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=cwd,
            text=True,
            start_new_session=True,  # its children share its process group: close() ends a run still going too
        )
        self._dir = tempfile.TemporaryDirectory(prefix="vw-forked-")
        self._runs = 0

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def run(self, args: list[str], timeout: float) -> subprocess.CompletedProcess:
        assert self._proc.stdin and self._proc.stdout
        self._runs += 1
        out, err = (Path(self._dir.name) / f"{self._runs}.{name}" for name in ("out", "err"))
        self._proc.stdin.write(json.dumps({"args": args, "stdout": str(out), "stderr": str(err)}) + "\n")
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:  # ended with its run: the next test's run gets a new forker, not this one's pipe
            self.close()
            raise subprocess.TimeoutExpired(["vramwatch", *args], timeout)
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the forking process ended (exit {self._proc.wait()}) before answering {args}")
        return subprocess.CompletedProcess(
            ["vramwatch", *args], json.loads(line), out.read_text(errors="replace"), err.read_text(errors="replace")
        )

    def close(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        self._dir.cleanup()

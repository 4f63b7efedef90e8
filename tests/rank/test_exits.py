"""How a rank ended, in its final sample: real processes ended each way, their spool read as the server reads it.

Each child starts vramwatch with a sampling interval far longer than the test, so anything past the first
sample reaches the spool only through the exit hooks (a clean exit without ``stop()`` publishing its last
interval: issue 45.2), then ends as the case says.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from harness import child_env
from vramwatch.server.collectors import ScrapeContext
from vramwatch.server.collectors.ranks import families
from vramwatch.spool import read_spool

# SIGINT as a job started from a terminal has it: a suite started in the background (`make test &`) passes
# its children SIGINT ignored, which vramwatch rightly leaves alone, and the SIGINT case would then sleep on
PRELUDE = """
import os, signal, sys, time, threading
signal.signal(signal.SIGINT, signal.default_int_handler)
import vramwatch
vramwatch.start(spool_dir=sys.argv[1], serve="external", simulate=True, interval=600, rank=0)
for _ in range(7):
    vramwatch.step()
"""

CASES = {
    "clean_exit_without_stop": ("pass", ("finished", ""), 0),
    "stop": ("vramwatch.stop()", ("finished", ""), 0),
    "exception": ("class InjectedFault(Exception): pass\nraise InjectedFault('x')", ("exception", "InjectedFault"), 1),
    "exception_with_the_jobs_own_hook": (
        "sys.excepthook = lambda *a: print('the job hook ran', file=sys.stderr)\n"
        "import vramwatch.rank.exits as e; e._installed = False; e.install()\n"
        "raise KeyError('x')",
        ("exception", "KeyError"),
        1,
    ),
    "oom": ("class OutOfMemoryError(RuntimeError): pass\nraise OutOfMemoryError('x')", ("oom", "OutOfMemoryError"), 1),
    "long_class_name": ("raise type('E' * 80, (Exception,), {})()", ("exception", "other"), 1),
    "sigterm": ("os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)", ("signal", "SIGTERM"), -signal.SIGTERM),
    "sigint": ("os.kill(os.getpid(), signal.SIGINT); time.sleep(30)", ("signal", "SIGINT"), -signal.SIGINT),
    "training_thread_dies": (
        "def train():\n    vramwatch.step()\n    raise ValueError('x')\n"
        "vramwatch.current().heartbeat.thread_id = 0\n"
        "t = threading.Thread(target=train); vramwatch.current().heartbeat._last_mono = None\n"
        "t.start(); t.join()",
        ("exception", "ValueError"),
        0,
    ),
    "sigkill": ("os.kill(os.getpid(), signal.SIGKILL)", None, -signal.SIGKILL),
    "os_exit": ("os._exit(3)", None, 3),
}


def _run(tmp_path, body: str) -> tuple[subprocess.CompletedProcess, str]:
    spool = str(tmp_path / "spool")
    code = PRELUDE + textwrap.dedent(body) + "\n"
    p = subprocess.run(
        [sys.executable, "-c", code, spool], env=child_env(), capture_output=True, text=True, timeout=120
    )
    return p, spool


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_final_sample_says_how_the_rank_ended(tmp_path, case):
    body, want, rc = CASES[case]
    p, spool = _run(tmp_path, body)
    assert p.returncode == rc, p.stderr[-2000:]
    read = read_spool(spool, 16, 600.0, reap=False)
    assert not read.live and len(read.final) == 1, read
    final = read.final[0]
    t = final.training
    got = (t.exit_reason, t.exit_detail) if t is not None and t.exit_reason else None
    assert got == want
    if want is not None:
        # published at the end: the steps after the first sample are in it (the interval is 600 s)
        assert final.heartbeat.steps >= 7
    # what the server exports for it
    fams = {f.name: f for f in families(ScrapeContext((), time.time(), "h", final=tuple(read.final)))}
    exits = [(s.labels["reason"], s.labels["detail"]) for s in fams["vramwatch_rank_exits"].samples]
    assert exits == [want or ("killed", "")]
    if case == "exception_with_the_jobs_own_hook":
        assert "the job hook ran" in p.stderr  # chained, not replaced
    if case == "exception":
        assert "InjectedFault" in p.stderr  # Python's own report still printed


def test_a_signal_the_job_handles_and_trains_on_is_not_its_end(tmp_path):
    body = """
    signal.signal(signal.SIGTERM, lambda *a: None)  # the job's own handler (installed after start)
    import vramwatch.rank.exits as e
    e._installed = False; e.install()  # ours chains to it
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    vramwatch.step()
    """
    p, spool = _run(tmp_path, body)
    assert p.returncode == 0, p.stderr[-2000:]
    final = read_spool(spool, 16, 600.0, reap=False).final[0]
    assert (final.training.exit_reason, final.training.exit_detail) == ("finished", "")


def test_an_ignored_signal_stays_ignored(tmp_path):
    body = """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import vramwatch.rank.exits as e
    e._installed = False; e.install()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    """
    p, spool = _run(tmp_path, body)
    assert p.returncode == 0, p.stderr[-2000:]
    final = read_spool(spool, 16, 600.0, reap=False).final[0]
    assert final.training.exit_reason == "finished"

"""``vramwatch demo``: a short training job with the exporter attached.

On a machine with a CUDA GPU it trains a small MLP there; otherwise it runs
the simulated GPU's scenario with several ranks, all served by one target.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import FrameType
from typing import NoReturn

from vramwatch.config import Settings
from vramwatch.sim.state import SimNode, edit, state_path
from vramwatch.spool.files import NODE_READINGS, RANK_FILE, lock_path_of, remove_quietly

_RANK_START_SECONDS = 3.0


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def use_real_gpu(choice: str) -> bool:
    """``--real auto|yes|no``: whether the demo trains on a CUDA GPU (it decides the settings)."""
    return choice == "yes" or (choice == "auto" and _has_cuda())


def _sigterm_as_interrupt() -> None:
    # SIGTERM (a supervisor, `kill`) ends the demo like Ctrl-C: ranks stopped, nothing orphaned
    def handler(signum: int, frame: FrameType | None) -> NoReturn:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run_demo(settings: Settings, *, real: bool, ranks: int, duration: float, cycle: float = 0.0) -> int:
    """Train for ``duration`` seconds (0: until interrupted) on the GPU or ``ranks`` simulated ones.

    ``cycle``: seconds of one turn of the simulated story (0: its own two minutes).
    """
    _sigterm_as_interrupt()
    end = time.time() + duration if duration > 0 else float("inf")
    url = f"http://{settings.host if settings.host != '0.0.0.0' else '127.0.0.1'}:{settings.port}/metrics"
    if real:
        return _real(settings, end, url)
    return _simulated(settings, ranks, end, url, cycle)


def _real(settings: Settings, end: float, url: str) -> int:
    import torch

    import vramwatch

    vramwatch.start(**{k: getattr(settings, k) for k in ("port", "host", "interval")})
    print(f"vramwatch demo: training an MLP on {torch.cuda.get_device_name(0)}; scrape {url}", flush=True)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, 4096, device="cuda")
    step = 0
    try:
        while time.time() < end:
            loss = model(x).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            vramwatch.step(loss=loss.detach())
            if step % 500 == 0:
                print(f"step {step}", flush=True)
    except KeyboardInterrupt:
        pass
    vramwatch.stop()
    return 0


def _simulated(settings: Settings, ranks: int, end: float, url: str, cycle: float) -> int:
    from vramwatch.sim.scenario import CYCLE, EVENTS, PHASES, drive_node

    cycle = cycle or CYCLE
    scale = cycle / CYCLE

    spool_dir = settings.resolved_spool_dir()
    os.makedirs(spool_dir, mode=0o700, exist_ok=True)
    node = SimNode.default(ranks)
    node.drive_by(os.getpid())  # a server started after this demo reads it as stale, not as current
    node.save(state_path(spool_dir))
    # the story's clock starts once the ranks are up (importing takes a second or two), so that the first
    # cycle is whole; until then the ranks idle as at the end of a cycle
    t0 = time.time() + _RANK_START_SECONDS
    env = dict(os.environ)
    env.update(settings.to_env())
    env["VRAMWATCH_SIMULATE"] = "true"
    env["WORLD_SIZE"] = str(ranks)
    procs = []
    for r in range(ranks):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r), CUDA_VISIBLE_DEVICES=str(r))
        cmd = [sys.executable, "-m", "vramwatch.sim.scenario", "--t0", str(t0), "--parent", str(os.getpid())]
        cmd += ["--cycle", str(cycle)]
        if r == ranks - 1:
            cmd.append("--stall")
        procs.append(subprocess.Popen(cmd, env=e))
    phases = ", ".join(f"{n} at {s * scale:.0f}s" for s, n in PHASES)
    events = ", ".join(f"{name} at {a * scale:.0f}s" for name, (a, _b) in EVENTS.items())
    print(f"vramwatch demo: {ranks} simulated ranks on {ranks} simulated GPUs, one target: {url}", flush=True)
    print(f"  scenario ({cycle:.0f}s cycle, repeating): {phases}; the last rank stalls", flush=True)
    print(f"  on the GPUs: {events}", flush=True)
    print("  Ctrl-C to stop" + (f", or it ends in {end - t0:.0f}s" if end != float("inf") else ""), flush=True)
    stalled = {ranks - 1}
    prev: float | None = None
    try:
        while time.time() < end and all(p.poll() is None for p in procs):
            t = time.time() - t0
            with edit(spool_dir, ranks) as current:  # reload: others may inject Xids or errors meanwhile
                drive_node(current, t, stalled, prev, cycle)
            prev = t
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        _leave_nothing(spool_dir, settings, {p.pid for p in procs})
    print("vramwatch demo: done", flush=True)
    return 0


def _leave_nothing(spool_dir: str, settings: Settings, rank_pids: set[int]) -> None:
    """The demo's end frees its port at once (the server its ranks started would stay for its grace and
    linger, ~100 s) and removes what a later run would read: its ranks' final samples (served for their
    grace), its simulated node's state and readings. A server that serves other ranks stays."""
    from vramwatch.rank.server_spawn import stop_idle_server

    stopped = stop_idle_server(spool_dir, settings)
    if not stopped:
        print(f"vramwatch demo: the server of {spool_dir} serves other ranks and stays", flush=True)
    for name in os.listdir(spool_dir):
        m = RANK_FILE.match(name)
        if stopped and m and int(m.group(2)) in rank_pids:
            sample = os.path.join(spool_dir, name)
            remove_quietly(sample, lock_path_of(sample))
    path = state_path(spool_dir)
    try:
        if SimNode.read(path).driver.get("pid") != os.getpid():
            return  # another driver's now
        os.remove(path)
    except (OSError, ValueError, TypeError, KeyError):
        return
    if stopped:  # the simulated GPUs' readings and identities, which a later real server would take up
        remove_quietly(os.path.join(spool_dir, NODE_READINGS))

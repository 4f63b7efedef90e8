"""A simulated rank: a training-shaped loop on the simulated GPU, for tests and the demo.

    python -m vramwatch.sim.worker --duration 30 --steps-per-second 20 --fill-gib 40

Settings come from VRAMWATCH_* like any job (VRAMWATCH_SIMULATE=true is implied).
``--wedge-after S --wedge-seconds W`` blocks the main thread for W seconds while
holding the GIL (libc ``sleep`` through ``ctypes.PyDLL``), as a rank wedged in a
C extension would.
``--control FILE`` lets a test drive the rank while it runs: the JSON file is
re-read when it changes; ``{"fill_ratio": 0.97}`` makes the rank hold that share
of its memory budget (allocated and reserved: the cache is emptied first),
``{"stall": true}`` stops its steps (the process and its sampler stay alive).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import vramwatch

GIB = 1 << 30


def wedge_holding_gil(seconds: int) -> None:
    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
    libc.sleep(ctypes.c_uint(seconds))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vramwatch-sim-worker")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--steps-per-second", type=float, default=20.0)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--fill-gib", type=float, default=8.0, help="allocated bytes to hold in steady state")
    p.add_argument("--activation-gib", type=float, default=1.0, help="allocated and freed every step")
    p.add_argument("--wedge-after", type=float, default=-1.0)
    p.add_argument("--wedge-seconds", type=int, default=20)
    p.add_argument("--control", default="", help="JSON file driving the rank: fill_ratio, stall")
    args = p.parse_args(argv)

    handle = vramwatch.start(simulate=True)
    sim = handle.sim
    assert sim is not None
    sim.init(args.device)
    sim.allocate(int(args.fill_gib * GIB), args.device)
    period = 1.0 / args.steps_per_second
    t0 = time.monotonic()
    wedged = False
    step = 0
    control = _Control(args.control)
    while time.monotonic() - t0 < args.duration:
        ctl = control.changed()
        if ctl is not None and ctl.get("fill_ratio") is not None:
            sim.free(sim.allocated(args.device), args.device)
            sim.empty_cache(args.device)
            sim.allocate(int(float(ctl["fill_ratio"]) * sim.limit_bytes(args.device)), args.device)
        if control.state.get("stall"):
            time.sleep(period)
            continue
        act = int(args.activation_gib * GIB)
        if act:
            sim.allocate(act, args.device)
            sim.free(act, args.device)
        step += 1
        vramwatch.step(loss=2.0 / (1 + 0.01 * step))
        if not wedged and args.wedge_after >= 0 and time.monotonic() - t0 >= args.wedge_after:
            wedged = True
            wedge_holding_gil(args.wedge_seconds)
        time.sleep(period)
    vramwatch.stop()
    return 0


class _Control:
    """The --control file: re-read when it changes (write it with os.replace: a new inode each time)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.mtime: tuple[int, int] = (0, 0)
        self.state: dict = {}

    def changed(self) -> dict | None:
        if not self.path:
            return None
        try:
            st = os.stat(self.path)
            mtime = (st.st_ino, st.st_mtime_ns)
            if mtime == self.mtime:
                return None
            with open(self.path, encoding="utf-8") as fh:
                state = json.load(fh)
        except (OSError, ValueError):
            return None
        self.mtime, self.state = mtime, state
        return state


if __name__ == "__main__":
    os.environ.setdefault("VRAMWATCH_SIMULATE", "true")
    raise SystemExit(main())

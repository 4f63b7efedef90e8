"""N calls of one part of a simulated rank's sample (no torch), each after a cache sweep, for valgrind.

    SWEEP_KB=512 MODE=tick valgrind --tool=cachegrind ... python vg_tick.py 200

MODE: tick, none (the same steps and sweeps, nothing called), assemble, read, stats, heartbeat, encode,
publish. The role walk and the largest-free-block snapshot are put off for a day: they run every 30 s.
"""

import os
import sys
import tempfile

import vramwatch
from vramwatch.sim.model import SimAdam, SimModel
from vramwatch.spool.codec import encode_sample

N = int(sys.argv[1])
SWEEP = int(os.environ.get("SWEEP_KB", "0"))
MODE = os.environ.get("MODE", "tick")

spool = tempfile.mkdtemp(prefix="vw-vg-")
h = vramwatch.start(
    simulate=True,
    serve="external",
    spool_dir=spool,
    interval=3600.0,
    port=1,
    role_interval=86400.0,
    largest_block_interval=86400.0,
)
h.sim.init(0)
h.sim.allocate(3 << 30)
h.sim.free(1 << 30)
model = SimModel(1 << 30, layers=150)
opt = SimAdam(model)
vramwatch.watch(model, opt, flops_per_token=6e9)
for _ in range(3):
    vramwatch.step(loss=1.25, tokens=256)
    h.tick()
buf = bytearray(SWEEP << 10)
sample = h._assembler.assemble()
fns = {
    "tick": h.tick,
    "none": lambda: None,
    "assemble": h._assembler.assemble,
    "stats": lambda: h.source.stats(0),
    "read": h.sampler.read,
    "encode": lambda: encode_sample(sample),
    "publish": lambda: h._publisher.publish(sample),
    "heartbeat": h.heartbeat.snapshot,
}
fn = fns[MODE]
for i in range(N):
    vramwatch.step(loss=1.25 + i, tokens=256)
    if SWEEP:
        bytes(buf)
    fn()
vramwatch.stop()

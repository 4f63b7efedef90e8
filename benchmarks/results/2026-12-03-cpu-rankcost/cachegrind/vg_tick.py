"""N ticks of a simulated rank (no torch), each after a cache sweep if SWEEP_KB>0, for valgrind A/B."""
import os, sys, tempfile
N = int(sys.argv[1]); SWEEP = int(os.environ.get("SWEEP_KB", "0")); DO_TICK = os.environ.get("TICK", "1") == "1"
import vramwatch
from vramwatch.sim.model import SimAdam, SimModel
spool = tempfile.mkdtemp(prefix="vw-vg-")
h = vramwatch.start(simulate=True, serve="external", spool_dir=spool, interval=3600.0, port=1,
                    role_interval=86400.0, largest_block_interval=86400.0)
h.sim.init(0); h.sim.allocate(3 << 30); h.sim.free(1 << 30)
model = SimModel(1 << 30, layers=150); opt = SimAdam(model)
vramwatch.watch(model, opt, flops_per_token=6e9)
for _ in range(3):
    vramwatch.step(loss=1.25, tokens=256); h.tick()
buf = bytearray(SWEEP << 10)
MODE = os.environ.get("MODE", "tick" if DO_TICK else "none")
from vramwatch.spool.codec import encode_sample
sample = h._assembler.assemble()
fns = {"tick": h.tick, "none": lambda: None, "assemble": h._assembler.assemble, "stats": lambda: h.source.stats(0),
       "read": h.sampler.read, "encode": lambda: encode_sample(sample), "publish": lambda: h._publisher.publish(sample),
       "heartbeat": h.heartbeat.snapshot}
fn = fns[MODE]
for i in range(N):
    vramwatch.step(loss=1.25 + i, tokens=256)
    if SWEEP: bytes(buf)
    fn()
vramwatch.stop()

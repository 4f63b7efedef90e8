"""A short, eventful run on the simulated GPU under a real Prometheus, for the dashboard and report tests.

Two ranks on two simulated GPUs of one node. Within ~15 seconds: rank 0 leaks a little every step,
fragments its cache, hits a caught OOM (a cudaMalloc retry with it), then stalls while GPU 0 reads
busy at low power (the hang signature); GPU 1 gets a foreign process, a throttle reason, a corrected
ECC error; GPU 0 an Xid 13. Prometheus scrapes every second and evaluates one always-firing rule and the shipped
rules' recorded series, so that every panel of every dashboard has something to show.

Run as a script it is one simulated rank (the test starts two).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1 << 30
XID = 13  # pre-initialised (MonitoringConfig.xid_warning), so increase() counts the first one
RULE = """groups:
- name: dashboards-live-test
  rules:
  - alert: DashboardLiveTestAlwaysFiring
    expr: vramwatch_build_info > 0
    labels: {severity: warning}
    annotations: {summary: fires so the firing-alerts panels have a row}
"""

# the target labels a Kubernetes PodMonitor adds (namespace, node, the pod's job-name label), so the
# dashboards' variables for them have values; the other job-name labels stay absent, as in a real cluster
TARGET_LABELS = {"namespace": "ml-research", "node": "gpu-node-a", "batch_kubernetes_io_job_name": "llama-ft"}

# what must have data before the scenario counts as played out
WAIT_FOR = (
    "count(torch_cuda_memory_allocated_bytes) == 2",
    "gpu_last_xid_timestamp_seconds",
    "torch_cuda_memory_ooms_total > 0",
    "torch_cuda_memory_largest_free_block_bytes",
    'ALERTS{alertstate="firing"}',
    "gpu_foreign_processes > 0",
    "gpu_ecc_errors_total > 0",
    "gpu_sm_activity_ratio > 0",
    'time() - vramwatch_training_last_step_timestamp_seconds{rank="0"} > 3',
)  # rank 0 has stalled


@dataclass
class Live:
    exporter: object
    prometheus: object
    t0: float  # wall clock when the ranks started
    ranks: list = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


def _drive(exp, t0: float, stop: threading.Event, stall_at: float) -> None:
    from vramwatch.sim.state import edit

    done: set[str] = set()
    while not stop.is_set():
        t = time.time() - t0
        with edit(exp.spool, 2) as node:
            for g in node.gpus:
                wobble = 0.03 * math.sin(t + g.index)
                g.utilization = min(1.0, 0.93 + wobble)
                g.power_w = 520.0 + 80.0 * wobble
                if g.index == 0 and t >= stall_at:  # busy-looking stall: pinned, power falling
                    g.utilization = 1.0
                    g.power_w = max(110.0, 520.0 - 90.0 * (t - stall_at))
                g.memory_utilization = 0.6 * g.utilization
                # GPM: a matmul-heavy step (tensor work near SM activity, DRAM well below its ceiling)
                g.sm_activity, g.sm_occupancy = 0.85 * g.utilization, 0.45 * g.utilization
                g.tensor_activity, g.dram_bandwidth_utilization = 0.7 * g.utilization, 0.35 * g.utilization
                g.pcie_rx_bytes_per_second, g.nvlink_tx_bytes_per_second = 2e9 + 1e8 * wobble, 1.2e11
                g.temperature_c = min(80.0, 45.0 + 2.0 * t + 3 * g.index)
                g.tick(0.5)
            if t >= 2 and "foreign" not in done:
                node.add_foreign(1, pid=4242, used_bytes=6 * GIB)
                done.add("foreign")
            if t >= 3 and "xid" not in done:
                node.inject_xid(0, XID)
                done.add("xid")
            if t >= 4:
                node.gpu(1).throttle_mask = 0x4  # SW power cap
            if t >= 5 and "ecc" not in done:
                node.gpu(1).ecc_corrected += 1
                done.add("ecc")
        stop.wait(0.5)


def _recording_rules(tmp: Path) -> Path:
    """The shipped rules' recorded series (the dashboards read some of them), without their alerts."""
    from vramwatch.monitoring.alerts.render import to_yaml
    from vramwatch.monitoring.alerts.rules import groups

    path = tmp / "records.yml"
    records = [{**g, "rules": [r for r in g["rules"] if "record" in r]} for g in groups()]
    path.write_text(to_yaml({"groups": [g for g in records if g["rules"]]}))
    return path


def start(tmp: Path, duration: float = 14.0, wait_for: tuple[str, ...] | None = None, **settings) -> Live:
    """Start the node, the ranks and Prometheus; returns once every family has data (about duration s).

    ``settings`` go to the exporter (``nvml=False``: a node without NVML); ``wait_for`` replaces
    the queries that must have data before the scenario counts as played out.
    """
    from harness import Exporter, Prometheus, vramwatch_env, wait_until

    exp = Exporter(tmp / "exp", gpus=2, **{"nvml_slow_interval": 1.0, **settings}).start()
    rules = tmp / "rules.yml"
    rules.write_text(RULE)
    target = {"targets": [f"127.0.0.1:{exp.port}"], "labels": TARGET_LABELS}
    rule_files = [str(rules), str(_recording_rules(tmp))]
    prom = Prometheus(tmp, rule_files=rule_files, extra_scrape={"static_configs": [target]}).start()
    # Prometheus applies discovered targets after ~5 s: start the story once it scrapes, so that
    # every counter has samples from before its first event (increase() needs them)
    prom.wait_for("up == 1", timeout=30)
    t0 = time.time()
    live = Live(exp, prom, t0)
    stall_at = duration * 0.6
    threading.Thread(target=_drive, args=(exp, t0, live.stop, stall_at), daemon=True).start()
    for rank, extra in (
        (0, ["--leak-mib", "64", "--fragment-at", "2", "--oom-at", "3.5", "--stall-at", str(stall_at)]),
        (1, ["--fill-gib", "96"]),
    ):
        env = vramwatch_env(
            exp.spool,
            exp.port,
            simulate=True,
            serve="external",
            interval=0.25,
            largest_block_interval=1.0,
            job_id=TARGET_LABELS["batch_kubernetes_io_job_name"],  # as the Kubernetes recipe passes the Job's name
        )
        env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": str(rank)})
        live.ranks.append(
            subprocess.Popen(
                [sys.executable, __file__, "--duration", str(duration + 120), *extra],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=exp.log,
                stderr=exp.log,
            )
        )
    try:
        for expr in WAIT_FOR if wait_for is None else wait_for:
            prom.wait_for(expr, timeout=duration + 30)
        wait_until(lambda: time.time() - t0 >= duration, duration + 30, "the scenario to play out")
    except BaseException:
        stop(live)
        raise
    return live


def stop(live: Live) -> None:
    from harness import stop_proc

    live.stop.set()
    for p in live.ranks:
        stop_proc(p)
    live.prometheus.stop()
    live.exporter.stop()


def rank_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--fill-gib", type=float, default=48.0)
    ap.add_argument("--leak-mib", type=float, default=0.0, help="kept every step")
    ap.add_argument("--fragment-at", type=float, default=-1.0)
    ap.add_argument("--oom-at", type=float, default=-1.0)
    ap.add_argument("--stall-at", type=float, default=-1.0)
    a = ap.parse_args(argv)

    import vramwatch
    from vramwatch.sim.allocator import SimOutOfMemoryError
    from vramwatch.sim.model import SimAdam, SimModel

    sim = vramwatch.start(simulate=True).sim
    sim.init(0)
    sim.allocate(int(a.fill_gib * GIB))
    model = SimModel(int(a.fill_gib * GIB / 10))  # memory by role, the MFU: a watched model
    optimizer = SimAdam(model)
    vramwatch.watch(model, optimizer, flops_per_token=6.0 * model.param_count)
    t0 = time.monotonic()
    fragmented = oomed = False
    step = 0
    while (t := time.monotonic() - t0) < a.duration:
        if 0 <= a.stall_at <= t:
            time.sleep(0.1)  # no steps: the heartbeat ages while the sampler keeps publishing
            continue
        act = GIB
        sim.allocate(act)
        sim.free(act)
        if a.leak_mib:
            sim.allocate(int(a.leak_mib * (1 << 20)))
        if not fragmented and 0 <= a.fragment_at <= t:
            sim.fragment(3 * GIB)
            fragmented = True
        if not oomed and 0 <= a.oom_at <= t:
            try:
                sim.allocate(sim.limit_bytes(0))  # a request larger than the budget: retry, then OOM
            except SimOutOfMemoryError:
                pass
            oomed = True
        step += 1
        vramwatch.step(loss=2.0 / (1 + 0.01 * step), tokens=4096, samples=2)
        time.sleep(0.05 * (1.5 if step % 7 == 0 else 1.0))
    vramwatch.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VRAMWATCH_SIMULATE", "true")
    raise SystemExit(rank_main())

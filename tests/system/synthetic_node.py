"""A synthetic vramwatch target on loopback: the exposition a node's server would serve for its GPUs and
the ranks on them, computed at each scrape from a small model the test drives.

It stands in where the simulated ranks cannot yet produce a family (the rank side's exit reasons and
collective counts land in another branch) and where a test needs 16 ranks on 2 nodes, which 16 simulated
rank processes on a 2-core CI machine could not keep stepping in time. Everything downstream is real:
Prometheus scrapes it with the shipped rules, and Alertmanager routes with the shipped config.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Gpu:
    index: int
    uuid: str
    utilization: float = 0.95
    power_w: float = 550.0
    power_limit_w: float = 700.0
    up: bool = True
    xids: dict[tuple[int, str], float] = field(default_factory=dict)  # (xid, action) -> count
    last_xid: dict[tuple[int, str], float] = field(default_factory=dict)


@dataclass
class Rank:
    rank: int
    local_rank: int
    job_id: str
    world_size: int
    gpu: Gpu
    steps_per_second: float = 10.0
    started: float = field(default_factory=time.time)
    stopped: float | None = None  # when its steps stopped (a hang), None while it steps
    collectives_per_step: int = 4
    collective_offset: int = 0  # the ranks that reached the next collective: +1; the one behind: 0
    exit: tuple[str, str] | None = None  # (reason, detail): its final sample, served for the grace window
    served: bool = True  # False: its series are gone (grace window over, or never there)

    def progress(self, now: float) -> tuple[float, float]:
        """(steps, time of the newest step)"""
        end = now if self.stopped is None else min(now, self.stopped)
        steps = int((end - self.started) * self.steps_per_second)
        return steps, self.started + steps / self.steps_per_second


def _labels(**kv: Any) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in kv.items()) + "}"


class Node:
    """One target: its GPUs and ranks. ``down`` answers scrapes with HTTP 500 (Prometheus: up 0)."""

    def __init__(self, hostname: str, gpus: int, mode: str = "node") -> None:
        self.hostname = hostname
        self.mode = mode
        self.gpus = [Gpu(i, f"GPU-{hostname}-{i}") for i in range(gpus)]
        self.ranks: list[Rank] = []
        self.down = False
        self.lock = threading.Lock()
        node = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if node.down:
                    self.send_response(500)
                    self.end_headers()
                    return
                body = node.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add_rank(self, rank: int, local_rank: int, job_id: str, world_size: int) -> Rank:
        r = Rank(rank, local_rank, job_id, world_size, self.gpus[local_rank])
        with self.lock:
            self.ranks.append(r)
        return r

    def render(self) -> str:
        now = time.time()
        out = [
            f"vramwatch_build_info{_labels(version='0', hostname=self.hostname)} 1",
            f"vramwatch_server_mode{_labels(mode=self.mode)} 1",
        ]
        with self.lock:
            ranks = [r for r in self.ranks if r.served]
            out.append(f"vramwatch_ranks {sum(1 for r in ranks if r.exit is None)}")
            for g in self.gpus:
                gl = _labels(gpu=g.index, uuid=g.uuid)
                out.append(f"gpu_up{gl} {int(g.up)}")
                if g.up:
                    out += [
                        f"gpu_utilization_ratio{gl} {g.utilization}",
                        f"gpu_power_watts{gl} {g.power_w}",
                        f"gpu_power_limit_watts{gl} {g.power_limit_w}",
                    ]
                for (xid, action), n in g.xids.items():
                    xl = _labels(gpu=g.index, uuid=g.uuid, xid=xid, action=action)
                    out.append(f"gpu_xid_errors_total{xl} {n}")
                    out.append(f"gpu_last_xid_timestamp_seconds{xl} {g.last_xid[(xid, action)]}")
            for r in ranks:
                rl = dict(rank=r.rank, local_rank=r.local_rank, job_id=r.job_id)
                steps, last = r.progress(now)
                collectives = steps * r.collectives_per_step + r.collective_offset
                out += [
                    f"vramwatch_rank_info{_labels(**rl, world_size=r.world_size, hostname=self.hostname)} 1",
                    f"vramwatch_training_steps_total{_labels(**rl)} {steps}",
                    f"vramwatch_training_step_duration_seconds_count{_labels(**rl)} {steps}",
                    f"vramwatch_training_step_duration_seconds_sum{_labels(**rl)} {last - r.started}",
                    f"vramwatch_training_last_step_timestamp_seconds{_labels(**rl)} {last}",
                    f"vramwatch_collectives_total{_labels(**rl)} {collectives}",
                    f"vramwatch_training_loss{_labels(**rl)} 2.0",
                    f"torch_cuda_memory_allocated_bytes{_labels(uuid=r.gpu.uuid, device=0, **rl)} 1073741824",
                ]
                if r.exit is not None:
                    reason, detail = r.exit
                    out.append(f"vramwatch_rank_exits_total{_labels(**rl, reason=reason, detail=detail)} 1")
        return "\n".join(out) + "\n"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

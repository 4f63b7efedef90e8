"""End to end, one incident at a time: how many pages reach the pager.

Synthetic node targets (tests/system/synthetic_node.py: the exposition of a node's server, computed at each
scrape) -> a real Prometheus running the shipped rules on a 60x faster clock (``MonitoringConfig.scaled``,
as test_e2e_alerting.py) -> a real Alertmanager running deploy/alertmanager/alertmanager.yml with only its
receiver URLs and timers swapped (the timers scaled alike: group_wait 1 s, group_interval 5 s) -> the
webhook receivers here, which count what reaches the pager.

A page is a notification that brings the pager a firing alert it has not been sent before in that group.
A later notification of the same group that brings none is an update of the same incident (Alertmanager's
PagerDuty integration keys the incident by the group): the tests check that each such one reports an
alert resolved (an Xid's window passing, say), i.e. that nothing re-pages.

One Prometheus and one Alertmanager serve the module; each test has its own job and its own nodes,
added to (and removed from) Prometheus's file-based discovery, so the tests cannot see each other's pages.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from synthetic_node import Node
from test_e2e_alerting import Webhooks, alertmanager_config

from harness import Alertmanager, Prometheus, wait_until
from vramwatch.monitoring.alerts.render import rule_file, to_yaml
from vramwatch.monitoring.config import DEFAULT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCALE = 1 / 60
CFG = dataclasses.replace(
    DEFAULT.scaled(SCALE),
    selector='job="vramwatch"',
    stall_min_seconds=4.0,
    busy_stall_min_seconds=3.0,
    sample_stale_seconds=15.0,
    xid_window="8s",
    # the shipped 1m is four of the shipped 15 s scrapes; here scrapes come every second: two of them, and
    # still before the survivors' hang page (busy floor 3 s + 1 s)
    node_lost_for="2s",
)
WAIT = 60.0
GROUP_INTERVAL = 5.0  # the shipped 5m, scaled
SETTLE = 3 * GROUP_INTERVAL  # after the incident's pages, how long no more may come


def scaled_alertmanager_config(port: int) -> dict[str, Any]:
    cfg = alertmanager_config(port)
    for route in [cfg["route"], *cfg["route"].get("routes", [])]:
        route.update({"group_wait": "1s", "group_interval": f"{GROUP_INTERVAL:g}s", "repeat_interval": "1h"})
    return cfg


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.hooks = Webhooks()
        self.am = Alertmanager(tmp, scaled_alertmanager_config(self.hooks.port)).start()
        self.sd = tmp / "targets.json"
        self.nodes: list[Node] = []
        self._write_sd()
        rules = tmp / "vramwatch.rules.yml"
        rules.write_text(to_yaml(rule_file(CFG)))
        self.prom = Prometheus(
            tmp,
            [],
            rule_files=[str(rules)],
            alertmanager=f"127.0.0.1:{self.am.port}",
            extra_scrape={
                "static_configs": [],
                "file_sd_configs": [{"files": [str(self.sd)], "refresh_interval": "1s"}],
            },
        ).start()

    def _write_sd(self) -> None:
        tmp = self.sd.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": [n.target for n in self.nodes]}]))
        os.replace(tmp, self.sd)

    def add(self, *nodes: Node) -> None:
        self.nodes += nodes
        self._write_sd()
        for n in nodes:
            self.prom.wait_for(f'up{{instance="{n.target}"}} == 1', timeout=WAIT)

    def forget(self, node: Node) -> None:
        """The node leaves service discovery (Kubernetes: its pod or node is gone)."""
        self.nodes.remove(node)
        self._write_sd()

    def stop(self) -> None:
        for part in (self.prom, self.am, self.hooks):
            part.stop()
        for n in self.nodes:
            n.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("e2e-incidents"))
    yield s
    s.stop()


def job(stack: Stack, job_id: str, hosts: int, ranks_per_host: int, mode: str = "node") -> list[Node]:
    nodes = [Node(f"{job_id}-node{h}", ranks_per_host, mode) for h in range(hosts)]
    world = hosts * ranks_per_host
    for h, node in enumerate(nodes):
        for lr in range(ranks_per_host):
            node.add_rank(h * ranks_per_host + lr, lr, job_id, world)
    stack.add(*nodes)
    stack.prom.wait_for(f'vramwatch:training_own_seconds_per_step:mean{{job_id="{job_id}"}}', timeout=WAIT)
    return nodes


def hang(nodes: list[Node], behind: int | None = None) -> None:
    """Every rank stops stepping, its GPU spinning at low power; ``behind``: the rank that never reached the
    collective the others wait in (they issued one more)."""
    now = time.time()
    for node in nodes:
        with node.lock:
            for g in node.gpus:
                g.utilization, g.power_w = 1.0, 100.0
            for r in node.ranks:
                r.stopped = now
                r.collective_offset = 0 if r.rank == behind else 1


def pages(stack: Stack, job_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the pages of the job: notifications with a firing alert new to its group; the job's other firing
    notifications, which must each be an update reporting a resolved alert)"""
    seen: dict[str, set[str]] = {}
    new: list[dict[str, Any]] = []
    updates: list[dict[str, Any]] = []
    for path, n in stack.hooks.all():
        if path != "/page" or not any(a["labels"].get("job_id") == job_id for a in n["alerts"]):
            continue
        known = seen.setdefault(n["groupKey"], set())
        fresh = [a for a in n["alerts"] if a["status"] == "firing" and a["fingerprint"] not in known]
        known.update(a["fingerprint"] for a in fresh)
        if fresh:
            new.append(n)
        elif n["status"] == "firing":
            updates.append(n)
    assert all(any(a["status"] == "resolved" for a in u["alerts"]) for u in updates), "a re-page: " + str(updates)
    return new, updates


def settle_pages(stack: Stack, job_id: str, what: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    wait_until(lambda: pages(stack, job_id)[0], WAIT, what, interval=0.25)
    time.sleep(SETTLE)
    return pages(stack, job_id)


def alerts_of(notifications: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for n in notifications:
        for a in n["alerts"]:
            out.setdefault(a["labels"]["alertname"], []).append(a)
    return out


def test_an_all_alive_hang_of_16_ranks_on_2_nodes_is_one_page_naming_the_rank_behind(stack):
    nodes = job(stack, "hang16", hosts=2, ranks_per_host=8)
    hang(nodes, behind=11)
    got, updates = settle_pages(stack, "hang16", "the hang page")
    assert len(got) == 1 and not updates, [alerts_of([n]) for n in got]
    (page,) = alerts_of(got)["TrainingStalled"]
    assert page["labels"]["job_id"] == "hang16" and "rank" not in page["labels"]
    description = page["annotations"]["description"]
    assert description.startswith("16 rank(s) of job hang16"), description
    assert f"The others wait for rank 11 on {nodes[1].target}" in description, description
    assert "What to do" in description
    # every rank's hang signature is there: the per-rank record holds all 16
    assert len(stack.prom.query('vramwatch:training_busy_stall:age_seconds{job_id="hang16"}')) == 16


def test_a_lost_gpu_under_8_ranks_is_at_most_2_pages(stack):
    (node,) = job(stack, "gpu8", hosts=1, ranks_per_host=8)
    victim = node.ranks[3]
    now = time.time()
    with node.lock:  # the GPU falls off the bus: Xid 79, NVML loses it, its rank dies with an exception
        g = victim.gpu
        g.up = False
        g.xids[(79, "restart_bm")] = 1
        g.last_xid[(79, "restart_bm")] = now
        victim.stopped = now
        victim.exit = ("exception", "torch.AcceleratorError")
    hang([node])  # the 7 others wait in their next collective
    got, _ = settle_pages(stack, "gpu8", "the lost GPU's pages")
    names = alerts_of(got)
    assert len(got) <= 2, names
    assert "TrainingStalled" not in names, "the hang is a symptom of the lost GPU: inhibited"
    causes = set(names)
    assert causes & {"GPUXidError", "GPULost", "TrainingRankExited"}, names
    # the cause alerts carry the job: the GPU's through its rank's allocator series
    assert all(a["labels"].get("job_id") == "gpu8" for alerts in names.values() for a in alerts)
    exited = names.get("TrainingRankExited")
    if exited:
        assert exited[0]["labels"]["rank"] == "3" and g.uuid in exited[0]["annotations"]["description"]


@pytest.mark.parametrize(
    "how, mode", [("target down", "node"), ("target down", "job"), ("gone from discovery", "node")]
)
def test_a_lost_node_in_a_2_node_job_is_at_most_2_pages_one_naming_the_host(stack, how, mode):
    """A node daemon (mode node) or a server its ranks started (mode job) alike."""
    job_id = f"lost-{how.split()[-1]}-{mode}"
    nodes = job(stack, job_id, hosts=2, ranks_per_host=4, mode=mode)
    lost = nodes[1]
    if how == "target down":
        lost.down = True
    else:
        # Prometheus applies discovery changes at most every 5 s (5 minutes on this test's clock, against
        # a few seconds in a cluster's): the survivors hang once it has
        stack.forget(lost)
        wait_until(lambda: not stack.prom.query(f'up{{instance="{lost.target}"}}'), WAIT, "discovery to drop it")
    hang(nodes[:1])  # the survivors wait for the lost ranks
    got, _ = settle_pages(stack, job_id, "the lost node's page")
    names = alerts_of(got)
    assert len(got) <= 2, names
    assert "TrainingStalled" not in names, "the survivors' hang is a symptom of the lost node: inhibited"
    (lost_page,) = names["TrainingNodeLost"]
    assert lost_page["labels"]["hostname"] == lost.hostname and lost_page["labels"]["instance"] == lost.target
    says = "its target fails its scrapes" if how == "target down" else "its target left service discovery"
    assert says in lost_page["annotations"]["description"]


def test_a_finished_node_an_idle_node_and_a_scrape_blip_never_page(stack):
    nodes = job(stack, "quiet", hosts=2, ranks_per_host=2)
    idle = Node("quiet-idle", 2)
    stack.add(idle)
    finished = nodes[1]
    with finished.lock:  # its ranks end cleanly: their final samples say so, then they are gone
        for r in finished.ranks:
            r.stopped, r.exit = time.time(), ("finished", "")
    time.sleep(3)
    with finished.lock:
        for r in finished.ranks:
            r.served = False
    finished.down = True  # a rank-started server exits after its ranks
    idle.down = True
    nodes[0].down = True  # a blip of the running node: back before node_lost_for (1 s here) ... twice
    time.sleep(0.4)
    nodes[0].down = False
    time.sleep(SETTLE)
    got, updates = pages(stack, "quiet")
    assert got == [] and updates == [], alerts_of(got)
    assert not [n for p, n in stack.hooks.all() if p == "/page" and "quiet-idle" in json.dumps(n)]

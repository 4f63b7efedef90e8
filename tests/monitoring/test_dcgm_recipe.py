"""docs/dcgm-exporter.md's queries, run as written against a real Prometheus scraping two vramwatch servers
(simulated GPUs, the same two GPUs: two jobs' servers on one node with `gpus: all`) and two
dcgm-exporter-shaped targets on loopback: one with dcgm-exporter's current labels (`UUID`, `hostname`),
one as `-o/--use-old-namespace` writes them (`uuid`, `Hostname`). Each join must find its GPU and keep
vramwatch's values; the once-per-GPU sum must count each GPU once where the plain sum counts it twice."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from harness import ROOT
from harness.servers import EXPORTER_JOB

pytestmark = [pytest.mark.e2e]

DOC = ROOT / "docs" / "dcgm-exporter.md"
FB_USED_MIB = (40000.0, 30000.0)
DCGM_POWER = (118.0, 121.0)


def doc_queries() -> dict[str, str]:
    text = DOC.read_text()
    found = dict(re.findall(r"<!-- query: ([\w-]+) -->\n```promql\n(.*?)```", text, re.S))
    assert set(found) == {"power-once-per-gpu", "model-name", "reserved-share-of-fb-used", "power-difference"}
    return found


def dcgm_exposition(gpu: int, uuid: str, old_namespace: bool) -> str:
    """dcgm-exporter's text format for one GPU: its metric names and label names."""
    uuid_label = "uuid" if old_namespace else "UUID"
    host_label = "Hostname" if old_namespace else "hostname"
    labels = (
        f'gpu="{gpu}",{uuid_label}="{uuid}",pci_bus_id="00000000:{0x18 + gpu:02X}:00.0",device="nvidia{gpu}",'
        f'modelName="NVIDIA H200",{host_label}="node-1",DCGM_FI_DRIVER_VERSION="580.65.06"'
    )
    families = (
        ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", 41.0),
        ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", DCGM_POWER[gpu]),
        ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", FB_USED_MIB[gpu]),
        ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", 0.0),
    )
    return "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n}{{{labels}}} {v}\n" for n, t, h, v in families)


class StaticTargets:
    """Loopback HTTP server answering /<name>/metrics with a fixed body."""

    def __init__(self, bodies: dict[str, str]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = bodies.get(self.path.strip("/").removesuffix("/metrics"))
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write((body or "").encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stack(exporter, sim_rank, prometheus) -> Iterator[dict[str, Any]]:
    exps = [exporter(gpus=2).start(), exporter(gpus=2).start()]
    sim_rank(exps[0], 0, "--duration", "120", "--fill-gib", "2", "--activation-gib", "0", cuda_visible="0")
    uuids = [g.uuid for g in exps[0].node().gpus]
    assert uuids == [g.uuid for g in exps[1].node().gpus]  # the same node's GPUs, seen by two servers
    dcgm = StaticTargets({"new": dcgm_exposition(0, uuids[0], False), "old": dcgm_exposition(1, uuids[1], True)})

    def job(name: str, targets: list[str], path: str = "/metrics") -> dict[str, Any]:
        return {"job_name": name, "metrics_path": path, "static_configs": [{"targets": targets}]}

    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            job(EXPORTER_JOB, [f"127.0.0.1:{e.port}" for e in exps]),
            job("dcgm-exporter", [dcgm.address], "/new/metrics"),
            job("dcgm-exporter-old", [dcgm.address], "/old/metrics"),
        ],
    }
    prom = prometheus([], config=config)
    prom.wait_for("torch_cuda_memory_reserved_bytes > 0", timeout=30)
    prom.wait_for("gpu_power_watts", timeout=30, check=lambda r: len(r) == 4)
    prom.wait_for("DCGM_FI_DEV_FB_USED", timeout=30, check=lambda r: len(r) == 2)
    yield {"prom": prom, "uuids": uuids, "power": [g.power_w for g in exps[0].node().gpus]}
    dcgm.stop()


def _one(result: list[dict[str, Any]]) -> tuple[dict[str, str], float]:
    assert len(result) == 1, result
    return result[0]["metric"], float(result[0]["value"][1])


def test_the_documented_queries_join_under_both_spellings_and_count_each_gpu_once(stack):
    prom, uuids = stack["prom"], stack["uuids"]
    q = doc_queries()
    labels, reserved = _one(prom.query("torch_cuda_memory_reserved_bytes"))
    assert labels["uuid"] == uuids[0] and reserved > 0

    labels, value = _one(prom.query(q["model-name"]))
    assert labels["modelName"] == "NVIDIA H200" and labels["uuid"] == uuids[0] and labels["rank"] == "0"
    assert value == reserved  # the values stay vramwatch's

    labels, share = _one(prom.query(q["reserved-share-of-fb-used"]))
    assert labels == {"uuid": uuids[0]}
    assert share == pytest.approx(reserved / (FB_USED_MIB[0] * 1048576), rel=1e-3)

    diff = prom.query(q["power-difference"])
    by_gpu: dict[str, list[float]] = {}
    for r in diff:
        by_gpu.setdefault(r["metric"]["uuid"], []).append(float(r["value"][1]))
    # both GPUs join, the current spelling (UUID) and the old one (uuid), once per vramwatch server
    assert sorted(by_gpu) == sorted(uuids) and all(len(v) == 2 for v in by_gpu.values())
    for i, u in enumerate(uuids):
        assert by_gpu[u] == pytest.approx([stack["power"][i] - DCGM_POWER[i]] * 2)

    # counted once per GPU, where the plain sum counts each twice
    _, once = _one(prom.query(doc_queries()["power-once-per-gpu"]))
    _, twice = _one(prom.query("sum(gpu_power_watts)"))
    assert once == pytest.approx(sum(stack["power"]))
    assert twice == pytest.approx(2 * once)  # what the doc warns about: two servers report one node's GPUs

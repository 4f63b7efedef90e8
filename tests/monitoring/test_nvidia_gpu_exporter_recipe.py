"""docs/nvidia-gpu-exporter.md's recipe, run as written against a real Prometheus scraping a vramwatch server
(simulated GPUs) and a static target serving nvidia_gpu_exporter's exposition for the same GPUs (its metric
names and its `uuid` without the `GPU-` prefix): the plain `on(uuid)` finds nothing, each documented query
joins every GPU and keeps vramwatch's values, and the scrape-time relabelling makes `on(uuid)` work."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from test_dcgm_recipe import StaticTargets

from harness import ROOT
from harness.servers import EXPORTER_JOB

pytestmark = [pytest.mark.e2e]

DOC = ROOT / "docs" / "nvidia-gpu-exporter.md"
USED_BYTES = (42_949_672_960.0, 32_212_254_720.0)
POWER = (131.5, 128.25)


def doc_queries() -> dict[str, str]:
    found = dict(re.findall(r"<!-- query: ([\w-]+) -->\n```promql\n(.*?)```", DOC.read_text(), re.S))
    assert set(found) == {"reserved-share-of-used", "vbios-on-allocator", "power-difference"}
    return found


def doc_relabel() -> list[dict[str, Any]]:
    (text,) = re.findall(r"<!-- relabel: nvidia-gpu-exporter -->\n```yaml\n(.*?)```", DOC.read_text(), re.S)
    return yaml.safe_load(text)["metric_relabel_configs"]


def exposition(gpus: list[tuple[int, str]]) -> str:
    """nvidia_gpu_exporter's text format for these GPUs: `uuid` is NVML's without `GPU-` (its docs/METRICS.md)."""
    out = []
    families = (
        ("nvidia_smi_gpu_info", "A metric with a constant '1' value labeled by gpu uuid, name, ...", None),
        ("nvidia_smi_memory_used_bytes", "memory.used [MiB]", USED_BYTES),
        ("nvidia_smi_power_draw_watts", "power.draw [W]", POWER),
    )
    for name, help_, values in families:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} gauge\n")
        for index, uuid in gpus:
            bare = uuid.removeprefix("GPU-")
            if values is None:
                labels = (
                    f'uuid="{bare}",name="NVIDIA H200",driver_version="580.65.06",cuda_version="13.0",'
                    f'pci_bus_id="00000000:{0x18 + index:02X}:00.0",index="{index}",'
                    f'vbios_version="96.00.AF.00.0{index}"'
                )
                out.append(f"{name}{{{labels}}} 1\n")
            else:
                out.append(f'{name}{{uuid="{bare}"}} {values[index]}\n')
    out.append("# HELP nvidia_smi_last_collect_success Whether the most recent collection succeeded\n")
    out.append("# TYPE nvidia_smi_last_collect_success gauge\nnvidia_smi_last_collect_success 1\n")
    return "".join(out)


@pytest.fixture
def stack(exporter, sim_rank, prometheus) -> Iterator[dict[str, Any]]:
    exp = exporter(gpus=2).start()
    sim_rank(exp, 0, "--duration", "120", "--fill-gib", "2", "--activation-gib", "0", cuda_visible="0")
    uuids = [g.uuid for g in exp.node().gpus]
    target = StaticTargets({"ngx": exposition(list(enumerate(uuids)))})

    def job(name: str, **extra: Any) -> dict[str, Any]:
        return {
            "job_name": name,
            "metrics_path": "/ngx/metrics",
            "static_configs": [{"targets": [target.address]}],
        } | extra

    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": EXPORTER_JOB, "static_configs": [{"targets": [f"127.0.0.1:{exp.port}"]}]},
            job("nvidia-gpu-exporter"),
            job("nvidia-gpu-exporter-relabelled", metric_relabel_configs=doc_relabel()),
        ],
    }
    prom = prometheus([], config=config)
    prom.wait_for("torch_cuda_memory_reserved_bytes > 0", timeout=30)
    prom.wait_for("gpu_power_watts", timeout=30, check=lambda r: len(r) == 2)
    prom.wait_for("nvidia_smi_power_draw_watts", timeout=30, check=lambda r: len(r) == 4)
    yield {"prom": prom, "uuids": uuids, "power": [g.power_w for g in exp.node().gpus]}
    target.stop()


def _one(result: list[dict[str, Any]]) -> tuple[dict[str, str], float]:
    assert len(result) == 1, result
    return result[0]["metric"], float(result[0]["value"][1])


def test_the_documented_recipe_joins_where_on_uuid_alone_finds_nothing(stack):
    prom, uuids = stack["prom"], stack["uuids"]
    q = doc_queries()
    plain = 'gpu_power_watts - on(uuid) group_left() nvidia_smi_power_draw_watts{job="nvidia-gpu-exporter"}'
    assert prom.query(plain) == [], "the prefix no longer differs: the recipe is not needed"

    labels, reserved = _one(prom.query("torch_cuda_memory_reserved_bytes"))
    assert labels["uuid"] == uuids[0] and reserved > 0

    # as written, with nvidia_gpu_exporter scraped twice, once relabelled already (`GPU-` kept once): the
    # `max by`/`group by` keep one series per GPU, so each query still joins each GPU once
    labels, share = _one(prom.query(q["reserved-share-of-used"]))
    assert labels == {"uuid": uuids[0]} and share == pytest.approx(reserved / USED_BYTES[0], rel=1e-3)

    labels, value = _one(prom.query(q["vbios-on-allocator"]))
    assert labels["vbios_version"] == "96.00.AF.00.00" and labels["rank"] == "0" and value == reserved

    diff = {r["metric"]["uuid"]: float(r["value"][1]) for r in prom.query(q["power-difference"])}
    assert sorted(diff) == sorted(uuids)
    for i, u in enumerate(uuids):
        assert diff[u] == pytest.approx(stack["power"][i] - POWER[i])


def test_the_scrape_time_relabelling_makes_on_uuid_work(stack):
    prom, uuids = stack["prom"], stack["uuids"]
    relabelled = '{job="nvidia-gpu-exporter-relabelled"}'
    joined = prom.query(f"gpu_power_watts - on(uuid) group_left() nvidia_smi_power_draw_watts{relabelled}")
    assert sorted(r["metric"]["uuid"] for r in joined) == sorted(uuids)
    health = prom.query(f"nvidia_smi_last_collect_success{relabelled}")
    assert len(health) == 1 and "uuid" not in health[0]["metric"], "a series without uuid keeps its labels"

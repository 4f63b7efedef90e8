"""End to end on a MIG node: a simulated GPU in MIG mode with two instances, a simulated rank on one of them
(CUDA_VISIBLE_DEVICES=MIG-...), the server's NVML collector, and a real Prometheus joining the rank's
allocator series to its instance's memory and to the parent card with the PromQL of docs/MIG.md."""

from __future__ import annotations

import re
import time

import pytest

from vramwatch.monitoring.config import DEFAULT
from vramwatch.monitoring.dashboards import build_all
from vramwatch.monitoring.dashboards.common import GPU, variables
from vramwatch.monitoring.dashboards.walk import TimeContext, label_values_query, spec
from vramwatch.monitoring.mig import to_parent
from vramwatch.report.data import run_panel, variable_values
from vramwatch.report.prom import PromClient

pytestmark = pytest.mark.e2e
GIB = 1 << 30


def test_a_rank_on_a_mig_instance_joins_its_instance_and_its_card(exporter, prometheus, sim_rank):
    exp = exporter(gpus=2, nvml_slow_interval=1)
    node = exp.node()
    a, b = node.gpu(0).enable_mig(("3g.71gb", "3g.71gb"))
    exp.save_node(node)
    exp.start()
    sim_rank(exp, 0, "--duration", "90", "--fill-gib", "8", cuda_visible=b.uuid)
    prom = prometheus([f"127.0.0.1:{exp.port}"])

    # the rank's series carry the instance's uuid and join its memory series one to one
    joined = prom.wait_for(
        "torch_cuda_memory_reserved_bytes / on(job, instance, uuid) group_left() gpu_mig_memory_total_bytes",
        check=lambda r: len(r) == 1,
    )
    assert joined[0]["metric"]["uuid"] == b.uuid
    assert 8 * GIB / b.total_bytes <= float(joined[0]["value"][1]) < 1  # against the instance's 71 GiB
    # ... and the instance's info: parent uuid, GPU instance id, profile
    info = prom.wait_for(
        "torch_cuda_memory_reserved_bytes * on(job, instance, uuid) group_left(parent_uuid, gpu_instance_id, profile)"
        " gpu_mig_info",
        check=lambda r: len(r) == 1,
    )[0]["metric"]
    assert (info["parent_uuid"], info["gpu_instance_id"], info["profile"]) == (node.gpu(0).uuid, "2", "3g.71gb")
    # the instance's used memory is the rank's reservation plus its CUDA context, alone on the instance
    used = prom.wait_for(f'gpu_mig_memory_used_bytes{{uuid="{b.uuid}"}}', check=lambda r: len(r) == 1)
    assert float(used[0]["value"][1]) >= 8 * GIB + node.context_bytes
    assert float(prom.query(f'gpu_mig_memory_used_bytes{{uuid="{a.uuid}"}}')[0]["value"][1]) == 0
    # the parent card's series, through the info family: its name and power
    to_card = to_parent("torch_cuda_memory_reserved_bytes")
    card = prom.wait_for(
        f"{to_card} * on(job, instance, uuid) group_left(name, mig_mode) gpu_info",
        check=lambda r: len(r) == 1,
    )[0]["metric"]
    assert (card["uuid"], card["name"], card["mig_mode"]) == (node.gpu(0).uuid, node.gpu(0).name, "enabled")
    power = prom.query(f"{to_card} * 0 + on(job, instance, uuid) gpu_power_watts")
    assert len(power) == 1 and float(power[0]["value"][1]) == node.gpu(0).power_w
    # the other card is not in MIG mode: no instances under it
    assert {r["metric"]["gpu"] for r in prom.query("gpu_mig_info")} == {"0"}
    # the dashboards' GPU variable offers the instance (so picking it keeps the rank's series) and the cards
    (query,) = [m.query for m in (v.build() for v in variables(DEFAULT)) if m.name == GPU]
    selector, label = label_values_query(str(query))
    selector = re.sub(r'=~"\$\w+"', '=~".*"', selector)  # every variable at All
    offered = {r["metric"][label] for r in prom.query(f"group by ({label}) ({selector})")}
    assert offered == {b.uuid, a.uuid, node.gpu(0).uuid, node.gpu(1).uuid}
    # with the rank's job chosen, the host variable keeps its node, so the card-total line (the instance's own
    # total, a GPU family without job_id) still shows the instance
    now = time.time()
    tc = TimeContext(now - 60, now, 5.0, 1.0)
    (d,) = [spec(m) for m in build_all() if m.uid == "vramwatch-training-memory"]
    client = PromClient(prom.url)
    values = variable_values(d, {"job_id": [joined[0]["metric"]["job_id"]]}, client, tc)
    assert values["host"] == re.escape(f"127.0.0.1:{exp.port}").replace("\\", "\\\\")
    (p,) = [p for p in d.panels if p.title == "Allocated, reserved, card total and limit"]
    card_total = {r.target.ref: r for r in run_panel(client, p, values, tc).results}["C"]
    assert {s.labels["uuid"] for s in card_total.series} == {b.uuid}

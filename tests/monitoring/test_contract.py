"""The metric contract is the API: everything exposed is listed, names follow Prometheus practice."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from samples import rank_sample

from harness import tool, wait_until
from vramwatch.monitoring import contract
from vramwatch.server.collectors import ScrapeContext, ranks
from vramwatch.spool import AllocatorInfo, CollectorHealth, HeartbeatSnapshot

GOLDEN = Path(__file__).parents[1] / "golden"
UNITS = ("bytes", "seconds", "watts", "joules", "celsius", "hertz", "ratio")


def test_names_are_unique_snake_case_with_base_units():
    names = [m.name for m in contract.METRICS]
    assert len(names) == len(set(names))
    for m in contract.METRICS:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", m.name), m.name
        assert m.name.split("_")[0] in ("torch", "gpu", "vramwatch"), m.name
        assert m.type in ("gauge", "counter", "histogram", "info")
        if m.type == "counter":
            assert m.name.endswith("_total"), m.name
        if m.type == "info":
            assert m.name.endswith("_info"), m.name
        if m.unit:
            assert m.unit in UNITS and f"_{m.unit}" in m.name, m.name
        assert not re.search(r"_(mib|mb|kb|percent|ms|mj|mw|mhz)(_|$)", m.name), m.name
        assert m.help.endswith((".", ")")), m.name


def test_no_label_can_grow_without_bound():
    forbidden = {"pid", "step", "epoch", "command", "cmdline", "process_name", "username", "message", "err_msg"}
    for m in contract.METRICS:
        assert not forbidden & set(m.labels), m.name


def _ctx() -> ScrapeContext:
    sample = rank_sample(
        1,
        world_size=2,
        pid=42,
        time=1000.0,
        uuid="GPU-1111",
        values={
            "torch_cuda_memory_allocated_bytes": 3.08e9,
            "torch_cuda_memory_reserved_bytes": 3.28e9,
            "torch_cuda_memory_fragmentation_ratio": 0.2 / 3.28,
            "torch_cuda_memory_alloc_retries_total": 2.0,
            "not_in_the_contract": 1.0,
        },
        allocator_info=AllocatorInfo(
            backend="native", expandable_segments="true", garbage_collection_threshold="0.8", max_split_size_mb=""
        ),
        heartbeat=HeartbeatSnapshot(
            steps=3, last_step_time=999.0, buckets=(0.1, 1.0), counts=(1, 1, 0), sum=0.55, loss=0.6929
        ),
        collectors={"allocator": CollectorHealth(up=1, errors=0, duration=0.0001)},
    )
    return ScrapeContext((sample,), now=1002.5, hostname="node-a")


class _Static:
    def __init__(self, fams: list[Metric]):
        self.fams = fams

    def collect(self):
        return self.fams


def _render(ctx) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Static(list(ranks.families(ctx))))
    return generate_latest(reg).decode()


def test_rank_families_golden():
    text = _render(_ctx())
    golden = GOLDEN / "rank_families.prom"
    if os.environ.get("VRAMWATCH_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), "set VRAMWATCH_UPDATE_GOLDEN=1 to accept the new output"
    assert "not_in_the_contract" not in text  # values outside the contract are dropped


def test_promtool_accepts_the_exposition(tmp_path):
    text = _render(_ctx())
    r = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.e2e
def test_every_exposed_family_is_in_the_contract(exporter, sim_rank):
    exp = exporter().start()
    sim_rank(exp, 0, "--duration", "30")
    text = wait_until(
        lambda: (lambda t: "torch_cuda_memory_allocated_bytes{" in t and t)(exp.scrape()), 15, "allocator series"
    )
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    unknown = contract.exposed_names(names) - set(contract.BY_NAME)
    assert not unknown, f"exposed but not in the contract: {sorted(unknown)}"
    r = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_docs_are_generated_from_the_contract():
    from vramwatch.docs import regenerate

    root = Path(__file__).resolve().parents[2]
    assert regenerate(check=True, root=str(root)) == 0, "run `vramwatch docs`"
    readme = (root / "README.md").read_text()
    for m in contract.METRICS:
        assert f"`{m.name}`" in readme


def test_exposed_names_strip_only_a_contract_histograms_suffixes():
    (hist,) = [m.name for m in contract.METRICS if m.type == "histogram"][:1]
    samples = [f"{hist}_bucket", f"{hist}_sum", f"{hist}_count", f"{hist}_created", "gpu_power_watts"]
    assert contract.exposed_names(samples) == {hist, "gpu_power_watts"}
    # a suffix on a name that is not a contract histogram stays: it is reported as unknown
    assert contract.exposed_names(["not_in_the_contract_sum", "x_created"]) == {"not_in_the_contract_sum", "x_created"}


def test_counter_families_expose_the_contract_name():
    (counter,) = [m.name for m in contract.METRICS if m.type == "counter"][:1]
    fam = contract.family(counter)
    fam.add_metric(["0"] * len(contract.spec(counter).labels), 1.0)
    assert [s.name for s in fam.samples] == [counter] and counter.endswith("_total")


def test_a_section_row_takes_its_type_and_unit_from_its_name_and_its_defaults_from_the_section():
    make = contract._section("allocator", ("rank", "local_rank"), "why absent")
    assert make("x_bytes", "Help.") == contract.MetricSpec(
        "x_bytes", "gauge", "bytes", ("rank", "local_rank"), "Help.", "allocator", "why absent"
    )
    assert make("x_wait_seconds_total", "H.", "", labels=()) == contract.MetricSpec(
        "x_wait_seconds_total", "counter", "seconds", (), "H.", "allocator", ""
    )
    assert (make("x_info", "H.").type, make("x_info", "H.").unit) == ("info", "")
    assert make("x_rx_bytes_per_second", "H.").unit == "bytes"
    assert make("x_duration_seconds", "H.", type_="histogram").type == "histogram"
    # the table itself: what the rows were built from, as the collectors and docs read it
    row = contract.spec("torch_cuda_memory_allocated_bytes")
    assert (row.type, row.unit, row.labels, row.collector) == ("gauge", "bytes", contract.RANK_DEVICE, "allocator")

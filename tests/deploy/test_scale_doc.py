"""docs/scale.md against the measurement it quotes (benchmarks/results/series.json) and the exporter today;
its fleet relabelling keeps every series the alerts and the fleet dashboard read."""

from __future__ import annotations

import json
import re
import time

import pytest
import series_count
import yaml
from deploy_files import DEPLOY, RULES

from harness import ROOT, http_get
from vramwatch.monitoring import contract


def _families_in(text: str) -> set[str]:
    names = {m.name for m in contract.METRICS}
    found = set()
    for word in set(re.findall(r"[a-z_][a-z0-9_]*", text)):
        for suffix in ("", "_bucket", "_sum", "_count"):
            if word.endswith(suffix) and word[: len(word) - len(suffix)] in names:
                found.add(word)
    return found


def _dropped(relabel: list[dict], labels: dict[str, str]) -> bool:
    for r in relabel:
        assert r["action"] in ("drop", "keep"), r
        value = r.get("separator", ";").join(labels.get(s, "") for s in r["source_labels"])
        hit = re.fullmatch(r["regex"], value) is not None
        if (r["action"] == "drop") == hit:
            return True
    return False


def test_fleet_relabelling_keeps_what_alerts_and_the_fleet_dashboard_read():
    relabel = series_count.fleet_relabel_configs()
    assert relabel, "docs/scale.md lost its metric_relabel_configs"
    # the panels group records only for the dashboards
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = _families_in(yaml.safe_dump([g for g in groups if g["name"] != "vramwatch-panels"]))
    fleet_dash = _families_in((DEPLOY / "grafana" / "dashboards" / "vramwatch-fleet.json").read_text())
    assert len(rules) > 10
    for name in sorted(rules | fleet_dash):
        assert not _dropped(relabel, {"__name__": name}), f"the fleet relabelling drops {name}, which is read"
    # throttle reasons the alerts name survive; the dropped ones are the ones that cost no speed
    for reason in re.findall(r'reason=~"([^"]+)"', RULES.read_text())[0].split("|"):
        assert not _dropped(relabel, {"__name__": "gpu_clock_throttle", "reason": reason}), reason
    assert _dropped(relabel, {"__name__": "gpu_clock_throttle", "reason": "gpu_idle"})
    assert _dropped(relabel, {"__name__": "vramwatch_training_step_duration_seconds_bucket", "le": "1"})
    assert not _dropped(relabel, {"__name__": "vramwatch_training_step_duration_seconds_count"})


def test_scale_md_agrees_with_the_measurement():
    result = json.loads((ROOT / "benchmarks" / "results" / "series.json").read_text())
    assert result["ranks"] == 8 and result["gpus"] == 8
    assert result["prometheus"], "series.json was recorded without the real Prometheus scrape"
    assert result["prometheus"]["scrape_samples_scraped"] == result["steady"]["series"]
    expected = series_count.render_doc_blocks(result)
    assert series_count.doc_blocks() == expected, (
        "docs/scale.md is stale: python3 benchmarks/series_count.py --doc-from benchmarks/results/series.json"
    )
    # the measurement is of contract families only, and of every fixed-cardinality one an 8-GPU node has
    measured = contract.exposed_names(result["steady"]["families"])
    assert measured <= set(contract.BY_NAME), measured - set(contract.BY_NAME)
    for name in (
        "torch_cuda_memory_reserved_bytes",
        "gpu_memory_used_bytes",
        "gpu_xid_errors_total",
        "vramwatch_training_step_duration_seconds",
        "vramwatch_build_info",
    ):
        assert name in measured, name


@pytest.mark.e2e
def test_recorded_series_count_matches_the_exporter_today():
    """A small live node (2 ranks, 2 GPUs) predicts the 8 x 8 count: per-rank and per-GPU series scale, the
    rest stays. A family added or dropped since the recording shows here, naming it."""
    result = json.loads((ROOT / "benchmarks" / "results" / "series.json").read_text())
    with series_count.SimulatedNode(2, 2, nvml_slow_interval="1", largest_block_interval="1") as node:
        node.wait_complete(timeout=90)
        time.sleep(3)  # one slow NVML read and one largest-block snapshot
        small = series_count.by_family_and_kind(http_get(node.url)[1].decode())
    predicted = series_count.predict(small, (2, 2), (result["ranks"], result["gpus"]))
    recorded = result["steady"]["families"]
    diff = {
        f: (recorded.get(f), predicted.get(f))
        for f in set(recorded) | set(predicted)
        if recorded.get(f) != predicted.get(f)
    }
    assert not diff, (
        "benchmarks/results/series.json is stale (family: recorded, now); re-run "
        f"python3 benchmarks/series_count.py --update-doc: {dict(sorted(diff.items()))}"
    )


def test_scrape_cost_table_is_the_recorded_sweep():
    import scrape_scale as mod

    recorded = sorted((ROOT / "benchmarks" / "results").glob("*/scrape_scale.json"))
    assert recorded, "no recorded sweep: benchmarks/scrape_scale.py --out benchmarks/results/<run>/scrape_scale.json"
    result = json.loads(recorded[-1].read_text())
    assert mod.doc_block() == mod.render_doc(result), (
        f"docs/scale.md's scrape-cost table is stale: python3 benchmarks/scrape_scale.py --doc-from {recorded[-1]}"
    )
    grid = {(p["gpus"], p["ranks"]) for p in result["points"]}
    assert {(1, 1), (8, 8), (1, 64), (8, 64)} <= grid, "the sweep covers 1-64 ranks and 1-8 GPUs"

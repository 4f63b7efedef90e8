"""deploy/slurm/: the file_sd generator from a SLURM node list, the two Prometheus configs (promtool), and a real
Prometheus that finds a real node daemon through the generated file (docs/slurm.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from deploy_files import DEPLOY, RULES, run

from harness import tool
from harness.net import free_port, http_get, wait_until
from harness.procs import child_env, stop_proc
from harness.servers import Prometheus

SLURM = DEPLOY / "slurm"
GENERATOR = SLURM / "vramwatch_file_sd.py"


def generate(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(GENERATOR), *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def test_targets_from_scontrol_show_hostnames_output() -> None:
    # `scontrol show hostnames gpu[001-002],login1` prints one name a line; lists pasted by hand add the rest
    out = generate(
        "--port", "9500", "--label", "cluster=hpc1", stdin="gpu001\ngpu002\n\n# spares\ngpu001\n10.0.0.5\nfe80::1\n"
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [
        {"targets": ["gpu001:9500", "gpu002:9500", "10.0.0.5:9500", "[fe80::1]:9500"], "labels": {"cluster": "hpc1"}}
    ]


def test_the_shipped_example_is_the_generators_output() -> None:
    out = generate("--label", "cluster=hpc1", str(SLURM / "nodes.example"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == json.loads((SLURM / "vramwatch-nodes.json").read_text())


def test_a_bad_line_names_itself_and_an_empty_list_keeps_the_targets(tmp_path: Path) -> None:
    out = generate(stdin="gpu001\ngpu 002\n")
    assert out.returncode == 2 and "line 2: not a host name: 'gpu 002'" in out.stderr
    out = generate("--label", "__meta=x", stdin="gpu001\n")
    assert out.returncode == 2 and "--label '__meta=x'" in out.stderr
    sd = tmp_path / "vramwatch.json"
    assert generate("--output", str(sd), stdin="gpu001\n").returncode == 0
    before = sd.read_text()
    out = generate("--output", str(sd), stdin="\n")  # a failed sinfo: nothing on stdin
    assert out.returncode == 1 and "empty" in out.stderr
    assert sd.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["vramwatch.json"]  # no temporary file left behind


def _file_sd_config(sd_file: Path, scrape: str = "15s") -> dict:
    cfg = yaml.safe_load((SLURM / "prometheus.yml").read_text())
    cfg["rule_files"] = [str(RULES)]
    cfg["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(sd_file)]
    cfg["global"] = {"scrape_interval": scrape, "scrape_timeout": scrape, "evaluation_interval": scrape}
    return cfg


def test_the_slurm_configs_pass_promtool(tmp_path: Path) -> None:
    assert yaml.safe_load((SLURM / "prometheus.yml").read_text())["rule_files"] == [
        "../prometheus/rules/vramwatch.rules.yml"
    ]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(_file_sd_config(SLURM / "vramwatch-nodes.json")))
    r = run(tool("promtool"), "check", "config", str(config))
    assert r.returncode == 0, r.stdout + r.stderr
    # promtool reads the file_sd file too: a broken one fails the check
    bad = tmp_path / "bad.json"
    bad.write_text('[{"targets": ["gpu001:9488"], "labels": {"__x-": "y"}}]')
    config.write_text(yaml.safe_dump(_file_sd_config(bad)))
    r = run(tool("promtool"), "check", "config", str(config))
    assert r.returncode != 0 and "not a valid label name" in r.stdout + r.stderr
    r = run(tool("promtool"), "check", "config", str(SLURM / "prometheus-static.yml"))  # its relative rule path
    assert r.returncode == 0, r.stdout + r.stderr
    static = yaml.safe_load((SLURM / "prometheus-static.yml").read_text())
    assert [t for g in static["scrape_configs"][0]["static_configs"] for t in g["targets"]] == json.loads(
        (SLURM / "vramwatch-nodes.json").read_text()
    )[0]["targets"]


@pytest.fixture
def node_daemon(tmp_path: Path):
    port = free_port()
    env = child_env(
        VRAMWATCH_NODE_DIR=str(tmp_path / "run-vramwatch"),
        VRAMWATCH_PORT=str(port),
        VRAMWATCH_SIMULATE="true",
        VRAMWATCH_NVML_INTERVAL="0.2",
    )
    with open(tmp_path / "daemon.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vramwatch", "serve", "--node"], env=env, stdout=log, stderr=log)
    try:
        wait_until(lambda: proc.poll() is None and _answers(port), 30, "the node daemon to answer")
        yield port
    finally:
        stop_proc(proc)


def _answers(port: int) -> bool:
    try:
        return http_get(f"http://127.0.0.1:{port}/-/healthy", 1)[0] == 200
    except OSError:
        return False


def test_prometheus_finds_the_node_daemons_through_the_generated_file(tmp_path: Path, node_daemon: int) -> None:
    sd = tmp_path / "file_sd" / "vramwatch.json"
    sd.parent.mkdir()
    assert generate("--port", str(node_daemon), "--output", str(sd), stdin="127.0.0.1\n").returncode == 0
    prom = Prometheus(tmp_path / "prom", config=_file_sd_config(sd, "1s")).start()
    try:
        got = prom.wait_for('up{job="vramwatch", node="127.0.0.1"} == 1', timeout=60)
        assert got and got[0]["metric"]["instance"] == f"127.0.0.1:{node_daemon}"
        prom.wait_for('vramwatch_server_mode{mode="node"} == 1 and on(instance) vramwatch_ranks == 0')
        time.sleep(3)  # rule evaluations of an idle node
        assert prom.query("ALERTS") == []
        # a node joins the list: Prometheus re-reads the changed file (this one has no daemon: down)
        other = free_port()
        nodes = "127.0.0.1\nlocalhost\n"
        assert generate("--port", str(other), "--output", str(sd), stdin=nodes).returncode == 0
        prom.wait_for(f'up{{instance="localhost:{other}"}} == 0', timeout=60)
    finally:
        prom.stop()

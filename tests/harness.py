"""Test harness: real processes on loopback. The exporter server, simulated ranks, a real Prometheus.

Every helper picks free ports and private temporary directories, so suites can
run side by side; every wait is bounded and fails with what it last saw.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def tool(name: str) -> str:
    """Path of a Prometheus-project binary (Debian package names), or skip/fail the test.

    In CI (CI=true) a missing binary fails the test: `make test` installs them.
    """
    candidates = []
    if os.environ.get("TEST_TOOLS_DIR"):
        candidates.append(Path(os.environ["TEST_TOOLS_DIR"]) / name)
    candidates.append(ROOT / ".cache" / "debian" / "usr" / "bin" / name)
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which(name)
    if found:
        return found
    msg = f"{name} not found (make tools installs Debian's package into .cache/debian)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - keep polling, report the last failure
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def base_env(spool_dir: str, port: int, **settings: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    env.update({"VRAMWATCH_SPOOL_DIR": spool_dir, "VRAMWATCH_PORT": str(port), "PYTHONUNBUFFERED": "1"})
    for k, v in settings.items():
        env["VRAMWATCH_" + k.upper()] = ("true" if v else "false") if isinstance(v, bool) else str(v)
    return env


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


class Exporter:
    """``vramwatch serve`` in its own process, on the simulated GPU unless told otherwise."""

    def __init__(self, tmp: Path, simulate: bool = True, gpus: int = 1, **settings: Any) -> None:
        self.spool = str(tmp / "spool")
        os.makedirs(self.spool, exist_ok=True)
        self.port = free_port()
        self.settings = dict(simulate=simulate, **settings)
        if simulate:
            from vramwatch.sim.state import SimNode, state_path

            if not os.path.exists(state_path(self.spool)):
                SimNode.default(gpus).save(state_path(self.spool))
        self.env = base_env(self.spool, self.port, **self.settings)
        self.log = open(tmp / f"server-{self.port}.log", "ab")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> Exporter:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vramwatch", "serve"],
            env=self.env,
            stdout=self.log,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
        )
        wait_until(
            lambda: self.proc.poll() is None and http_get(self.url + "/-/healthy", 1)[0] == 200,
            timeout,
            "the exporter to answer",
        )
        return self

    def scrape(self) -> str:
        code, body = http_get(self.url + "/metrics")
        assert code == 200, body
        return body.decode()

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        return parse_metrics(self.scrape())

    def node(self):
        from vramwatch.sim.state import SimNode, state_path

        return SimNode.load(state_path(self.spool))

    def save_node(self, node) -> None:
        from vramwatch.sim.state import state_path

        node.save(state_path(self.spool))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.log.close()


def start_sim_rank(
    exporter: Exporter,
    rank: int,
    *args: str,
    world_size: int = 1,
    local_rank: int | None = None,
    cuda_visible: str | None = None,
    **settings: Any,
) -> subprocess.Popen:
    """A simulated training rank publishing into ``exporter``'s spool (it never starts a server)."""
    env = base_env(exporter.spool, exporter.port, simulate=True, serve="external", interval=0.2, **settings)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "WORLD_SIZE": str(world_size),
        }
    )
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    return subprocess.Popen(
        [sys.executable, "-m", "vramwatch.sim.worker", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=exporter.log,
        stderr=exporter.log,
    )


def stop_proc(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class Prometheus:
    """A real Prometheus server on loopback with its own TSDB in a temporary directory."""

    def __init__(
        self,
        tmp: Path,
        targets: list[str],
        scrape_interval: str = "1s",
        evaluation_interval: str = "1s",
        rule_files: list[str] | None = None,
        alertmanager: str | None = None,
        extra_scrape: dict[str, Any] | None = None,
    ) -> None:
        self.dir = tmp / f"prometheus-{free_port()}"
        self.dir.mkdir(parents=True)
        self.port = free_port()
        job: dict[str, Any] = {
            "job_name": "vramwatch",
            "static_configs": [{"targets": targets}],
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
        }
        if extra_scrape:
            job.update(extra_scrape)
        cfg: dict[str, Any] = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval},
            "scrape_configs": [job],
        }
        if rule_files:
            cfg["rule_files"] = rule_files
        if alertmanager:
            cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        self.config = self.dir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.proc: subprocess.Popen | None = None
        self.log = open(self.dir / "prometheus.log", "ab")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> Prometheus:
        self.proc = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self.log,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
        )
        wait_until(
            lambda: self.proc.poll() is None and http_get(self.url + "/-/ready", 1)[0] == 200,
            timeout,
            "Prometheus to be ready",
        )
        return self

    def query(self, expr: str, time_: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr}
        if time_ is not None:
            params["time"] = str(time_)
        code, body = http_get(self.url + "/api/v1/query?" + urllib.parse.urlencode(params))
        data = json.loads(body)
        if data.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {data}")
        return data["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        params = {"query": expr, "start": str(start), "end": str(end), "step": str(step)}
        code, body = http_get(self.url + "/api/v1/query_range?" + urllib.parse.urlencode(params))
        data = json.loads(body)
        if data.get("status") != "success":
            raise AssertionError(f"query_range {expr!r} failed: {data}")
        return data["data"]["result"]

    def wait_for(self, expr: str, timeout: float = 30.0, check: Callable[[list], bool] = bool) -> list:
        def attempt():
            r = self.query(expr)
            return (r,) if check(r) else None  # a tuple is truthy even when r is []

        return wait_until(attempt, timeout, f"Prometheus query {expr!r}", interval=0.5)[0]

    def stop(self) -> None:
        if self.proc is not None:
            stop_proc(self.proc)
        self.log.close()

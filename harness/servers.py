"""Prometheus and Alertmanager (Debian's builds, `make tools`) on loopback, each in a directory of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from harness.net import free_port, http_get, wait_until
from harness.procs import die_with, stop_proc
from harness.tools import tool

EXPORTER_JOB = "vramwatch"


class StackError(RuntimeError):
    """A server exited or never became ready; the message carries the end of its log."""


def write_yaml(path: Path, doc: dict[str, Any]) -> None:
    import yaml

    path.write_text(yaml.safe_dump(doc, sort_keys=False))


class Server:
    """One binary on 127.0.0.1:``port``, its files and log in ``parent``/``name``-``port``; ready when
    ``ready_path`` answers 200. ``detach`` gives it its own session (a terminal's Ctrl-C reaches only our process, which
    then stops it in order) and SIGTERM should our process die without stopping it."""

    name = "server"
    ready_path = "/-/ready"

    def __init__(self, parent: Path, port: int | None = None, detach: bool = False) -> None:
        self.port = port or free_port()
        self.dir = parent / f"{self.name}-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.detach = detach
        self.log_path = self.dir / f"{self.name}.log"
        self.log: IO[bytes] | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def launch(self) -> None:
        """Start the process without waiting for it (start() waits)."""
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            start_new_session=self.detach,
            preexec_fn=die_with(signal.SIGTERM) if self.detach else None,
        )

    def wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StackError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if http_get(self.url + self.ready_path, 1)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise StackError(f"{self.name} not ready at {self.url} after {timeout:.0f} s:\n{self.log_tail()}")

    def start(self, timeout: float = 30.0) -> Server:
        self.launch()
        self.wait_ready(timeout)
        return self

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            stop_proc(self.proc)
        if self.log is not None:
            self.log.close()


def prometheus_config(
    targets: Sequence[str],
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    rule_files: Sequence[str] | None = None,
    alertmanager: str | None = None,
    extra_scrape: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One `vramwatch` job scraping ``targets`` (a test's stack)."""
    job: dict[str, Any] = {
        "job_name": EXPORTER_JOB,
        "static_configs": [{"targets": list(targets)}],
        "scrape_interval": scrape_interval,
        "scrape_timeout": scrape_interval,
    }
    job.update(extra_scrape or {})
    cfg: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval},
        "scrape_configs": [job],
    }
    if rule_files:
        cfg["rule_files"] = list(rule_files)
    if alertmanager:
        cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    return cfg


def loopback_prometheus_config(
    src: dict[str, Any], base: Path, exporter: str, alertmanager: str, scrape_interval: str | None = None
) -> dict[str, Any]:
    """A shipped prometheus.yml (read from directory ``base``) for loopback: only the target and Alertmanager
    addresses, the rule paths (made absolute) and the cluster job (no cluster here; Debian's build has no
    Kubernetes discovery) change."""
    cfg = json.loads(json.dumps(src))  # a deep copy
    cfg["rule_files"] = [r if os.path.isabs(r) else str(base / r) for r in cfg.get("rule_files", [])]
    for am in cfg.get("alerting", {}).get("alertmanagers", []):
        am["static_configs"] = [{"targets": [alertmanager]}]
    jobs = []
    for job in cfg.get("scrape_configs", []):
        if "kubernetes_sd_configs" in job:
            continue
        if job["job_name"] == EXPORTER_JOB:
            job["static_configs"] = [{"targets": [exporter]}]
        jobs.append(job)
    if not any(j["job_name"] == EXPORTER_JOB for j in jobs):
        raise StackError(f"{base / 'prometheus.yml'} has no {EXPORTER_JOB!r} scrape job")
    cfg["scrape_configs"] = jobs
    if scrape_interval:  # tests only: the file's 15 s would make them wait
        cfg.setdefault("global", {})["scrape_interval"] = scrape_interval
        cfg["global"]["evaluation_interval"] = scrape_interval
        cfg["global"]["scrape_timeout"] = scrape_interval
    return cfg


class Prometheus(Server):
    """A real Prometheus with its own TSDB. Scrapes ``targets`` as job `vramwatch` (see prometheus_config),
    or runs ``config`` as given."""

    name = "prometheus"

    def __init__(
        self,
        tmp: Path,
        targets: Sequence[str] = (),
        *,
        config: dict[str, Any] | None = None,
        port: int | None = None,
        tsdb: Path | None = None,
        retention: str = "1h",
        lifecycle: bool = True,
        detach: bool = False,
        **job: Any,
    ) -> None:
        super().__init__(tmp, port, detach)
        self.config = self.dir / "prometheus.yml"
        write_yaml(self.config, config if config is not None else prometheus_config(targets, **job))
        self.tsdb = tsdb or self.dir / "data"
        self.retention = retention
        self.lifecycle = lifecycle

    def command(self) -> list[str]:
        return [
            tool("prometheus"),
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.tsdb}",
            f"--web.listen-address={self.address}",
            f"--storage.tsdb.retention.time={self.retention}",
            *(["--web.enable-lifecycle"] if self.lifecycle else []),
        ]

    def start(self, timeout: float = 30.0) -> Prometheus:
        super().start(timeout)
        return self

    def _api(self, path: str, params: dict[str, str], timeout: float = 5.0) -> list[dict[str, Any]]:
        code, body = http_get(f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params), timeout)
        data = json.loads(body)
        if data.get("status") != "success":
            raise AssertionError(f"{path} {params['query']!r} failed: {data}")
        return data["data"]["result"]

    def query(self, expr: str, time_: float | None = None, timeout: float = 5.0) -> list[dict[str, Any]]:
        params = {"query": expr}
        if time_ is not None:
            params["time"] = str(time_)
        return self._api("query", params, timeout)

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        return self._api("query_range", {"query": expr, "start": str(start), "end": str(end), "step": str(step)})

    def alerts(self, alertname: str, state: str = "firing", **labels: str) -> list[dict[str, Any]]:
        """The alerts of ``alertname`` in ``state`` (firing, pending; "" for both) whose labels include
        ``labels``, as its rule evaluation holds them (/api/v1/alerts: labels, annotations, state, value)."""
        code, body = http_get(f"{self.url}/api/v1/alerts")
        data = json.loads(body)
        if data.get("status") != "success":
            raise AssertionError(f"/api/v1/alerts failed: {data}")
        want = {"alertname": alertname, **labels}
        return [
            a
            for a in data["data"]["alerts"]
            if (not state or a["state"] == state) and all(a["labels"].get(k) == v for k, v in want.items())
        ]

    def wait_for(self, expr: str, timeout: float = 30.0, check: Callable[[list], bool] = bool) -> list:
        def attempt() -> tuple[list] | None:
            r = self.query(expr)
            return (r,) if check(r) else None  # a tuple is truthy even when r is []

        return wait_until(attempt, timeout, f"Prometheus query {expr!r}", interval=0.5)[0]


class Alertmanager(Server):
    """A real Alertmanager with ``config`` (a dict, written here, or a file used as it is); no gossip port."""

    name = "alertmanager"

    def __init__(
        self,
        tmp: Path,
        config: dict[str, Any] | Path,
        *,
        port: int | None = None,
        detach: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        super().__init__(tmp, port, detach)
        if isinstance(config, Path):
            self.config = config
        else:
            self.config = self.dir / "alertmanager.yml"
            write_yaml(self.config, config)
        self.extra_args = list(extra_args)

    def command(self) -> list[str]:
        return [
            tool("prometheus-alertmanager", "alertmanager"),
            f"--config.file={self.config}",
            f"--storage.path={self.dir / 'data'}",
            f"--web.listen-address={self.address}",
            "--cluster.listen-address=",  # no gossip port on 0.0.0.0
            *self.extra_args,
        ]

    def start(self, timeout: float = 30.0) -> Alertmanager:
        super().start(timeout)
        return self

    def alerts(self, alertname: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"filter": f'alertname="{alertname}"'})
        code, body = http_get(f"{self.url}/api/v2/alerts?{q}")
        assert code == 200, body
        return json.loads(body)

"""A small client for Prometheus's HTTP API (query, query_range, series), standard library only."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any


class PromError(RuntimeError):
    """A query Prometheus rejected, or a Prometheus that did not answer."""


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    times: list[float]
    values: list[float]


class PromClient:
    def __init__(self, url: str, timeout: float = 30.0) -> None:
        parts = urllib.parse.urlsplit(url)
        self.headers = {"Accept": "application/json"}
        if parts.username is not None:  # http://user:password@host:9090
            cred = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            self.headers["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
            netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
            parts = parts._replace(netloc=netloc)
        self.base = urllib.parse.urlunsplit(parts).rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, params: list[tuple[str, str]]) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        req = urllib.request.Request(url, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as e:  # 400 / 422 carry Prometheus's error message
            body = e.read()
            if not body.startswith(b"{"):
                raise PromError(f"{path}: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise PromError(f"{self.base} did not answer: {getattr(e, 'reason', e)}") from None
        try:
            data = json.loads(body)
        except ValueError:
            raise PromError(f"{path}: not a Prometheus API answer") from None
        if data.get("status") != "success":
            raise PromError(f"{data.get('errorType', 'error')}: {data.get('error', data)}")
        return data["data"]

    def query(self, expr: str, at: float) -> list[Series]:
        """An instant query; each series holds one point."""
        data = self._get("/api/v1/query", [("query", expr), ("time", _ts(at))])
        if data["resultType"] == "scalar":
            t, v = data["result"]
            return [Series({}, [float(t)], [float(v)])]
        if data["resultType"] != "vector":
            raise PromError(f"unexpected result type {data['resultType']}")
        return [Series(r["metric"], [float(r["value"][0])], [float(r["value"][1])]) for r in data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        data = self._get(
            "/api/v1/query_range", [("query", expr), ("start", _ts(start)), ("end", _ts(end)), ("step", _ts(step))]
        )
        return [
            Series(r["metric"], [float(t) for t, _ in r["values"]], [float(v) for _, v in r["values"]])
            for r in data["result"]
        ]

    def series(self, match: str, start: float, end: float) -> list[dict[str, str]]:
        return self._get("/api/v1/series", [("match[]", match), ("start", _ts(start)), ("end", _ts(end))])


def _ts(t: float) -> str:
    return f"{t:.3f}"

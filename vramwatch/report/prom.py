"""A small client for Prometheus's HTTP API (query, query_range, series), standard library only."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.client import HTTPMessage
from typing import IO, Any

from vramwatch.report.httpconfig import HTTPConfig, http_config, split_userinfo


class PromError(RuntimeError):
    """A query Prometheus rejected, or a Prometheus that did not answer."""


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    times: list[float]
    values: list[float]


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    # urllib would send the Authorization header and the extra headers on to any host a redirect names
    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage, newurl: str
    ) -> urllib.request.Request | None:
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if (old.scheme, old.hostname, old.port) != (new.scheme, new.hostname, new.port):
            return None  # urllib then raises the redirect as an HTTPError
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class PromClient:
    """Prometheus's HTTP API at ``url``; ``http`` carries the credentials and TLS settings.

    Without ``http``, user info in ``url`` (``http://user:password@host``) becomes basic auth.
    Credentials go into requests only: ``base`` and every error message are free of them. Raises
    ConfigError for a URL or TLS file that is no good.
    """

    def __init__(self, url: str, timeout: float = 30.0, http: HTTPConfig | None = None) -> None:
        if http is None:
            url, http = http_config(url)
        else:
            url = split_userinfo(url)[0]
        self.base = url.rstrip("/")
        self.timeout = timeout
        self._headers = {"Accept": "application/json"}
        for name, value in http.headers:  # one header of several values, as HTTP allows
            self._headers[name] = f"{self._headers[name]}, {value}" if name in self._headers else value
        handlers: list[urllib.request.BaseHandler] = [_SameOriginRedirects()]
        if self.base.startswith("https://"):
            handlers.append(urllib.request.HTTPSHandler(context=http.ssl_context()))
        self._opener = urllib.request.build_opener(*handlers)

    def __repr__(self) -> str:
        return f"PromClient({self.base!r})"

    def _get(self, path: str, params: list[tuple[str, str]]) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        req = urllib.request.Request(url, headers=self._headers)
        try:
            with self._opener.open(req, timeout=self.timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as e:  # 400 / 422 carry Prometheus's error message
            body = e.read()
            if e.code in (401, 403):
                raise PromError(f"{self.base}{path}: HTTP {e.code} (check the credentials)") from None
            if 300 <= e.code < 400:
                raise PromError(f"{self.base}{path}: HTTP {e.code}, a redirect elsewhere (not followed)") from None
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

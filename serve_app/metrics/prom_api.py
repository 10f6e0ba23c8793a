"""A small client for Prometheus's HTTP API (stdlib only): instant and range queries, label values,
targets and rules. Errors raise `PrometheusError` with Prometheus's own message."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class PrometheusError(RuntimeError):
    pass


class PrometheusAPI:
    def __init__(self, url: str = "http://127.0.0.1:9090", timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: list[tuple[str, str]] | None = None) -> Any:
        query = urllib.parse.urlencode(params or [])
        url = f"{self.url}{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # 400/422: a bad query, with Prometheus's explanation
            try:
                body = json.loads(exc.read())
            except ValueError:
                raise PrometheusError(f"{url}: HTTP {exc.code}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise PrometheusError(f"{url}: {exc}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"{path}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=self.timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def query(self, expr: str, time: float | None = None) -> list[dict[str, Any]]:
        """Instant vector: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        params = [("query", expr)] + ([("time", f"{time:.3f}")] if time is not None else [])
        data = self._get("/api/v1/query", params)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """Range matrix: [{"metric": {...}, "values": [[t, "v"], ...]}, ...]."""
        return self._get("/api/v1/query_range", [("query", expr), ("start", f"{start:.3f}"), ("end", f"{end:.3f}"),
                                                 ("step", f"{step:g}")])["result"]

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        return self._get(f"/api/v1/label/{urllib.parse.quote(label)}/values", [("match[]", match)] if match else [])

    def metric_names(self) -> list[str]:
        return self.label_values("__name__")

    def targets(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/targets", [("state", "active")])["activeTargets"]

    def rule_groups(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/rules")["groups"]

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts."""
        return self._get("/api/v1/alerts")["alerts"]

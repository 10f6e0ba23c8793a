"""`make dashboards` (dashboards/upload.py via grafana-client) against a local stand-in for Grafana's
HTTP API: no Grafana server can run here, so this checks what the script sends — the token, one
folder created once, each dashboard posted by uid with overwrite (idempotent re-runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.conftest import REPO


class FakeGrafana(BaseHTTPRequestHandler):
    folders: list[dict] = []
    dashboards: dict[str, dict] = {}
    calls: list[tuple[str, str, str]] = []

    def log_message(self, *args) -> None:  # quiet
        pass

    def _reply(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _auth(self) -> bool:
        self.calls.append((self.command, self.path, self.headers.get("Authorization", "")))
        if self.headers.get("Authorization") != "Bearer test-token":
            self._reply(401, {"message": "Unauthorized"})
            return False
        return True

    def do_GET(self) -> None:
        if self._auth():
            self._reply(200, self.folders) if self.path.startswith("/api/folders") else self._reply(404, {"message": "nope"})

    def do_POST(self) -> None:
        if not self._auth():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/api/folders":
            folder = {"id": len(self.folders) + 1, "uid": f"f{len(self.folders) + 1}", "title": body["title"]}
            self.folders.append(folder)
            self._reply(200, folder)
        elif self.path == "/api/dashboards/db":
            uid = body["dashboard"]["uid"]
            if uid in self.dashboards and not body.get("overwrite"):
                self._reply(412, {"message": "dashboard with the same uid already exists", "status": "name-exists"})
                return
            version = self.dashboards.get(uid, {}).get("version", 0) + 1
            self.dashboards[uid] = {"version": version, "payload": body}
            self._reply(200, {"status": "success", "uid": uid, "version": version, "url": f"/d/{uid}/x"})
        else:
            self._reply(404, {"message": "nope"})


@pytest.fixture()
def grafana():
    FakeGrafana.folders, FakeGrafana.dashboards, FakeGrafana.calls = [], {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGrafana)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def upload(url: str, token: str = "test-token", *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRAFANA_URL": url, "GRAFANA_TOKEN": token}
    return subprocess.run([sys.executable, "dashboards/upload.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_upload_is_idempotent_by_uid(grafana):
    first = upload(grafana)
    assert first.returncode == 0, first.stdout + first.stderr
    second = upload(grafana)
    assert second.returncode == 0, second.stdout + second.stderr
    assert list(FakeGrafana.dashboards) == ["llm-serving"]
    stored = FakeGrafana.dashboards["llm-serving"]
    assert stored["version"] == 2  # replaced in place, not duplicated
    payload = stored["payload"]
    assert payload["overwrite"] is True and payload["dashboard"]["id"] is None
    assert payload["folderUid"] == "f1" and len(FakeGrafana.folders) == 1  # folder created once
    local = json.loads((REPO / "dashboards" / "llm-serving.json").read_text())
    assert payload["dashboard"]["panels"] == local["panels"]
    assert "llm-serving.json: success uid=llm-serving version=2" in second.stdout


def test_upload_needs_url_and_valid_token(grafana):
    env = {k: v for k, v in os.environ.items() if k != "GRAFANA_URL"}
    out = subprocess.run([sys.executable, "dashboards/upload.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "GRAFANA_URL" in out.stderr
    bad = upload(grafana, token="wrong")
    assert bad.returncode != 0 and not FakeGrafana.dashboards
    assert "401" in bad.stderr or "Unauthorized" in bad.stderr

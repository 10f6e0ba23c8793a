"""Upload the dashboards in this folder to Grafana, idempotently (by uid): `make dashboards`.

    GRAFANA_URL=https://grafana.example.com GRAFANA_TOKEN=glsa_... python dashboards/upload.py [FILES...]

Each dashboard is posted with `overwrite: true` and its own `uid`, so re-running replaces it in place
(same URL, version history kept by Grafana). `--folder` puts them in a folder (created if missing).
Uses `grafana-client` (the maintained successor of `grafana-api`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def dashboard_payload(dashboard: dict[str, Any], folder_uid: str | None, message: str) -> dict[str, Any]:
    dashboard = dict(dashboard)
    if not dashboard.get("uid"):
        raise ValueError(f"dashboard {dashboard.get('title')!r} has no uid: uploads would not be idempotent")
    dashboard["id"] = None  # Grafana matches on uid; a stale numeric id would conflict
    payload: dict[str, Any] = {"dashboard": dashboard, "overwrite": True, "message": message}
    if folder_uid:
        payload["folderUid"] = folder_uid
    return payload


def ensure_folder(api: Any, title: str) -> str:
    for folder in api.folder.get_all_folders():
        if folder.get("title") == title:
            return folder["uid"]
    return api.folder.create_folder(title)["uid"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="dashboard JSON files (default: dashboards/*.json)")
    parser.add_argument("--url", default=os.environ.get("GRAFANA_URL", ""), help="Grafana URL (env GRAFANA_URL)")
    parser.add_argument("--folder", default=os.environ.get("GRAFANA_FOLDER", "LLM serving"), help="folder title ('' = General)")
    parser.add_argument("--message", default="uploaded by make dashboards")
    args = parser.parse_args(argv)
    token = os.environ.get("GRAFANA_TOKEN", "")
    if not args.url:
        parser.error("set GRAFANA_URL (e.g. http://127.0.0.1:3000) and GRAFANA_TOKEN (a service-account token)")
    files = args.files or sorted(HERE.glob("*.json"))
    if not files:
        parser.error("no dashboard JSON files")

    from grafana_client import GrafanaApi, TokenAuth

    api = GrafanaApi.from_url(args.url, credential=TokenAuth(token) if token else None)
    folder_uid = ensure_folder(api, args.folder) if args.folder else None
    for path in files:
        dashboard = json.loads(path.read_text())
        result = api.dashboard.update_dashboard(dashboard_payload(dashboard, folder_uid, args.message))
        print(f"{path.name}: {result.get('status')} uid={result.get('uid')} version={result.get('version')} "
              f"url={args.url.rstrip('/')}{result.get('url', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

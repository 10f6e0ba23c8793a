"""Per-tenant API keys (serve_app/serving/api_keys.py) through the real ASGI app with a fake LLMServer
handle: several keys from a file and from a directory (a mounted Secret), reloaded without a restart,
bad versions refused, the tenant in metrics and logs but never the key, and the fail-closed decision
(serving/exposure.py). Every check runs with the app mounted at the root and under a route prefix.
The start-up refusal through a real Ray Serve deployment is in test_fail_closed.py."""

from __future__ import annotations

import asyncio
import logging
import os

import httpx
import pytest

from serve_app.metrics.api_metrics import APIMetrics
from serve_app.serving.api import OpenAIAPI, build_fastapi_app
from serve_app.serving.api_keys import Keyring, KeyringError, parse_keys_file
from serve_app.serving.config import ServeConfig
from serve_app.serving.exposure import UnauthenticatedExposure, check_exposure, is_loopback
from tests.serving.test_api_unit import INFO, FakeHandle, ok_script

PREFIXES = ("", "/llm")
KEY_A, KEY_B = "sk-alpha-1111", "sk-beta-2222"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def client_for(keyring: Keyring, root_path: str, record=None, **config) -> httpx.AsyncClient:
    api = OpenAIAPI(FakeHandle(ok_script), ServeConfig(model="unused", api_key_env="", **config), INFO, keyring=keyring)
    app = build_fastapi_app(api, record=record)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, root_path=root_path),
                             base_url=f"http://test{root_path}", timeout=30)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_file_format_and_refusals():
    assert parse_keys_file("# tenants\nteam-a: sk-1\n\nteam_b :  sk-2 \n") == {"team-a": "sk-1", "team_b": "sk-2"}
    for bad in ("no separator", "a: ", "a b: sk-1", "a: sk 1", "a: sk-1\na: sk-2", "a: sk-1\nb: sk-1", f"{'x' * 65}: k"):
        with pytest.raises(KeyringError):
            parse_keys_file(bad)


@pytest.mark.parametrize("root_path", PREFIXES)
def test_each_tenant_key_opens_the_api_and_the_file_reloads_without_restart(tmp_path, root_path):
    keys = tmp_path / "keys"
    keys.write_text(f"team-a: {KEY_A}\n")
    clock = Clock()
    keyring = Keyring(keys_file=str(keys), reload_s=1.0, clock=clock)
    recorded: list[tuple[str, int]] = []

    async def main():
        async with client_for(keyring, root_path, record=lambda t, s: recorded.append((t, s))) as c:
            assert (await c.get("/v1/models", headers=bearer(KEY_A))).status_code == 200
            assert (await c.get("/v1/models", headers=bearer(KEY_B))).status_code == 401
            keys.write_text(f"team-a: {KEY_A}\nteam-b: {KEY_B}\n")
            os.utime(keys, ns=(1, 10**18))  # a distinct modification time, whatever the file system's resolution
            assert (await c.get("/v1/models", headers=bearer(KEY_B))).status_code == 401  # not re-read yet
            clock.now = 2.0
            assert (await c.get("/v1/models", headers=bearer(KEY_B))).status_code == 200
            keys.write_text(f"team-b: {KEY_B}\n")  # team-a revoked
            os.utime(keys, ns=(2, 2 * 10**18))
            clock.now = 4.0
            assert (await c.get("/v1/models", headers=bearer(KEY_A))).status_code == 401
            r = await c.post("/v1/completions", json={"model": INFO.name, "prompt": "hi"}, headers=bearer(KEY_B))
            assert r.status_code == 200, r.text
            assert (await c.get("/health")).status_code == 200  # the probe needs no key

    asyncio.run(main())
    assert recorded[:2] == [("team-a", 200), ("unauthenticated", 401)]
    assert ("team-b", 200) in recorded
    assert not any(KEY_A in t or KEY_B in t for t, _ in recorded)


def test_a_bad_new_version_keeps_the_old_keys_and_a_bad_first_version_refuses_to_start(tmp_path, caplog):
    keys = tmp_path / "keys"
    keys.write_text(f"team-a: {KEY_A}\n")
    clock = Clock()
    keyring = Keyring(keys_file=str(keys), reload_s=1.0, clock=clock)
    keys.write_text("team-a sk-broken\n")
    os.utime(keys, ns=(1, 10**18))
    clock.now = 2.0
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        assert keyring.tenant_for(f"Bearer {KEY_A}".encode()) == "team-a"
    assert "kept the previous 1 key(s)" in caplog.text
    assert "sk-broken" not in caplog.text and KEY_A not in caplog.text
    with pytest.raises(KeyringError):
        Keyring(keys_file=str(keys))
    with pytest.raises(KeyringError):
        Keyring(keys_file=str(tmp_path / "missing"))


def test_a_mounted_secret_directory_one_file_per_tenant(tmp_path):
    """As the kubelet mounts a Secret: files named after its entries, plus its own dot-entries."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "team-a").write_text(KEY_A + "\n")
    (secret / "team-b").write_text(KEY_B)
    (secret / "..data").mkdir()
    clock = Clock()
    keyring = Keyring(keys_file=str(secret), reload_s=1.0, clock=clock)
    assert keyring.tenants == ("team-a", "team-b")
    assert keyring.tenant_for(f"Bearer {KEY_B}".encode()) == "team-b"
    assert keyring.tenant_for(KEY_B.encode()) is None  # the header, not the bare key
    (secret / "team-b").unlink()
    clock.now = 2.0
    assert keyring.tenant_for(f"Bearer {KEY_B}".encode()) is None
    assert KEY_A not in repr(keyring.__dict__)  # only digests are kept


def test_an_empty_keys_file_lets_nobody_in(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# no tenants yet\n")
    keyring = Keyring(keys_file=str(keys))
    assert keyring.enabled and keyring.num_tenants == 0

    async def main():
        async with client_for(keyring, "") as c:
            return (await c.get("/v1/models", headers=bearer("anything"))).status_code

    assert asyncio.run(main()) == 401


def test_tenant_metrics_name_the_tenant_never_the_key():
    metrics = APIMetrics.for_registry("m")
    keyring = Keyring(env_key=KEY_A)

    async def main():
        async with client_for(keyring, "/llm", record=metrics.record) as c:
            await c.get("/v1/models", headers=bearer(KEY_A))
            await c.get("/v1/models", headers=bearer("sk-wrong"))

    asyncio.run(main())
    import prometheus_client

    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert 'llm_api_requests_total{model="m",status="200",tenant="default"} 1.0' in text
    assert 'llm_api_requests_total{model="m",status="401",tenant="unauthenticated"} 1.0' in text
    assert KEY_A not in text and "sk-wrong" not in text


def test_generation_requests_are_logged_with_their_tenant_and_not_their_key(tmp_path, caplog):
    keys = tmp_path / "keys"
    keys.write_text(f"team-a: {KEY_A}\n")

    async def main():
        async with client_for(Keyring(keys_file=str(keys)), "/llm") as c:
            r = await c.post("/v1/completions", json={"model": INFO.name, "prompt": "hi"}, headers=bearer(KEY_A))
            assert r.status_code == 200

    with caplog.at_level(logging.INFO, logger="ray.serve"):
        asyncio.run(main())
    assert "completions request from tenant team-a" in caplog.text
    assert KEY_A not in caplog.text


def test_fail_closed_decision():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        check_exposure(host, authenticated=False, allow_unauthenticated=False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "my-host", "", None):
        assert not is_loopback(host)
        with pytest.raises(UnauthenticatedExposure, match="allow_unauthenticated"):
            check_exposure(host, authenticated=False, allow_unauthenticated=False)
        check_exposure(host, authenticated=True, allow_unauthenticated=False)
        check_exposure(host, authenticated=False, allow_unauthenticated=True)

"""DNS rebinding: with auth off, a live server answers only loopback `Host` names (and --allowed-hosts);
no CORS headers are ever sent."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from serving.http.auth import host_allowed, host_name
from serving.ops.cli import UsageError, build_parser, config_from_args
from tests.serving.conftest import live_server, make_stack


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:8000", "localhost"),
        ("[::1]:80", "::1"),
        ("[::1]", "::1"),
        ("Evil.Example.", "evil.example"),
    ],
)
def test_host_name(header: str, name: str) -> None:
    assert host_name(header) == name


def test_loopback_names_only_unless_added() -> None:
    for ok in ("localhost", "localhost:1", "127.0.0.1", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST"):
        assert host_allowed(ok), ok
    for bad in ("evil.example", "evil.example:8000", "localhost.evil.example", "10.0.0.1", "", "0.0.0.0"):
        assert not host_allowed(bad), bad
    assert host_allowed("box.lan:8000", {"box.lan"})


def test_no_auth_refuses_a_foreign_host(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, auth=False)
    stack.store.add("demo", "I live in Lisbon.")
    with live_server(stack.app) as url:
        for method, path in [("GET", "/v1/memories?user_id=demo"), ("DELETE", "/v1/memories?user_id=demo")]:
            r = httpx.request(method, url + path, headers={"Host": "rebound.evil.example"}, timeout=10)
            assert r.status_code == 403, (method, r.text)
            assert r.json()["error"]["code"] == "host_not_allowed"
            assert "rebound.evil.example" in r.json()["error"]["message"]
        assert stack.store.count("demo") == 1  # nothing was deleted
        port = url.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost"):
            r = httpx.get(url + "/v1/memories?user_id=demo", headers={"Host": host}, timeout=10)
            assert r.status_code == 200 and r.json()["total"] == 1, host
    stack.scheduler.stop()


def test_allowed_hosts_adds_names(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, auth=False, allowed_hosts=("Box.LAN",))
    with live_server(stack.app) as url:
        assert httpx.get(url + "/v1/models", headers={"Host": "box.lan:8000"}, timeout=10).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"Host": "other.lan"}, timeout=10).status_code == 403
    stack.scheduler.stop()


def test_auth_on_does_not_check_the_host(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, auth=True)
    with live_server(stack.app) as url:
        r = httpx.get(url + "/v1/models", headers={"Host": "api.example.com"}, timeout=10)
        assert r.status_code == 401  # the key is what guards it
    stack.scheduler.stop()


def test_no_cors_headers(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, auth=False)
    with live_server(stack.app) as url:
        origin = {"Origin": "https://evil.example"}
        preflight = httpx.options(
            url + "/v1/memories",
            headers={**origin, "Access-Control-Request-Method": "DELETE"},
            timeout=10,
        )
        get = httpx.get(url + "/v1/memories?user_id=demo", headers=origin, timeout=10)
        for r in (preflight, get):
            assert [h for h in r.headers if h.lower().startswith("access-control-")] == []
    stack.scheduler.stop()


def test_allowed_hosts_flag(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--no-auth", "--allowed-hosts", "a.lan, B.lan"])
    assert config_from_args(args).allowed_hosts == ("a.lan", "b.lan")
    with pytest.raises(UsageError, match="allowed_hosts"):
        config_from_args(build_parser().parse_args(["serve", "--allowed-hosts", "a.lan:80"]))

"""Which replica answered: every response carries `X-Kvmem-Replica` (successes, errors, auth failures, unknown
routes, a body too large), and /metrics names the replica, so a scrape of several replicas tells them apart."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from serving.config import ServingConfig
from serving.ops.cli import build_parser, config_from_args
from tests.serving.conftest import ALICE, MODEL, make_stack


def test_every_response_names_the_replica(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, replica_id="r2")
    chat = {"model": MODEL, "user": "alice", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(stack.app) as client:
        answers = {
            "chat": client.post("/v1/chat/completions", json=chat, headers=ALICE),
            "no key": client.post("/v1/chat/completions", json=chat),
            "bad body": client.post("/v1/chat/completions", json={"model": MODEL}, headers=ALICE),
            "unknown route": client.get("/nowhere"),
            "too large": client.post(
                "/v1/memories", content=b"x" * (stack.config.limits.max_body_bytes + 1), headers=ALICE
            ),
            "health": client.get("/health"),
            "metrics": client.get("/metrics"),
        }
    stack.scheduler.stop()
    assert {name: (r.status_code, r.headers.get("x-kvmem-replica")) for name, r in answers.items()} == {
        "chat": (200, "r2"),
        "no key": (401, "r2"),
        "bad body": (400, "r2"),
        "unknown route": (404, "r2"),
        "too large": (413, "r2"),
        "health": (200, "r2"),
        "metrics": (200, "r2"),
    }
    assert 'kvmem_replica_info{replica="r2"} 1\n' in answers["metrics"].text


def test_replica_defaults_to_host_and_port(tmp_path: Path) -> None:
    assert ServingConfig(data_dir=tmp_path, port=8123).replica == f"{socket.gethostname()}:8123"
    assert ServingConfig(data_dir=tmp_path, port=8123, replica_id="gpu-3").replica == "gpu-3"


@pytest.mark.parametrize("bad", ["has space", "a" * 65, 'quo"te', "é"])
def test_a_bad_replica_id_is_refused_naming_it(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="replica_id must be at most 64"):
        ServingConfig(data_dir=tmp_path, replica_id=bad)


def test_the_cli_flag_sets_it(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--data-dir", str(tmp_path), "--replica-id", "r7"])
    assert config_from_args(args).replica == "r7"

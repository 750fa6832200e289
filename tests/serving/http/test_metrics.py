"""/metrics is unauthenticated: after many distinct failing requests (odd methods, unknown paths, memory ids,
unusable KV blocks of many users) every label takes its value from a fixed set, and no id or path shows."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from serving.backends.base import KV_FALLBACK_KINDS
from serving.http.metrics import Metrics
from tests.serving.conftest import MODEL, make_stack

_LABELS = re.compile(r"^(\w+)\{(.*)\} \S+$")


def labels(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """(metric name, its labels) of every labelled sample, histogram buckets left out."""
    out = set()
    for line in text.splitlines():
        m = _LABELS.match(line)
        if m and not m.group(1).endswith("_bucket"):
            out.add((m.group(1), tuple(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2)))))
    return out


def test_metrics_labels_stay_a_fixed_set_after_many_distinct_failures(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, auth=False)
    secrets: list[str] = []  # ids and paths that must not reach /metrics
    with TestClient(stack.app) as client:
        for i in range(6):  # a block per user, each made unusable: corrupt for even users, dropped for odd
            user = f"user-{i}-x9"
            stack.store.add(user, text=f"{user} keeps bees")
            stack.scheduler.get(user)
            stack.scheduler.flush()
            block = stack.scheduler.get(user).block
            item_id = None if block is None else block.item_id
            assert item_id is not None
            (stack.backend.corrupt if i % 2 == 0 else stack.backend.drop_block)(item_id)
            body = {"model": MODEL, "user": user, "messages": [{"role": "user", "content": "bees?"}]}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            secrets += [item_id, user]
        for i in range(20):
            memory_id = f"deadbeef{i:04d}cafe"
            path = f"/secret/dir-{i}/{memory_id}"
            assert client.get(f"/v1/memories/{memory_id}", params={"user_id": "alice"}).status_code == 404
            assert client.get(path).status_code == 404
            assert client.request(f"BREW{i}", "/v1/models").status_code == 405
            assert client.request(f"X{i}", path).status_code == 404
            secrets += [memory_id, path, f"dir-{i}", f"BREW{i}"]
        text = client.get("/metrics").text
    stack.scheduler.stop()

    assert {(name, lbl) for name, lbl in labels(text) if name == "kvmem_requests_total"} == {
        ("kvmem_requests_total", (("method", m), ("route", r), ("status", s)))
        for m, r, s in [
            ("POST", "/v1/chat/completions", "200"),
            ("GET", "/v1/memories/{memory_id}", "404"),
            ("GET", "unmatched", "404"),
            ("other", "/v1/models", "405"),
            ("other", "unmatched", "404"),
        ]
    }
    assert 'kvmem_requests_total{method="GET",route="unmatched",status="404"} 20' in text
    assert 'kvmem_requests_total{method="other",route="unmatched",status="404"} 20' in text
    fallbacks = re.findall(r'^kvmem_kv_fallbacks_total\{reason="([^"]*)"\} (\d+)$', text, flags=re.M)
    assert fallbacks == sorted(
        # Scheduler.get no longer asks the store on the request path (hardening item 4): a dropped block reaches
        # the backend and falls back as not_found, a corrupt one as corrupt; every kind is still rendered, at 0
        (kind, {"corrupt": "3", "not_found": "3"}.get(kind, "0"))
        for kind in KV_FALLBACK_KINDS
    )
    assert {lbl for name, lbl in labels(text) if name == "kvmem_memory_tier_hits_total"} == {
        (("tier", t),) for t in ("kv", "lora", "text")
    }
    assert [s for s in secrets if s in text] == []


def test_unknown_fallback_reasons_methods_and_routes_fall_into_fixed_buckets() -> None:
    metrics = Metrics()
    metrics.set_routes(["/v1/models"])
    metrics.observe_generation(10, 0, "KVItemNotFound: KV item kv-0123 at /data/kv/kv-0123 is not stored")
    metrics.observe_generation(10, 0, "fingerprint_mismatch")
    metrics.observe_request("GET", "/v1/models", 200)
    metrics.observe_request("GET", "/mounted/kv-0123", 200)
    metrics.observe_request("PROPFIND", "/v1/models", 405)
    text = metrics.render()
    assert "kv-0123" not in text and "PROPFIND" not in text
    assert 'kvmem_kv_fallbacks_total{reason="other"} 1' in text
    assert 'kvmem_kv_fallbacks_total{reason="fingerprint_mismatch"} 1' in text
    assert [line for line in text.splitlines() if line.startswith("kvmem_requests_total{")] == [
        'kvmem_requests_total{method="GET",route="/v1/models",status="200"} 1',
        'kvmem_requests_total{method="GET",route="unmatched",status="200"} 1',
        'kvmem_requests_total{method="other",route="/v1/models",status="405"} 1',
    ]

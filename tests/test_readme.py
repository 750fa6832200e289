"""The README's quick tour runs as written (its URLs pointed at a live test server), so it cannot rot.

Fake backend: this checks the documented calls and shapes, not the model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from serving.backends.fake import FakeBackend
from serving.config import ServingConfig
from serving.http.app import create_app
from tests.serving.conftest import live_server, wait_for

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("readme")
    backend = FakeBackend(reply="You live in Lisbon.")
    app = create_app(
        ServingConfig(data_dir=data, backend="fake", auth=False, seed_demo=True), backend=backend
    )
    with live_server(app) as url:
        wait_for(lambda: app.state.store.count("demo") > 0, "demo user seeded")
        yield url


def test_quick_tour_curl_calls(server):
    (tour,) = [b for b in blocks("bash") if "curl" in b and "/v1/chat/completions" in b]
    script = tour.replace("http://127.0.0.1:8000", server)
    calls = [c for c in re.split(r"\n(?=curl )", script.strip()) if c.startswith("curl")]
    assert len(calls) == 3
    outputs = []
    for call in calls:
        call = "\n".join(line for line in call.splitlines() if not line.lstrip().startswith("#"))
        proc = subprocess.run(["bash", "-c", call], capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        outputs.append(json.loads(proc.stdout))
    chat, added, plan = outputs
    assert (
        chat["object"] == "chat.completion"
        and chat["choices"][0]["message"]["content"] == "You live in Lisbon."
    )
    assert "cached_tokens" in chat["usage"]["prompt_tokens_details"] and "memory" in chat
    assert added["memories"][0]["text"] == "I started learning the violin in March."
    assert set(plan) >= {"block", "adapter", "updated_at"}


def test_quick_tour_python_client(server):
    (code,) = [b for b in blocks("python") if "OpenAI(" in b]
    code = code.replace("http://127.0.0.1:8000", server)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("You live in Lisbon.\ncached prompt tokens: ")

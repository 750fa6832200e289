"""The `kvmem` CLI's argument handling, the config's validation and the backend registry."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serving.backends import BackendError, create_backend, supported_backends
from serving.backends.fake import FakeBackend
from serving.config import ServingConfig
from serving.ops.cli import build_parser, config_from_args, how_to_call, main


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve", "--port", "abc"], "--port"),
        (["serve", "--port", "70000"], "port must be in [0, 65535], got 70000"),
        (["serve", "--no-auth", "--host", "0.0.0.0"], "only allowed on a loopback host"),
        (["serve", "--backend", "tensorrt"], "--backend"),
        (["serve", "--queue-size", "0"], "queue_size must be >= 1, got 0"),
        (["serve", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["serve", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["serve", "--backend", "vllm", "--device", "cuda"], "the vllm backend takes device auto or cpu"),
        (["frobnicate"], "invalid choice"),
        (["serve", "--planner", "standin"], "unrecognized arguments: --planner standin"),  # one plan pipeline
        ([], "command"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_missing_keys_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--backend", "fake", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "api_keys.json" in err and "--no-auth" in err


def test_python_m_serving_takes_the_serve_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "serving", "--port", "nope"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "--port" in out.stderr


def test_serve_args_become_a_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", "--no-auth", "--port", "0", "--data-dir", str(tmp_path), "--backend", "fake", "--demo"]
    )
    config = config_from_args(args)
    assert config == ServingConfig(
        port=0, data_dir=tmp_path, backend="fake", auth=False, seed_demo=True, freeze_heap=True
    )
    assert "http://127.0.0.1:0/v1/chat/completions" in how_to_call(config, "m")
    assert "Authorization" not in how_to_call(config, "m")


def test_registry() -> None:
    assert supported_backends() == ("fake", "transformers", "vllm")
    assert isinstance(create_backend(ServingConfig(backend="fake", queue_size=3)), FakeBackend)
    with pytest.raises(ValueError, match="supported: fake, transformers, vllm"):
        create_backend(_with_backend("nope"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_without_the_package_is_a_clear_error() -> None:
    with pytest.raises(BackendError, match="pip install 'kvmem\\[vllm\\]'"):
        create_backend(ServingConfig(backend="vllm"))


def _with_backend(name: str) -> ServingConfig:
    config = ServingConfig(backend="fake")
    object.__setattr__(config, "backend", name)  # bypass validation to reach the registry's own check
    return config


def _serve_fake(tmp_path: Path, port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "serving", "--no-auth", "--backend", "fake", "--port", str(port)]
    return subprocess.Popen(
        [*argv, "--data-dir", str(tmp_path), "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_serve_port_0_prints_the_port_it_listens_on(tmp_path: Path) -> None:
    import httpx

    proc = _serve_fake(tmp_path, 0)
    try:
        first = proc.stdout.readline()
        assert first.startswith("kvmem: serving 'kvmem-fake' at http://127.0.0.1:") and ":0/" not in first
        base = first.split(" at ", 1)[1].strip()
        assert httpx.get(base.removesuffix("/v1") + "/health", timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_printed_port_already_listens_so_a_client_at_once_is_not_refused() -> None:
    """`kvmem serve` prints its URL before uvicorn's start-up; the socket listens from then on, so a client
    that connects at once waits in the backlog (CI saw 'connection refused' while it only was bound)."""
    import socket

    from serving.ops.cli import _bind

    sock = _bind("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        with socket.create_connection(sock.getsockname(), timeout=5):  # queued, not refused
            pass
    finally:
        sock.close()


def test_serve_on_a_port_in_use_is_a_usage_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve_fake(tmp_path, port)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
@pytest.mark.parametrize("command", ["serve", "build"])
def test_cuda_without_a_gpu_exits_2_naming_the_flag(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "in.jsonl").write_text("")
    argv = {
        "serve": ["serve", "--no-auth", "--data-dir", str(tmp_path), "--device", "cuda"],
        "build": ["build", "--input", str(tmp_path / "in.jsonl"), "--device", "cuda"],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda" in err and "CUDA is not available" in err


def test_device_and_dtype_reach_the_transformers_backend(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", "--data-dir", str(tmp_path), "--device", "cpu", "--dtype", "bfloat16"]
    )
    config = config_from_args(args)
    assert (config.device, config.dtype) == ("cpu", "bfloat16")
    backend = create_backend(config)  # not loaded: no weights read
    assert (backend.config.device, backend.config.dtype) == ("cpu", "bfloat16")
    defaults = config_from_args(build_parser().parse_args(["serve"]))
    assert (defaults.device, defaults.dtype) == ("auto", "auto")
    assert backend.config.cuda_graphs and defaults.cuda_graphs
    eager = config_from_args(build_parser().parse_args(["serve", "--no-cuda-graphs"]))
    assert not eager.cuda_graphs and not create_backend(eager).config.cuda_graphs


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm backend needs vllm")
@pytest.mark.parametrize(
    ("flag", "dtype"), [("bfloat16", "bfloat16"), ("float16", "float16"), ("auto", "float32")]
)
def test_dtype_reaches_the_vllm_backend_and_auto_keeps_its_default(
    tmp_path: Path, flag: str, dtype: str
) -> None:
    args = build_parser().parse_args(
        ["serve", "--data-dir", str(tmp_path), "--backend", "vllm", "--dtype", flag]
    )
    backend = create_backend(config_from_args(args))  # not loaded: no weights read, no engine started
    assert backend.config.dtype == dtype


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(["--device", "gpu"], "argument --device: invalid choice: 'gpu'"), (["--dtype", "half"], "--dtype")],
)
def test_build_takes_the_same_device_and_dtype_choices(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exc:  # kvmem build's own parser: usage and exit 2
        main(["build", "--input", "x", *flags])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_kvmem_serve_freezes_the_loaded_heap_and_an_embedded_app_does_not(tmp_path: Path) -> None:
    """`kvmem serve` owns its process: once the model is loaded, what is alive then leaves the cyclic GC's
    reach (a full collection of a loaded server held the GIL ~0.2 s, stalling every stream). An app built
    inside another process (these tests) leaves that process's heap alone."""
    import gc
    import time

    from fastapi.testclient import TestClient

    from tests.serving.conftest import make_stack

    assert config_from_args(build_parser().parse_args(["serve"])).freeze_heap is True
    gc.unfreeze()
    for sub in ("plain", "served"):
        (tmp_path / sub).mkdir()
    with TestClient(make_stack(tmp_path / "plain").app) as client:
        assert client.get("/health").status_code == 200
        time.sleep(0.2)
        assert gc.get_freeze_count() == 0
    try:
        with TestClient(make_stack(tmp_path / "served", freeze_heap=True).app):
            deadline = time.monotonic() + 30
            while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert gc.get_freeze_count() > 1000  # the modules and the app at least
    finally:
        gc.unfreeze()


def test_python_m_serving_ops_cli_provision_demo_names_the_provisioned_demo_model(tmp_path: Path) -> None:
    """`python -m serving.ops.cli` is the `kvmem` command (it used to exit 0 doing nothing), and `provision --demo`
    provisions the demo model: here one already provisioned (its done marker names the pinned sha256), so it
    returns at once with its path."""
    import json
    import os

    from kvmem.models import _PROVISION_MARKER, DEMO_GGUF_SHA256, DEMO_MODEL_NAME

    target = tmp_path / "models" / DEMO_MODEL_NAME
    target.mkdir(parents=True)
    (target / _PROVISION_MARKER).write_text(json.dumps({"sha256": DEMO_GGUF_SHA256}))
    out = subprocess.run(
        [sys.executable, "-m", "serving.ops.cli", "provision", "--demo"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KVMEM_CACHE_DIR": str(tmp_path)},
    )
    assert (out.returncode, out.stdout) == (0, f"kvmem: demo model ready at {target}\n")

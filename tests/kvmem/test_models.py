"""Model loading and provisioning: idempotent provisioning, clear errors for bad paths and dtypes."""

from __future__ import annotations

import json

import pytest
import torch

from kvmem.errors import ModelLoadError, ProvisionError
from kvmem.models import load_model, parse_dtype, provision


def test_provision_is_idempotent_and_verified(default_model_dir):
    marker = json.loads((default_model_dir / "kvmem_provision.json").read_text())
    assert marker["max_logit_diff"] <= 1e-4
    mtime = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    assert provision() == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == mtime  # not redone


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "missing-model"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"))


def test_bad_dtype_names_supported_ones():
    with pytest.raises(ModelLoadError, match="unknown dtype 'fp8'"):
        parse_dtype("fp8", "cpu")
    assert parse_dtype(None, "cpu") == torch.float32 and parse_dtype(None, "cuda") == torch.bfloat16


def test_unwritable_cache_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file, not a directory")
    with pytest.raises(ProvisionError, match="not writable"):
        provision(blocker, force=True)


@pytest.mark.slow
def test_default_model_answers_like_the_gguf_original(default_handle):
    """The converted checkpoint greedy-answers a known prompt exactly as the GGUF model did (recorded once)."""
    tok = default_handle.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    out = default_handle.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert tok.decode(out[0, len(ids) :], skip_special_tokens=True) == "The capital of France is Paris."

"""benchmarks/gpu/gpu_model.py: where the default model cannot be provisioned (a GPU machine with no network), it
writes random weights of the default model's shape with the carried tokenizer; without a tokenizer it says
what to give."""

from __future__ import annotations

import json

import pytest


def test_random_weights_of_the_default_shape_when_the_model_cannot_be_provisioned(
    tmp_path, monkeypatch, default_model_dir
):
    import kvmem.models
    from benchmarks.gpu import gpu_model

    def offline(*_a, **_k):
        raise RuntimeError("no network")

    monkeypatch.setattr(kvmem.models, "provision", offline)
    with pytest.raises(SystemExit, match="give --tokenizer"):
        gpu_model.main(["--out", str(tmp_path / "none")])
    info = gpu_model.main(["--out", str(tmp_path / "m"), "--tokenizer", str(default_model_dir)])
    assert info["model"].startswith("SmolLM2-135M shape, random weights")
    mine = json.loads((tmp_path / "m" / "config.json").read_text())
    real = json.loads((default_model_dir / "config.json").read_text())
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert mine[key] == real[key], key

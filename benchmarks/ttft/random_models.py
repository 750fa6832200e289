"""Model shapes with seeded random weights, for TTFT where the real model cannot be downloaded.

Owns the presets (Qwen3-8B's shape, the MemOS table's model; the default model's) and building a handle of
one: TTFT depends on the shape, not the values. Knows nothing of the grid or of timing.
"""

from __future__ import annotations

import os

import torch

RANDOM_PRESETS = {
    # Qwen3-8B's shape (the model of MemOS's table) with seeded random weights: TTFT depends on the shape,
    # not the values, so this reproduces the compute of the MemOS cells without downloading the model.
    # the default model's shape (SmolLM2-135M): benchmarks/gpu/gpu_model.py on a machine that cannot provision it
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
}


def random_handle(preset: str, device: str, dtype: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvmem.models import handle_for, parse_dtype, provision

    if preset not in RANDOM_PRESETS:
        raise SystemExit(f"unknown --random-preset {preset!r}; supported: {', '.join(RANDOM_PRESETS)}")
    # KVMEM_TOKENIZER_DIR: a tokenizer carried to a machine that cannot provision the default model
    tokenizer = AutoTokenizer.from_pretrained(os.environ.get("KVMEM_TOKENIZER_DIR") or str(provision()))
    spec = dict(RANDOM_PRESETS[preset])
    config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=len(tokenizer), **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=parse_dtype(dtype, device)).eval()
    return handle_for(model, tokenizer, model_id=f"{preset}-random", weights_digest=f"random:{preset}:seed0")

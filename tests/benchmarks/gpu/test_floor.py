"""benchmarks/gpu/floor.py: the arithmetic of a step's floor (bytes over bandwidth, FLOPs over the dense peak),
the card table's matching, and a model's shape as counted from its parameters."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.gpu.floor import CARDS, Shape, card_of, floor, shape_of, step_cost

# Qwen3-8B-like numbers, small enough to check by hand
SHAPE = Shape(
    weight_bytes=16_000_000_000,
    matmul_params=8_000_000_000,
    layers=36,
    q_heads=32,
    kv_heads=8,
    head_dim=128,
    kv_bytes_per_element=2,
)


def test_cards_are_matched_on_their_torch_names():
    assert card_of("NVIDIA H200") == "H200"
    assert card_of("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert card_of("NVIDIA H100 SXM5 80GB") == "H100 SXM"
    assert card_of("NVIDIA H100 PCIe") is None and card_of("NVIDIA H100 NVL") is None
    assert card_of("NVIDIA A100-SXM4-80GB") is None and card_of("cpu") is None
    assert CARDS == {"H100 SXM": (3.35e12, 989e12), "H200": (4.8e12, 989e12)}


def test_a_decode_steps_bytes_and_flops():
    kv = 2 * 36 * 8 * 128 * 2  # K and V, every layer, bf16: 147,456 bytes a token
    assert SHAPE.kv_bytes_per_token == kv == 147_456
    nbytes, flops = step_cost(SHAPE, [100, 300])  # two rows, one new token each
    # weights once; each row reads its cache and its new token's K/V, and writes the new K/V
    assert nbytes == 16_000_000_000 + (101 + 301) * kv + 2 * kv
    # 2 FLOPs a multiply-add per token; attention: 4 x 36 x 32 x 128 per (query, key), keys = context + itself
    assert flops == 2 * 8_000_000_000 * 2 + 4 * 36 * 32 * 128 * (101 + 301)


def test_a_prefill_chunk_attends_causally():
    nbytes, flops = step_cost(SHAPE, [10], [3])  # 3 new tokens over 10 cached: 11 + 12 + 13 keys
    assert flops == 2 * 8_000_000_000 * 3 + 4 * 36 * 32 * 128 * 36
    assert nbytes == 16_000_000_000 + 13 * SHAPE.kv_bytes_per_token + 3 * SHAPE.kv_bytes_per_token
    # a block of 50 tokens both rows share is read once, and attended by both
    nbytes, flops = step_cost(SHAPE, [10, 20], shared=50)
    assert nbytes == 16_000_000_000 + (50 + 11 + 21) * SHAPE.kv_bytes_per_token + 2 * SHAPE.kv_bytes_per_token
    assert flops == 2 * 8_000_000_000 * 2 + 4 * 36 * 32 * 128 * (61 + 71)
    with pytest.raises(ValueError, match="must be as long"):
        step_cost(SHAPE, [10, 2], [3])


def test_the_floor_is_the_larger_bound_and_the_ratio_is_measured_over_it():
    out = floor(4_800_000_000, 989_000_000_000, "NVIDIA H200", measured_s=0.004)
    assert out["bandwidth_s"] == pytest.approx(1e-3) and out["compute_s"] == pytest.approx(1e-3)
    out = floor(9_600_000_000, 989_000_000_000, "NVIDIA H200", measured_s=0.004)
    assert out["card"] == "H200" and out["bound"] == "bandwidth"
    assert out["floor_s"] == pytest.approx(2e-3) and out["measured_over_floor"] == pytest.approx(2.0)
    out = floor(3_350_000_000, 9_890_000_000_000, "NVIDIA H100 80GB HBM3", measured_s=0.02)
    assert out["bound"] == "compute" and out["floor_s"] == pytest.approx(0.01)
    assert out["measured_over_floor"] == pytest.approx(2.0)
    unknown = floor(1, 1, "cpu", measured_s=1.0)
    assert unknown["card"] is None and unknown["floor_s"] is None and unknown["measured_over_floor"] is None
    assert unknown["bytes"] == 1 and unknown["flops"] == 1


@pytest.mark.parametrize("tied", [False, True])
def test_a_models_shape_counts_the_weights_a_step_reads(tied):
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    shape = shape_of(model)
    per_layer = 32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * (32 * 64)  # q, k, v, o; gate, up, down
    matmul = 2 * per_layer + 100 * 32  # the output head
    norms = 2 * (2 * 32 + 2 * 8) + 32  # two norms a layer and q/k norms (head_dim), the final norm
    assert shape.matmul_params == matmul
    # the input table is not read whole; tied, it is the head, read once
    assert shape.weight_bytes == 2 * (matmul + norms)
    assert (shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim, shape.kv_bytes_per_element) == (
        2,
        4,
        2,
        8,
        2,
    )

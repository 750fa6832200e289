"""`--engine-layers auto|generic` (issue 43 item 2): the transformers backend runs the engine's own layers
(serving/engine/models) for a model of the Llama family by default, and the HF forward when told; the flag
reaches the backend from the CLI, and a bad value is refused naming it."""

from __future__ import annotations

import asyncio

import pytest

from kvmem.kv import Sampling, generate
from serving.backends import create_backend
from serving.backends.base import GenerationRequest, SamplingParams
from serving.backends.transformers.backend import TransformersBackendConfig
from serving.config import ServingConfig
from serving.engine import models
from serving.ops.cli import UsageError, build_parser, config_from_args
from tests.serving.backends.test_transformers_backend import tokens_of
from tests.serving.kvstack import load_backend

MEMORIES = [
    "I live in Lisbon with my sister.",
    "My dog is a golden retriever called Miso.",
    "I am allergic to peanuts.",
]


def served_and_full(backend, block, max_new: int) -> tuple[list[int], list[int], int]:
    """A request over `block` (memory KV the engine built): (its greedy tokens, a full prefill's by the HF
    forward with no cache, its cached_tokens)."""
    question = [{"role": "user", "content": "What is my dog called, and where do I live?"}]
    prompt = backend.layout_prompt(MEMORIES, [], question, block.token_ids)
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    ids, result = asyncio.run(
        tokens_of(backend, GenerationRequest("r", "alice", prompt, block.item_id, sampling))
    )
    model = backend.handle.model
    full = backend._loop.call(
        lambda: list(generate(model, prompt.ids, sampling=Sampling(max_new_tokens=max_new)))
    )
    return ids, full, result.cached_tokens


@pytest.mark.slow
def test_the_server_runs_the_default_model_on_the_fast_layers_and_memory_kv_equals_a_full_prefill(
    default_model_dir, tmp_path
):
    """SmolLM2 in float32 on CPU through the production backend, --engine-layers auto (the default): its steps
    run the engine's own layers (the decoder's step counter counts the request's forwards: one prefill of what
    follows the block, then a decode step a token), and the greedy tokens of a request reading its block's KV
    equal a full prefill's."""
    backend = load_backend(default_model_dir, tmp_path, device="cpu", dtype="float32")
    try:
        decoder = models.fast_for(backend.handle.model)
        assert (
            backend.config.engine_layers == "auto" and backend.engine_path == "fast" and decoder is not None
        )
        block = backend.build_block("alice", MEMORIES, ["m1", "m2", "m3"])  # on the fast layers too
        before = decoder.steps
        ids, full, cached = served_and_full(backend, block, 12)
        assert len(ids) == 12 and ids == full and cached == block.num_tokens > 0
        assert decoder.steps - before == 12
    finally:
        asyncio.run(backend.aclose())


def test_engine_layers_generic_runs_the_hf_forward_with_the_same_tokens(tiny_model_dir, tmp_path):
    """The tiny llama qualifies for the fast layers: auto takes them, generic does not (no decoder registered),
    and both serve a request over memory KV with a full prefill's greedy tokens."""
    got = {}
    for choice in ("auto", "generic"):
        backend = load_backend(tiny_model_dir, tmp_path / choice, engine_layers=choice)
        try:
            fast = models.fast_for(backend.handle.model)
            assert backend.engine_path == {"auto": "fast", "generic": "generic"}[choice]
            assert (fast is not None) == (choice == "auto")
            block = backend.build_block("alice", MEMORIES, ["m1", "m2", "m3"])
            ids, full, cached = served_and_full(backend, block, 8)
            assert len(ids) == 8 and ids == full and cached == block.num_tokens > 0
            got[choice] = ids
        finally:
            asyncio.run(backend.aclose())
    assert got["auto"] == got["generic"]


def test_the_engine_layers_flag_reaches_the_backend_and_a_bad_value_is_refused(tmp_path):
    parse = build_parser().parse_args
    default = create_backend(config_from_args(parse(["serve", "--data-dir", str(tmp_path)])))
    assert default.config.engine_layers == "auto"
    generic = config_from_args(parse(["serve", "--data-dir", str(tmp_path), "--engine-layers", "generic"]))
    assert generic.engine_layers == "generic" and create_backend(generic).config.engine_layers == "generic"
    with pytest.raises(UsageError) as bad_flag:
        parse(["serve", "--engine-layers", "fast"])
    assert str(bad_flag.value) == (
        "kvmem serve: argument --engine-layers: invalid choice: 'fast' (choose from 'auto', 'generic')"
    )
    with pytest.raises(ValueError) as bad:
        TransformersBackendConfig(engine_layers="fast")
    assert str(bad.value) == "TransformersBackendConfig.engine_layers must be 'auto' or 'generic', got 'fast'"
    with pytest.raises(ValueError) as bad_config:
        ServingConfig(data_dir=tmp_path, engine_layers="fast")
    assert str(bad_config.value) == "engine_layers must be one of auto, generic, got 'fast'"

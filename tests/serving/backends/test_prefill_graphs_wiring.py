"""`--prefill-graphs auto|on|off` (issue 43 item 3): the transformers backend runs a lone prefill chunk through
serving/engine/prefill_graphs.py (padded to a bucket over static buffers; replayed from a CUDA graph on a GPU).
On CPU it is off by default and `on` forces it: through the server's own backend, requests of different lengths
over a block's injected KV give a full prefill's greedy tokens, and their chunks took the static path."""

from __future__ import annotations

import asyncio

import pytest

from kvmem.kv import Sampling, generate
from serving.backends import create_backend
from serving.backends.base import GenerationRequest, SamplingParams
from serving.backends.transformers.backend import TransformersBackendConfig
from serving.config import ServingConfig
from serving.engine.prefill_graphs import PrefillGraphs
from serving.ops.cli import UsageError, build_parser, config_from_args
from tests.serving.backends.test_transformers_backend import tokens_of
from tests.serving.kvstack import load_backend

MEMORIES = [
    "I live in Lisbon with my sister.",
    "My dog is a golden retriever called Miso.",
    "I am allergic to peanuts.",
]
QUESTIONS = [  # prompts of different lengths after the block: different token buckets
    "Where do I live?",
    "What is my dog called, and what breed is he? Tell me in one sentence please.",
    "I am planning a dinner party next week for my sister and some friends from work; given what you "
    "know about me, which dishes should I avoid cooking, and is there anything about my dog I should "
    "keep in mind while the guests are in the house all evening?",
]


def test_prefill_graphs_on_serves_injected_kv_with_a_full_prefills_tokens_on_cpu(tiny_model_dir, tmp_path):
    backend = load_backend(tiny_model_dir, tmp_path, prefill_graphs="on")
    try:
        graphs = backend.pool.prefill_graphs
        assert isinstance(graphs, PrefillGraphs) and not graphs.capture and graphs.replays == 0
        block = backend.build_block("alice", MEMORIES, ["m1", "m2", "m3"])  # its chunks: lone chunks too
        model, lengths = backend.handle.model, []
        for n, question in enumerate(QUESTIONS):
            turns = [{"role": "user", "content": question}]
            prompt = backend.layout_prompt(MEMORIES, [], turns, block.token_ids)
            sampling = SamplingParams(max_new_tokens=6 + n, temperature=0.0)
            before = graphs.steps
            ids, result = asyncio.run(
                tokens_of(backend, GenerationRequest(f"r{n}", "alice", prompt, block.item_id, sampling))
            )
            full = backend._loop.call(
                lambda p=prompt, k=6 + n: list(generate(model, p.ids, sampling=Sampling(max_new_tokens=k)))
            )
            assert len(ids) == 6 + n and ids == full
            # the block's KV at least (a later request also reuses the full pages of the one before)
            assert result.cached_tokens >= block.num_tokens > 0
            # the query after the block ran as one static chunk (it is under prefill_chunk_tokens)
            assert graphs.steps - before == 1
            lengths.append(len(prompt.ids) - result.cached_tokens)
        assert len(set(lengths)) == 3
        assert {q for q, _ in graphs.buckets} >= {16, 32, 64} and graphs.replays == 0
    finally:
        asyncio.run(backend.aclose())


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_prefill_graphs_are_off_on_cpu_unless_forced(tiny_model_dir, tmp_path, mode):
    backend = load_backend(tiny_model_dir, tmp_path, prefill_graphs=mode)
    try:
        assert backend.pool.prefill_graphs is None
    finally:
        asyncio.run(backend.aclose())


def test_the_prefill_graphs_flag_reaches_the_backend_and_a_bad_value_is_refused(tmp_path):
    parse = build_parser().parse_args
    default = create_backend(config_from_args(parse(["serve", "--data-dir", str(tmp_path)])))
    assert default.config.prefill_graphs == "auto"
    for mode in ("on", "off"):
        config = config_from_args(parse(["serve", "--data-dir", str(tmp_path), "--prefill-graphs", mode]))
        assert config.prefill_graphs == mode and create_backend(config).config.prefill_graphs == mode
    with pytest.raises(UsageError) as bad_flag:
        parse(["serve", "--prefill-graphs", "yes"])
    assert str(bad_flag.value) == (
        "kvmem serve: argument --prefill-graphs: invalid choice: 'yes' (choose from 'auto', 'on', 'off')"
    )
    with pytest.raises(ValueError) as bad:
        TransformersBackendConfig(prefill_graphs="yes")
    assert str(bad.value) == (
        "TransformersBackendConfig.prefill_graphs must be 'auto', 'on' or 'off', got 'yes'"
    )
    with pytest.raises(ValueError) as bad_config:
        ServingConfig(data_dir=tmp_path, prefill_graphs="yes")
    assert str(bad_config.value) == "prefill_graphs must be one of auto, on, off, got 'yes'"

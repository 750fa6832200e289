"""Shared fixtures: the real default model (provisioned once), a tiny random llama on its tokenizer, and a
forward log that records the autograd state of every forward."""

from __future__ import annotations

import os
import random

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist each worker gets one torch thread: the workers already share the cores, and two
    threads each would contend for them (scripts/test.sh runs one worker per core)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_model_dir():
    from kvmem.models import provision

    return provision()


@pytest.fixture(scope="session")
def tokenizer(request):
    """The default model's tokenizer; KVMEM_TOKENIZER_DIR: a copy of its files, for a machine that cannot
    provision the model (a lent GPU machine has no network: benchmarks/gpu/gpu_suite.sh runs the tiny-llama tests
    of CUDA graphs there)."""
    from transformers import AutoTokenizer

    path = os.environ.get("KVMEM_TOKENIZER_DIR") or request.getfixturevalue("default_model_dir")
    return AutoTokenizer.from_pretrained(str(path))


def make_tiny_llama(vocab_size: int, *, seed: int = 0, max_positions: int = 8192, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_handle(tokenizer):
    from kvmem.models import handle_for

    return handle_for(make_tiny_llama(len(tokenizer)), tokenizer, model_id="tiny-llama")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tiny_handle):
    """The tiny llama saved as a model dir (per module: a test may touch its files)."""
    d = tmp_path_factory.mktemp("tiny-model")
    tiny_handle.model.save_pretrained(d)
    tiny_handle.tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def default_handle(default_model_dir):
    from kvmem.models import load_model

    return load_model(str(default_model_dir), device="cpu", dtype="float32")


class ForwardLog:
    """A forward hook on a causal LM recording, for every forward (on whatever thread runs it), whether
    inference mode was on and whether the logits or any cache tensor carry autograd history."""

    def __init__(self, model: torch.nn.Module) -> None:
        # per forward: (input length, inference mode on, logits require grad, a cache tensor requires grad)
        self.calls: list[tuple[int, bool, bool, bool]] = []
        self._hook = model.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, _module, _args, kwargs, out) -> None:
        cache = out.past_key_values
        cache_grad = any(t.requires_grad for layer in cache.layers for t in (layer.keys, layer.values))
        self.calls.append(
            (
                kwargs["input_ids"].shape[1],
                torch.is_inference_mode_enabled(),
                out.logits.requires_grad,
                cache_grad,
            )
        )

    def remove(self) -> None:
        self._hook.remove()


class EngineForwards:
    """A hook on the engine's forward, `serving.engine.runner.run_model`: what the server runs on either path
    (the engine's own layers, serving/engine/models, or the HF forward), where a hook on the HF model sees only
    the generic path. `before(ids)` runs before each forward, on the thread that runs it (ids [1, T], every row
    of the step packed; it may raise, as the forward would); `calls` records per forward (input length,
    inference mode on, logits require grad, a pool page tensor requires grad). Remove in reverse order."""

    def __init__(self, before=None) -> None:
        from serving.engine import runner

        self.calls: list[tuple[int, bool, bool, bool]] = []
        self._runner, real = runner, runner.run_model
        self._real = real

        def run_model(model, ids, positions, plan, logits_to_keep, generic: bool = False):
            if before is not None:
                before(ids)
            logits = real(model, ids, positions, plan, logits_to_keep, generic)
            pool = getattr(plan, "pool", None)
            pages = [getattr(pool, name, None) for name in ("k", "v")]
            self.calls.append(
                (
                    ids.shape[1],
                    torch.is_inference_mode_enabled(),
                    logits.requires_grad,
                    any(t is not None and t.requires_grad for t in pages),
                )
            )
            return logits

        runner.run_model = run_model

    def remove(self) -> None:
        self._runner.run_model = self._real


_WORDS = (
    "garden kitchen sister Lisbon marathon violin allergy peanut apartment renovation mortgage "
    "teacher daughter birthday October coffee bicycle Tuesday manager project deadline vacation "
    "Kyoto hiking sourdough recipe cat named Miso piano lessons budget spreadsheet dentist"
).split()


def synthetic_memories(num_tokens: int, tokenizer, *, seed: int = 0) -> list[str]:
    """Deterministic memory sentences adding up to about `num_tokens` tokens in the block layout."""
    rng = random.Random(seed)
    memories, total = [], 0
    while total < num_tokens:
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 20)))
        text = f"On day {len(memories) + 1} the user mentioned {words}."
        total += len(tokenizer(f"- {text}\n", add_special_tokens=False)["input_ids"])
        memories.append(text)
    return memories


# the system prompt of the prompts whose lengths engine tests count (chunks, pages, quotas, preemption): fixed
# here, so a change to the product's default wording (kvmem.kv.layout.DEFAULT_SYSTEM_PROMPT) leaves them as
# they are (e512a6c's moved 8 of them)
FIXED_SYSTEM_PROMPT = (
    "You are a helpful assistant with long-term memory. Use what you remember about the user when it helps."
)


def prompts_and_blocks(handle, tokenizer):
    """Four requests: two blocks of different lengths, two without a block; prompts of different lengths."""
    from kvmem.kv import PromptLayout, build_item

    layout = PromptLayout(handle.tokenizer, system_prompt=FIXED_SYSTEM_PROMPT)
    mems_a, mems_b = synthetic_memories(200, tokenizer, seed=1), synthetic_memories(60, tokenizer, seed=2)
    item_a = build_item(handle, layout.block_ids(mems_a), user_id="u", memory_ids=["a"])
    item_b = build_item(handle, layout.block_ids(mems_b), user_id="u", memory_ids=["b"])

    def ask(mems, text):
        return layout.prompt(mems, [], [{"role": "user", "content": text}]).ids

    long_text = " ".join(synthetic_memories(150, tokenizer, seed=3))
    return [
        (ask(mems_a, "Hi"), item_a),
        (ask([], f"Tell me what you think of this: {long_text}"), None),
        (ask(mems_b, "Which city did I mention, and what did I cook on Tuesday?"), item_b),
        (ask([], "Where do I live?"), None),
    ]

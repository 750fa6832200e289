"""The vLLM backend with LoRA on (real vLLM, CPU fp32, the default model; its own engine): a plan's adapter goes
in as a LoRARequest named by version and hash, its greedy tokens equal peft's over the same ids, and the base
model's block item is never injected under an adapter (the adapter changes the block's K/V).

Needs peft (`pip install 'kvmem[lora]'`); skipped without it. The adapter's `kvmem_adapter.json` is written
here by hand: nothing in kvmem writes adapters yet (the parametric tier is a later issue)."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

pytest.importorskip("vllm")
peft = pytest.importorskip("peft")

import torch  # noqa: E402

from kvmem.kv import Sampling, generate  # noqa: E402
from serving.backends.base import GenerationRequest, SamplingParams, TokenDelta  # noqa: E402
from serving.backends.vllm_backend import VllmBackend, VllmBackendConfig  # noqa: E402
from serving.backends.vllm_request import adapter_ref  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MEMORIES = ["I live in Lisbon with my sister.", "My dog is a golden retriever called Miso."]
QUESTION = [{"role": "user", "content": "What is my dog called?"}]


async def _run(backend, req):
    ids, result = [], None
    async for item in backend.stream(req):
        if isinstance(item, TokenDelta):
            ids.extend(item.token_ids)
        else:
            result = item
    return ids, result


def test_an_adapter_runs_as_peft_does_and_never_gets_the_base_models_block_kv(tmp_path, default_model_dir):
    from kvmem.models import load_model

    handle = load_model(str(default_model_dir), device="cpu", dtype="float32")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = peft.get_peft_model(handle.model, config).eval()
    directory = tmp_path / "adapters" / "ad-1"
    peft_model.save_pretrained(str(directory))
    sha = hashlib.sha256((directory / "adapter_model.safetensors").read_bytes()).hexdigest()
    (directory / "kvmem_adapter.json").write_text(json.dumps({"version": 1, "sha256": sha}))

    backend = VllmBackend(
        VllmBackendConfig(model=str(default_model_dir), data_dir=str(tmp_path), enable_lora=True)
    )
    backend.load()
    try:
        built = backend.build_block("u", MEMORIES)
        prompt = backend.layout_prompt(MEMORIES, [], QUESTION, built.token_ids)
        greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
        base = asyncio.run(_run(backend, GenerationRequest("base", "u", prompt, built.item_id, greedy)))
        tuned = asyncio.run(
            _run(backend, GenerationRequest("tuned", "u", prompt, built.item_id, greedy, adapter_id="ad-1"))
        )
    finally:
        asyncio.run(backend.aclose())
    reference = list(
        generate(peft_model, prompt.ids, sampling=Sampling(max_new_tokens=12), stop_token_ids=backend._eos)
    )
    assert adapter_ref(tmp_path / "adapters", "ad-1").name == f"ad-1@v1-{sha[:16]}"
    assert (base[1].cached_tokens, base[1].kv_fallback_reason) == (prompt.block_len, None)
    assert (tuned[1].cached_tokens, tuned[1].kv_fallback_reason) == (0, "other")  # not the base model's KV
    assert tuned[0] == reference and tuned[0] != base[0]

"""The engine's own layers for the Llama family (serving/engine/models): which models take them, and that they
keep the exactness contract. Greedy tokens through the fast path equal the generic path's (the HF forward with
the engine's attention) and a full prefill's: alone and batched, rows of different lengths, a shared block, a
session's next turn, on the real default model in float32; logits within float32 rounding of the generic
path's on tiny Qwen3 (q/k norms) and Qwen2 (q/k/v biases) models built from a config; a step with an adapter
row runs the generic path; a decode graph's static step runs the fast layers with no host sync."""

from __future__ import annotations

import copy

import pytest
import torch

from kvmem.kv import Sampling, generate
from kvmem.models import handle_for
from serving.engine import models, runner
from serving.engine import plan as step_plan
from tests.conftest import make_tiny_llama, prompts_and_blocks
from tests.serving.engine.test_engine import (
    CHUNK,
    TINY_SHAPE,
    admitted,
    equal_to_a_full_prefill,
    make_pool,
    run_engine,
    tiny_capped,
    tiny_gpt2,
    tiny_sliding,
)
from tests.serving.engine.test_graphs import HostSyncs


def tiny_qwen(kind: str, vocab_size: int):
    """Qwen3 (per-head q/k RMSNorm; q/k/v/o biases on, `attention_bias`) or Qwen2 (q/k/v biases), two full
    attention layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = {k: v for k, v in TINY_SHAPE.items() if k != "sliding_window"}
    shape.update(vocab_size=vocab_size, tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16, attention_bias=True))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    for name, p in model.named_parameters():  # the norms and biases off their init values (1 and 0)
        if "norm" in name or name.endswith("bias"):
            torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3)
    return model.eval()


@pytest.fixture
def fast():
    """Enables the fast path of the models a test passes it, and disables it after."""
    enabled = []

    def enable(model):
        choice = models.enable(model)
        assert choice.path == "fast", choice.reason
        enabled.append(model)
        return models.fast_for(model)

    yield enable
    for model in enabled:
        models.disable(model)


def test_which_models_take_the_fast_path(tokenizer):
    n = len(tokenizer)
    assert models.why_not(make_tiny_llama(n)) is None
    assert models.why_not(tiny_qwen("qwen3", n)) is None and models.why_not(tiny_qwen("qwen2", n)) is None
    assert models.why_not(tiny_sliding("mistral", n)) is None  # its window is the plan's
    assert models.windows(tiny_sliding("mistral", n)) == [40, 40]
    assert models.windows(tiny_sliding("qwen2", n)) == [None, 40]
    assert models.why_not(tiny_capped("gemma2", n)) == (
        "Gemma2ForCausalLM is not one of ['LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', "
        "'Qwen3ForCausalLM']"
    )
    assert models.why_not(tiny_gpt2(n)).startswith("GPT2LMHeadModel is not one of")
    gelu = make_tiny_llama(n)
    gelu.config.hidden_act = "gelu"
    assert models.why_not(gelu) == "hidden_act 'gelu' is not 'silu'"
    choice = models.enable(gelu)
    assert (
        choice == models.Choice("generic", "hidden_act 'gelu' is not 'silu'")
        and models.fast_for(gelu) is None
    )


def one_step_logits(model, handle, tokenizer) -> torch.Tensor:
    """The logits of one engine forward of two prefill chunks (one over a block's pages) and two decode rows,
    rows of different lengths."""
    pool = make_pool(model)
    requests = prompts_and_blocks(handle, tokenizer)
    seqs = [admitted(pool, model, ids, item, sampling=Sampling(max_new_tokens=4)) for ids, item in requests]
    with torch.inference_mode():
        for s in seqs[2:]:  # two rows decoding
            while s.prefilling:
                runner.step(model, pool, [s], [])
        chunks = [s._prefill[:CHUNK] for s in seqs[:2]] + [[s.last_token] for s in seqs[2:]]
        logits = runner.forward(model, pool, seqs, chunks)
    for s in seqs:
        s.release()
    return logits


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_tiny_qwen_fast_layers_give_the_generic_logits_and_a_full_prefills_tokens(tokenizer, kind, fast):
    model = tiny_qwen(kind, len(tokenizer))
    handle = handle_for(model, tokenizer, model_id=f"tiny-{kind}")
    generic = one_step_logits(model, handle, tokenizer)
    decoder = fast(model)
    fast_logits = one_step_logits(model, handle, tokenizer)
    assert decoder.steps > 0
    assert fast_logits.shape == generic.shape == (4, len(tokenizer))
    torch.testing.assert_close(fast_logits, generic, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast_logits.argmax(-1), generic.argmax(-1))
    steps = decoder.steps
    equal_to_a_full_prefill(model, tokenizer, kind)  # alone, in chunks, batched; blocks; a prefix group
    assert decoder.steps > steps


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_the_norm_as_a_gpu_runs_it_gives_the_same_logits(tokenizer, kind, fast, monkeypatch):
    """On a GPU the fast layers' norms run torch's rms_norm, then the weight (layers.FUSED_NORM_DEVICES). The
    same form on this CPU (where torch decomposes it) gives the CPU form's logits bit for bit, per-head q/k
    norms included, and a full prefill's greedy tokens."""
    from serving.engine.models import layers

    model = tiny_qwen(kind, len(tokenizer))
    handle = handle_for(model, tokenizer, model_id=f"tiny-{kind}")
    fast(model)
    cpu_form = one_step_logits(model, handle, tokenizer)
    monkeypatch.setattr(layers, "FUSED_NORM_DEVICES", frozenset({"cuda", "cpu"}))
    calls = []
    real = torch.nn.functional.rms_norm
    monkeypatch.setattr(torch.nn.functional, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    gpu_form = one_step_logits(model, handle, tokenizer)
    assert len(calls) > 0 and torch.equal(gpu_form, cpu_form)
    equal_to_a_full_prefill(model, tokenizer, kind)


def lone_chunk_logits(model, ids, item, sizes: list | None = None) -> torch.Tensor:
    """The float32 logits of one engine forward of a request's first prefill chunk alone, after its block
    (P > 0 keys before it); appends (Q, K) to `sizes`."""
    pool = make_pool(model)
    seq = admitted(pool, model, ids, item, sampling=Sampling(max_new_tokens=4))
    chunk = seq._prefill[:CHUNK]
    if sizes is not None:
        sizes.append((len(chunk), seq.position + len(chunk)))
    with torch.inference_mode():
        logits = runner.forward(model, pool, [seq], [chunk])
    seq.release()
    return logits.float()


def causal_calls(monkeypatch) -> list:
    """The (Q, K) of every causal form attention.wide takes from now on."""
    from serving.engine import attention

    calls = []
    real = attention.causal_lower_right
    monkeypatch.setattr(attention, "causal_lower_right", lambda q, k: calls.append((q, k)) or real(q, k))
    return calls


@pytest.mark.parametrize("kind", ["qwen3", "llama-generic"])
def test_a_lone_chunk_attended_as_a_gpu_does_gives_a_full_prefills_tokens(tokenizer, kind, fast, monkeypatch):
    """On a GPU a step's one prefill chunk is attended with the causal mask aligned to the last key and K/V
    shared by G query heads, no mask tensor (attention.CAUSAL_DEVICES, in 16 bits: what lets SDPA take
    flash). The same form on this CPU in float32, through the engine's own layers and the generic path: the
    chunk's logits are the masked form's, and greedy tokens alone, in chunks and batched are a full
    prefill's."""
    from serving.engine import attention

    model = tiny_qwen(kind, len(tokenizer)) if kind == "qwen3" else make_tiny_llama(len(tokenizer))
    if kind == "qwen3":
        fast(model)
    handle = handle_for(model, tokenizer, model_id=f"tiny-{kind}")
    ids, item = prompts_and_blocks(handle, tokenizer)[0]  # a prompt after a block: P > 0 keys before it
    sizes = []
    masked = lone_chunk_logits(model, ids, item, sizes)
    monkeypatch.setattr(attention, "CAUSAL_DEVICES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(attention, "CAUSAL_DTYPES", frozenset({torch.bfloat16, torch.float32}))
    calls = causal_calls(monkeypatch)
    causal = lone_chunk_logits(model, ids, item, sizes)
    assert calls and calls == [sizes[-1]] * len(calls) and sizes[-1][1] > sizes[-1][0]  # after its block
    torch.testing.assert_close(causal, masked, rtol=1e-5, atol=1e-5)
    assert torch.equal(causal.argmax(-1), masked.argmax(-1))
    equal_to_a_full_prefill(model, tokenizer, kind)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_in_bfloat16_a_lone_chunk_takes_the_causal_form(tokenizer, fast, monkeypatch):
    """On a GPU in bf16 (what the suite's GPU step runs): a lone chunk after a block takes the causal form
    (attention.CAUSAL_DEVICES), and its logits are the additive mask's within bf16's rounding (the two forms
    run different kernels: flash, and memory-efficient attention with a mask)."""
    from serving.engine import attention

    model = tiny_qwen("qwen3", len(tokenizer)).to("cuda", torch.bfloat16)
    fast(model)
    handle = handle_for(model, tokenizer, model_id="tiny-qwen3-bf16")
    ids, item = prompts_and_blocks(handle, tokenizer)[0]
    calls = causal_calls(monkeypatch)
    causal = lone_chunk_logits(model, ids, item)
    assert calls
    monkeypatch.setattr(attention, "CAUSAL_DEVICES", frozenset())
    masked = lone_chunk_logits(model, ids, item)
    cosine = torch.nn.functional.cosine_similarity(causal, masked, dim=-1)
    assert bool(torch.isfinite(causal).all()) and float(cosine.min()) > 0.999, float(cosine.min())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_on_cuda_in_float32_the_fast_layers_give_the_generic_logits_and_a_full_prefills_tokens(
    tokenizer, kind, fast
):
    """The same on a GPU (the GPU suite's graphs_test step runs it): the engine's own layers and its page pool
    on CUDA, float32, against HF's own full prefill on CUDA."""
    model = tiny_qwen(kind, len(tokenizer)).to("cuda")
    handle = handle_for(model, tokenizer, model_id=f"tiny-{kind}")
    generic = one_step_logits(model, handle, tokenizer)
    decoder = fast(model)
    fast_logits = one_step_logits(model, handle, tokenizer)
    assert decoder.steps > 0 and fast_logits.device.type == "cuda"
    torch.testing.assert_close(fast_logits, generic, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast_logits.argmax(-1), generic.argmax(-1))
    equal_to_a_full_prefill(model, tokenizer, kind)


def test_sliding_window_layers_on_the_fast_path_equal_a_full_prefill(tokenizer, fast, monkeypatch):
    monkeypatch.setattr(step_plan, "GROUP_MIN_READS", 0)
    model = tiny_sliding("qwen2", len(tokenizer))
    decoder = fast(model)
    equal_to_a_full_prefill(model, tokenizer, "qwen2", min_prompt=41)
    assert decoder.steps > 0


def test_a_static_decode_step_runs_the_fast_layers_with_no_host_sync(tiny_handle, tokenizer, fast):
    """What a CUDA graph captures (graphs.py), run eagerly on CPU: the fast layers' tokens equal the generic
    eager engine's, and the step makes no host sync."""
    from tests.serving.engine.test_graphs import run

    model = copy.deepcopy(tiny_handle.model)
    eager, _ = run(model, tiny_handle, tokenizer, graphed=False)
    decoder = fast(model)
    static, pool = run(model, tiny_handle, tokenizer, graphed=True)
    assert static == eager and pool.graphs.steps > 20 and decoder.steps > pool.graphs.steps
    bucket = next(iter(pool.graphs.buckets.values()))
    with torch.inference_mode():
        probe = HostSyncs()
        with probe:
            bucket.forward()
    assert probe.ops == []


def test_a_step_with_an_adapter_row_runs_the_generic_path(tiny_handle, tokenizer, fast):
    """LoRA rows fall back to the generic path (peft's layers under lora.mixed's hooks) for the whole step:
    their tokens are peft's own; a step without adapter rows runs the fast layers."""
    peft = pytest.importorskip("peft")
    model = copy.deepcopy(tiny_handle.model)
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
    wrapped = peft.PeftModel(model, config, adapter_name="a")
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    wrapped.eval()
    layers = wrapped.base_model
    ids = prompts_and_blocks(tiny_handle, tokenizer)[1][0]
    sp = Sampling(max_new_tokens=6)
    layers.enable_adapter_layers()
    layers.set_adapter("a")
    expected = list(generate(model, ids, sampling=sp))
    layers.disable_adapter_layers()
    base = list(generate(model, ids, sampling=sp))
    assert expected != base  # the adapter changes the answer: the test can fail
    decoder = fast(model)  # built over peft's wrapped layers: their base layers' weights
    pool = make_pool(model)
    seqs = [admitted(pool, model, ids, sampling=sp, adapter=n) for n in ("a", None)]
    steps = decoder.steps
    with torch.inference_mode():
        runner.step(model, pool, seqs, [])  # both prefills, one step with an adapter row: generic
        assert decoder.steps == steps
        runner.step(model, pool, [], seqs[1:])  # the base row alone: fast
        assert decoder.steps == steps + 1
        while any(not s.finished for s in seqs):
            runner.step(model, pool, [], [s for s in seqs if s.decoding])
    assert [s.stats.token_ids for s in seqs] == [expected, base]
    for s in seqs:
        s.release()


def test_a_weight_written_in_place_sends_the_model_back_to_the_generic_path(tokenizer, fast):
    model = make_tiny_llama(len(tokenizer))
    fast(model)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(2.0)  # changed since it was packed
    assert models.fast_for(model) is None and models.why_not(model) is None


@pytest.mark.slow
def test_the_default_model_on_the_fast_path_gives_the_generic_and_full_prefill_tokens(
    default_handle, tokenizer, fast, monkeypatch
):
    """SmolLM2 in float32: four requests (two over blocks of memory KV, rows of different lengths) and a fifth
    over the first one's block (its pages read once for both rows), batched, arriving at different steps;
    each request's greedy tokens on the fast path equal the generic path's and a full prefill's; then a
    session's next turn over its pages equals a full prefill too."""
    from serving.engine.sessions import SessionCache
    from tests.serving.engine.test_session_pages import turn

    monkeypatch.setattr(step_plan, "GROUP_MIN_READS", 0)  # the shared block read as a group
    model = default_handle.model
    requests = prompts_and_blocks(default_handle, tokenizer)
    requests.append(requests[0])
    sp = Sampling(max_new_tokens=8)
    full = [list(generate(model, ids, sampling=sp)) for ids, _ in requests]
    pool = make_pool(model, mb=64)
    arrive = [0, 1, 1, 2, 4]

    def batched() -> list[list[int]]:
        seqs, errors = run_engine(model, pool, requests, [sp] * len(requests), arrive)
        assert errors == []
        for s in seqs:
            s.release()
        return [s.stats.token_ids for s in seqs]

    generic = batched()
    decoder = fast(model)
    assert batched() == generic == full and decoder.steps > 0
    sessions = SessionCache(1 << 30)
    first_ids, item = requests[0]
    first, _, _ = turn(model, pool, sessions, first_ids, item, sampling=sp)
    entry = sessions.peek("alice", "s1")
    second_ids = [*entry.ids, *first.stats.token_ids[-1:], *tokenizer.encode(" And what about my sister?")]
    second, reused, _ = turn(model, pool, sessions, second_ids, item, sampling=sp)
    assert reused == len(entry.ids) and second.stats.token_ids == list(
        generate(model, second_ids, sampling=sp)
    )
    sessions.forget("alice")
    assert pool.used_pages == pool.shared.page_count()

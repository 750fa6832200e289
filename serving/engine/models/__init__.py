"""The engine's own model code for the decoder family most users serve, chosen per model at load.

`enable(model)` builds the fast decoder (llama.py: packed projections, fused element-wise functions, one
attention call per layer) for a model whose layer is exactly the Llama family's, and registers it;
runner.run_model then runs it in place of the HF forward (eager steps and CUDA graph captures alike). Every
other model keeps the generic path (the HF forward with the engine's attention registered); `why_not` says
why. Knows nothing of requests, pages or sampling.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# model_type -> the HF classes of its decoder layer, attention, MLP and RMSNorm: exactly these, no subclass
FAMILY = {
    t: tuple(f"{p}{c}" for c in ("DecoderLayer", "Attention", "MLP", "RMSNorm"))
    for t, p in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"))
}
CAUSAL_LM = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}

_FAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF model -> its FastDecoder


@dataclass(frozen=True)
class Choice:
    """Which path a model's steps take: "fast" or "generic", with the reason for generic, and how long the
    fast decoder took to build (and compile, if asked) at load."""

    path: str
    reason: str | None = None
    build_s: float = 0.0
    compiled: bool = False


def _base(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "base_layer", module)


def why_not(model: torch.nn.Module) -> str | None:
    """None if `model` takes the fast path, else why not (its steps run the generic path): a model class or
    layer that is not exactly the family's (other activations, soft-capping, sinks, mixtures of experts, other
    norms, quantized or other linear layers)."""
    name = type(model).__name__
    if name not in CAUSAL_LM:
        return f"{name} is not one of {sorted(CAUSAL_LM)}"
    config = model.config
    kinds = FAMILY.get(config.model_type)
    if kinds is None:
        return f"model_type {config.model_type!r} is not one of {sorted(FAMILY)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not 'silu'"
    inner = model.get_decoder()
    if len(inner.layers) != config.num_hidden_layers:
        return "the decoder runs a subset of its layers"
    if type(inner.norm).__name__ != kinds[3]:
        return f"final norm {type(inner.norm).__name__} is not {kinds[3]}"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
        got = (type(layer).__name__, type(attn).__name__, type(mlp).__name__)
        if got != kinds[:3]:
            return f"layer {got} is not {kinds[:3]}"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if config.model_type == "qwen3":
            norms += [attn.q_norm, attn.k_norm]
        if any(type(n).__name__ != kinds[3] for n in norms):
            return f"a norm of layer {attn.layer_idx} is not {kinds[3]}"
        linears = [
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
        ]
        if any(type(_base(m)) is not torch.nn.Linear for m in linears):
            return f"a projection of layer {attn.layer_idx} is not a plain nn.Linear (quantized?)"
    return None


def windows(model: torch.nn.Module) -> list[int | None]:
    """Each layer's sliding window (None: every past position), as its HF attention passes it: Mistral's
    config's for every layer, Qwen2's and Qwen3's per layer type."""
    config, layers = model.config, model.get_decoder().layers
    if config.model_type == "mistral":
        return [getattr(config, "sliding_window", None) or None] * len(layers)
    return [getattr(layer.self_attn, "sliding_window", None) or None for layer in layers]


def enable(model: torch.nn.Module, *, compile: bool = False, cache_dir: str | None = None) -> Choice:
    """Build and register the fast decoder of `model` if it takes the fast path (`why_not`); logs and returns
    the choice. `compile`: the element-wise functions under torch.compile (compile.py), its artifacts under
    `cache_dir`. Idempotent: a model already enabled keeps its decoder."""
    from serving.engine.models import compile as compiling
    from serving.engine.models.llama import FastDecoder

    reason = why_not(model)
    if reason is not None:
        log.info("engine layers: generic path (%s)", reason)
        return Choice("generic", reason)
    if model in _FAST:
        return Choice("fast", compiled=_FAST[model].fns.compiled)
    start = time.perf_counter()
    fns = compiling.functions(compile, cache_dir)
    decoder = FastDecoder(model, windows(model), fns)
    if compile:
        compiling.warm(decoder, model)
    build_s = time.perf_counter() - start
    _FAST[model] = decoder
    log.info(
        "engine layers: fast path for %s (%d layers, packed q/k/v and gate/up, %s element-wise functions) "
        "built in %.2f s",
        type(model).__name__,
        len(decoder.layers),
        "compiled" if fns.compiled else "eager",
        build_s,
    )
    return Choice("fast", build_s=build_s, compiled=fns.compiled)


def disable(model: torch.nn.Module) -> None:
    """The generic path for `model` from now on (its packed weights are dropped)."""
    _FAST.pop(model, None)


def fast_for(model: torch.nn.Module):
    """`model`'s fast decoder, or None (the generic path): not enabled, or a packed weight went out of date
    (a source weight written in place: then dropped, with a warning, and the generic path from then on)."""
    decoder = _FAST.get(model)
    if decoder is not None and decoder.stale:
        log.warning(
            "engine layers: a weight changed since its packed copy was made; generic path from now on"
        )
        disable(model)
        return None
    return decoder

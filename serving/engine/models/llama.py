"""The engine's own decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM: one layer shape), built
once at load from the HF model's modules and run in place of its forward (runner.run_model).

A layer: RMSNorm fused with the residual add, one packed q/k/v projection (Qwen2's biases packed too), Qwen3's
per-head q/k RMSNorm as one norm over the queries and keys, rotary on the queries and keys in one go, ONE
attention call over the pages (the step's plan: plan.StepPlan eagerly, graphs.StaticPlan in a CUDA graph, the
same `attend` the generic path calls), the output projection, the residual add with the next norm, one packed
gate/up projection, SiLU-and-mul, the down projection. Hidden states stay [T, hidden] (the step's packed
tokens), so no layer reshapes its input.

Capture-safe (graphs.py): no host sync and no Python branch on a tensor's value; every branch reads the
config or the step's shapes. The embeddings, the rotary tables, the final norm and the LM head are the HF
model's own modules. Which models take this path: models/__init__.py (`why_not`).
"""

from __future__ import annotations

import torch

from serving.engine.models import layers as L
from serving.engine.models.linear import Packed


class FastLayer(torch.nn.Module):
    """One decoder layer (an nn.Module only so that a profiler's hooks can mark it; it holds no parameters of
    its own: its norms' weights are the HF modules', its projections are `Packed`)."""

    def __init__(self, hf_layer: torch.nn.Module, window: int | None, fns) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.index = attn.layer_idx
        self.heads = attn.config.num_attention_heads
        self.kv_heads = attn.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.window = window
        self.fns = fns  # the element-wise functions, eager or compiled (compile.py)
        self.input_norm = L.Norm.of(
            hf_layer.input_layernorm.weight, hf_layer.input_layernorm.variance_epsilon
        )
        eps = hf_layer.post_attention_layernorm.variance_epsilon
        self.post_norm = L.Norm.of(hf_layer.post_attention_layernorm.weight, eps)
        self.qkv = Packed([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = Packed([attn.o_proj])
        self.gate_up = Packed([mlp.gate_proj, mlp.up_proj])
        self.down = Packed([mlp.down_proj])
        self.qk_norm = None  # Qwen3: q_norm's weight over the query heads, k_norm's over the key heads
        self._norm_sources: list = []  # (weight, version) of what qk_norm copies
        if getattr(attn, "q_norm", None) is not None:
            h, kv, d = self.heads, self.kv_heads, self.head_dim
            weight = torch.cat(
                [attn.q_norm.weight.detach().expand(h, d), attn.k_norm.weight.detach().expand(kv, d)]
            )  # [heads + kv_heads, d]
            assert attn.q_norm.variance_epsilon == attn.k_norm.variance_epsilon
            self.qk_norm = L.Norm.of(weight, attn.q_norm.variance_epsilon)
            self._norm_sources = [(w, w._version) for w in (attn.q_norm.weight, attn.k_norm.weight)]

    @property
    def stale(self) -> bool:
        return any(p.stale for p in (self.qkv, self.o, self.gate_up, self.down)) or any(
            w._version != version for w, version in self._norm_sources
        )

    def forward(self, x, residual, cos, sin, plan) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output [T, hidden] (the embeddings for layer 0, with residual None), residual
        the stream before it; returns this layer's (output, residual)."""
        fns = self.fns
        if residual is None:
            residual = x
            h = fns.rms_norm(x, self.input_norm)
        else:
            h, residual = fns.add_rms_norm(x, residual, self.input_norm)
        t, heads, kv, d = h.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(h).view(t, heads + 2 * kv, d)
        qk = qkv[:, : heads + kv]
        if self.qk_norm is not None:
            qk = fns.rms_norm(qk, self.qk_norm)
        qk = fns.rotary(qk, cos, sin)  # [T, heads + kv, d]
        # [T, heads or kv, d]: the packed tokens' layout, which the plans take as they take the attention
        # interface's [1, heads, T, d] (plan.StepPlan.attend, graphs.StaticPlan.attend)
        out = plan.attend(
            self.index, qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :], self.scale, self.window
        )
        h, residual = fns.add_rms_norm(self.o(out.view(t, heads * d)), residual, self.post_norm)
        return self.down(fns.silu_and_mul(self.gate_up(h))), residual


class FastDecoder(torch.nn.Module):
    """The whole forward: embeddings, the layers, the final norm and the LM head at the kept positions."""

    def __init__(self, model: torch.nn.Module, windows: list[int | None], fns) -> None:
        super().__init__()
        self.hf = [model]  # in a list: not a submodule (its parameters are not this module's)
        inner = model.get_decoder()
        self.layers = torch.nn.ModuleList(
            FastLayer(layer, w, fns) for layer, w in zip(inner.layers, windows, strict=True)
        )
        self.fns = fns
        self.steps = 0  # forwards run (a CUDA graph's capture counts once; its replays run no Python)
        self.norm = L.Norm.of(inner.norm.weight, inner.norm.variance_epsilon)

    @property
    def stale(self) -> bool:
        """Some packed weight is out of date with the HF module it was made from (runner.py then runs the
        generic path)."""
        return any(layer.stale for layer in self.layers)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, plan, logits_to_keep) -> torch.Tensor:
        """ids, positions [1, T]; logits [1, kept, vocab] in the model's dtype, as runner.run_model returns."""
        self.steps += 1
        model = self.hf[0]
        inner = model.get_decoder()
        x = _base(inner.embed_tokens)(ids[0])  # [T, hidden]
        cos, sin = inner.rotary_emb(x, positions)  # [1, T, d]
        cos, sin = cos[0, :, None], L.signed_sin(sin[0, :, None])  # [T, 1, d], once for every layer
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, plan)
        x, _ = self.fns.add_rms_norm(x, residual, self.norm)
        if isinstance(logits_to_keep, torch.Tensor):
            x = x.index_select(0, logits_to_keep)
        elif logits_to_keep:
            x = x[-logits_to_keep:]
        return _base(model.get_output_embeddings())(x)[None]


def _base(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "base_layer", module)

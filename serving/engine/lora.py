"""Requests under different LoRA adapters, and none, in one forward: each token gets its own adapter's delta.

peft's LoRA layers stay disabled (they run their base layer only, exactly the base model). For a step whose
rows run adapters, a forward hook on every LoRA layer adds, for each adapter in the step, what peft itself
would add, with the same modules and weights, to the rows of the tokens of that adapter's sequences, and to
no other row:
- a plain LoRA linear layer: `lora_B(lora_A(dropout(x))) * scaling`;
- an adapter peft runs through a variant (DoRA: the output rescaled by its magnitude over the adapted
  weight's norm): the variant's own `forward` on those rows, as peft's forward and its mixed-batch forward
  call it;
- a LoRA embedding layer: the token ids' rows of `lora_embedding_A`, times `lora_embedding_B`, times
  scaling (and the layer's embedding scale, where it has one), as peft's forward computes it.
A row alone gets exactly peft's output for its adapter (the same operations on the same rows); in a batch the
base layer sees more rows, as for any request. One matmul pair per adapter per layer, not per sequence.
GPT-2's `Conv1D` layers are linear ones here (peft adapts them as such). Adapters on other layers (true
convolutions) are refused by `supports`: their requests keep the step-by-step path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """peft's LoRA layers (linear and embedding ones alike have `lora_A` and `lora_embedding_A`)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "base_layer") and isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)
    ]


def supports(model: torch.nn.Module, name: str) -> bool:
    """True if every layer that adapter `name` touches is a LoRA linear or embedding layer (plain or DoRA). A
    linear layer may be transformers' `Conv1D` (GPT-2's: a linear layer with its weight transposed, which peft
    adapts as one, `fan_in_fan_out`): its delta is computed as a linear layer's."""
    from transformers.pytorch_utils import Conv1D

    for m in model.modules():
        if not hasattr(m, "base_layer"):
            continue
        if name in getattr(m, "lora_embedding_A", {}):
            if not isinstance(m.base_layer, torch.nn.Embedding):
                return False
        elif name in getattr(m, "lora_A", {}) and not isinstance(m.base_layer, (torch.nn.Linear, Conv1D)):
            return False
    return True


def _linear_delta(module, name: str, idx: torch.Tensor, x: torch.Tensor, output: torch.Tensor) -> None:
    a, b = module.lora_A[name], module.lora_B[name]
    xs = x.index_select(1, idx).to(a.weight.dtype)
    variant = module.lora_variant.get(name)
    if variant is None:
        delta = b(a(module.lora_dropout[name](xs))) * module.scaling[name]
        output.index_add_(1, idx, delta.to(output.dtype))
    else:  # DoRA: peft's own variant on these rows gives their new output
        rows = variant.forward(module, active_adapter=name, x=xs, result=output.index_select(1, idx))
        output.index_copy_(1, idx, rows.to(output.dtype))


def _embedding_delta(module, name: str, idx: torch.Tensor, ids: torch.Tensor, output: torch.Tensor) -> None:
    rows = ids.index_select(1, idx)
    variant = module.lora_variant.get(name)
    if variant is not None:
        new = variant.forward(module, active_adapter=name, x=rows, result=output.index_select(1, idx))
        output.index_copy_(1, idx, new.to(output.dtype))
        return
    after_a = module._embed(rows, module.lora_embedding_A[name].T)
    delta = (after_a @ module.lora_embedding_B[name].T) * module.scaling[name]
    scale = module._get_embed_scale()
    if scale is not None:
        delta = delta * scale.to(delta.dtype)
    output.index_add_(1, idx, delta.to(output.dtype))


@contextmanager
def mixed(model: torch.nn.Module, groups: dict[str, torch.Tensor]) -> Iterator[None]:
    """During the block: adapter `name`'s part at the packed token positions `groups[name]` ([1, T, ...]
    inputs) of every LoRA linear and embedding layer."""

    def hook(module, args, output):
        for name, idx in groups.items():
            if name in module.lora_A:
                _linear_delta(module, name, idx, args[0], output)
            elif name in module.lora_embedding_A:
                _embedding_delta(module, name, idx, args[0], output)
        return output

    handles = [m.register_forward_hook(hook) for m in _lora_layers(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()

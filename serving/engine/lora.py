"""Requests under different LoRA adapters, and none, in one forward: each token gets its own adapter's delta.

peft's LoRA layers stay disabled (they run their base layer only, exactly the base model). For a step whose
rows run adapters, a forward hook on every LoRA linear layer adds, for each adapter in the step, the delta
peft itself would add (`lora_B(lora_A(dropout(x))) * scaling`, the same modules and weights) to the rows of
the tokens of that adapter's sequences, and to no other row. A row alone gets exactly peft's output for its
adapter (the same operations on the same rows); in a batch the base layer sees more rows, as for any
request. One matmul pair per adapter per layer, not per sequence. Adapters peft runs otherwise (DoRA, LoRA on
embeddings or convolutions) are refused by `supports`: their requests keep the step-by-step path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _lora_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        m
        for m in model.modules()
        if hasattr(m, "base_layer") and isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)
    ]


def supports(model: torch.nn.Module, name: str) -> bool:
    """True if every layer that adapter `name` touches is a plain LoRA linear layer."""
    for m in model.modules():
        if not hasattr(m, "base_layer"):
            continue
        if name in getattr(m, "lora_embedding_A", {}) or getattr(m, "use_dora", {}).get(name):
            return False
        if name in getattr(m, "lora_A", {}) and not isinstance(m.base_layer, torch.nn.Linear):
            return False
    return True


@contextmanager
def mixed(model: torch.nn.Module, groups: dict[str, torch.Tensor]) -> Iterator[None]:
    """During the block: the delta of adapter `name` added at the packed token positions `groups[name]`
    ([1, T, ...] inputs) of every LoRA linear layer."""

    def hook(module, args, output):
        x = args[0]
        for name, idx in groups.items():
            if name not in module.lora_A:
                continue
            a, b = module.lora_A[name], module.lora_B[name]
            xs = x.index_select(1, idx).to(a.weight.dtype)
            delta = b(a(module.lora_dropout[name](xs))) * module.scaling[name]
            output.index_add_(1, idx, delta.to(output.dtype))
        return output

    handles = [m.register_forward_hook(hook) for m in _lora_linears(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()

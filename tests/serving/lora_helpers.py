"""What the LoRA tests on the tiny llama share: a random adapter over a copy of the model, and writing it to a
data dir's registry as the user's active version. Imported only by tests that importorskip peft."""

from __future__ import annotations

import copy

import peft
import torch

from kvmem.adapters import AdapterRegistry

DOG, PORTO, TEA = "My dog is called Miso.", "I live in Porto.", "I like green tea."


def random_lora(handle, seed: int):
    """A LoRA on every linear layer with random (not zero) B weights, so it changes the model's outputs."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(copy.deepcopy(handle.model), config).eval()


def write_active(data_dir, user, model, facts, fingerprint, served_ids=None):
    """Write `model`'s adapter as a passed version for `user` (served for `served_ids`, None: every fact) and
    activate it: (registry, manifest)."""
    reg = AdapterRegistry(data_dir / "adapters")
    m = reg.write(
        user,
        lambda d: model.save_pretrained(str(d), safe_serialization=True),
        base_fingerprint=fingerprint,
        facts=facts,
        seed=0,
        passed=True,
        served_ids=served_ids,
    )
    reg.activate(user, m.version, fingerprint)
    return reg, m

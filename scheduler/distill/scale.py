"""Scaling a trained adapter's LoRA deltas down, for the job's retry of an adapter refused by the damage gate
alone (job.py, `DistillConfig.damage_scales`). Knows nothing of training, gates or registries."""

from __future__ import annotations

import torch


class LoraScale:
    """Scales a trained adapter's LoRA deltas (its B matrices) in place, from a copy of the trained ones, so every
    scale is exact and `set(1.0)` gives back the trained weights bit for bit; what `save_pretrained` writes is
    the adapter at the scale last set. A smaller delta moves the generic prompts less (the damage gate) and
    answers a fact the adapter holds with a margin to spare."""

    def __init__(self, peft_model: torch.nn.Module) -> None:
        self._params = [(p, p.detach().clone()) for n, p in peft_model.named_parameters() if "lora_B" in n]
        if not self._params:
            raise ValueError("LoraScale: the model has no LoRA B matrices")

    @torch.no_grad()
    def set(self, scale: float) -> None:
        if not 0.0 < scale <= 1.0:
            raise ValueError(f"LoraScale: a scale must be in (0, 1], got {scale!r}")
        for p, trained in self._params:
            p.copy_(trained if scale == 1.0 else trained * scale)

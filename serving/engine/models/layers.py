"""The small element-wise pieces of a Llama-family decoder layer, as pure functions of tensors (no modules, no
state), so that each can run eagerly or under torch.compile (compile.py) with the same arguments.

Each computes what transformers' modules compute, in the same floating-point operations in the same order
(RMSNorm in float32 as a mean of squares, `x * cos + rotate_half(x) * sin`, `silu(gate) * up`): the layer's
numbers are the HF forward's (tests/serving/engine/test_fast_layers.py). What differs is how many operators
run: an operator with a Python scalar operand wraps it in a tensor first (4 more operators on a CPU, each
time), so the norm's epsilon and width come as 0-dim tensors made once (`Norm`); no cast of float32 to itself;
rotary on the queries and keys at once; gate and up from one packed projection. On a GPU the norm itself is
torch's `rms_norm` (one fused kernel where torch has one for the device, in place of nine: a decode step on the
8B shape ran ~27 of its ~40 kernels a layer in norms, benchmarks/results/gpu/h200/step_profile_qwen3_8b.json),
then the weight: the same two roundings as transformers' (the normalised value in x's dtype, then times the
weight). On a CPU `rms_norm` is not fused (it decomposes into more operators), so the CPU keeps the form above.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# devices whose norms run torch's rms_norm (module docstring); a test adds "cpu" to check the form's numbers
FUSED_NORM_DEVICES = frozenset({"cuda"})


class Norm(NamedTuple):
    """An RMSNorm's weight [n] (or [heads, d] for per-head norms), its epsilon and its width as 0-dim float32
    tensors on the weight's device (a mean is a sum divided by the width: the same division), and its epsilon
    as a number (torch's rms_norm takes one)."""

    weight: torch.Tensor
    eps: torch.Tensor
    width: torch.Tensor
    eps_value: float

    @classmethod
    def of(cls, weight: torch.Tensor, eps: float) -> Norm:
        def scalar(v: float) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.float32, device=weight.device)

        return cls(weight, scalar(eps), scalar(weight.shape[-1]), float(eps))


def rms_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """transformers' RMSNorm (Llama's, Qwen's): weight * (h * rsqrt(mean(h^2) + eps)), h = x in float32, back
    in x's dtype before the weight."""
    if x.device.type in FUSED_NORM_DEVICES:  # the normalised value in x's dtype, then the weight
        return norm.weight * F.rms_norm(x, (x.shape[-1],), None, norm.eps_value)
    h = x if x.dtype == torch.float32 else x.float()
    h = h * torch.rsqrt((h * h).sum(-1, keepdim=True).div_(norm.width).add_(norm.eps))
    return norm.weight * (h if x.dtype == torch.float32 else h.to(x.dtype))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add and the next norm: (rms_norm(residual + x), residual + x)."""
    residual = residual + x
    return rms_norm(residual, norm), residual


def rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [T, heads, d] (queries and keys together): x * cos + rotate_half(x) * sin,
    rotate_half(x) * sin computed as x's two halves swapped times `sin_signed` (sin with its first half
    negated: `signed_sin`), the same products. cos, sin_signed [T, 1, d]."""
    t, n, d = x.shape
    swapped = x.view(t, n, 2, d // 2).flip(2).view(t, n, d)
    return x * cos + swapped * sin_signed


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., d] with its first half negated (rotary's rotate_half folded into it), once per step."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a packed [T, 2 * I] gate/up projection."""
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :half]) * gate_up[:, half:]

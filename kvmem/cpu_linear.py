"""Linear layers on oneDNN with prepacked weights, for inference on CPU (what vLLM's CPU backend does).

PyTorch's default CPU matmul for a decode step (a few rows times a large weight) reads the weight in its
stored order; oneDNN's linear over a weight reordered once into its blocked layout reads it ~2x faster, and
much faster for the lm_head at 2-16 rows (measured on the 2-core AMD EPYC, 49,152 x 576 fp32: 1 row 11.9 ->
5.5 ms, 8 rows 48.8 -> 16.9 ms). `pack_linears` keeps each layer's weight as it is (state dicts, digests,
peft, training and copies are untouched) and adds the packed copy beside it; a layer uses the packed copy
only under no-grad or inference mode and only while its weight is the tensor it was packed from, unchanged
(same storage, same version counter), else it runs the plain `F.linear`.

Costs one extra copy of the linear weights in RAM; `pack_linears` packs nothing when that copy would take
more than a quarter of the machine's memory, or when the CPU or the dtype is not supported (oneDNN's bf16
path needs AVX512-BF16 or AVX-NE-CONVERT): float32 only, CPU only.
"""

from __future__ import annotations

import logging
import os
import types

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ATTR = "_kvmem_onednn"  # a _Packed on a packed layer


class _Packed:
    """A layer's packed weight and the weight it was packed from (its storage and version counter). A copy of
    the model (copy.deepcopy, as distillation makes) gets None: oneDNN's opaque tensors cannot be copied, and
    the copy's weights are other tensors anyway."""

    __slots__ = ("weight", "ptr", "version")

    def __init__(self, weight: torch.Tensor, ptr: int, version: int) -> None:
        self.weight, self.ptr, self.version = weight, ptr, version

    def __deepcopy__(self, memo) -> None:
        return None


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed = getattr(self, ATTR, None)
    w = self.weight
    if (
        packed is None
        or torch.is_grad_enabled()
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or w.data_ptr() != packed.ptr
        or w._version != packed.version
    ):
        return F.linear(x, w, self.bias)
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed.weight, self.bias, "none", [], "")
    return y.view(*shape[:-1], y.shape[-1])


def _total_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def supported() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_linears(model: torch.nn.Module, batch_hint: int = 8) -> int:
    """Give every plain float32 `nn.Linear` on CPU in `model` a oneDNN-packed copy of its weight; returns how
    many were packed (0 when unsupported or too large: see the module docstring). Idempotent."""
    layers = [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
        and getattr(m, ATTR, None) is None
    ]
    if not layers or not supported():
        return 0
    extra = sum({m.weight.data_ptr(): m.weight.nbytes for m in layers}.values())
    ram = _total_ram_bytes()
    if ram and extra > ram // 4:
        log.info("oneDNN linear packing skipped: %d MiB more than a quarter of RAM", extra >> 20)
        return 0
    packed_by_ptr: dict[int, torch.Tensor] = {}  # tied weights (lm_head = embeddings) packed once
    try:
        with torch.no_grad():
            for m in layers:
                w = m.weight
                if w.data_ptr() not in packed_by_ptr:
                    packed_by_ptr[w.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(
                        w.detach(), batch_hint
                    )
                setattr(m, ATTR, _Packed(packed_by_ptr[w.data_ptr()], w.data_ptr(), w._version))
                m.forward = types.MethodType(_packed_forward, m)
    except RuntimeError as exc:  # a CPU without the kernels oneDNN needs: plain linears
        log.info("oneDNN linear packing unavailable: %s", str(exc).splitlines()[0])
        unpack_linears(model)
        return 0
    return len(layers)


def unpack_linears(model: torch.nn.Module) -> None:
    """Drop the packed copies: every layer runs the plain `F.linear` again."""
    for m in model.modules():
        if getattr(m, ATTR, None) is not None:
            delattr(m, ATTR)
            m.__dict__.pop("forward", None)

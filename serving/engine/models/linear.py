"""A projection of the engine's own layer: one or more of a checkpoint's linear layers packed into one weight
at load (q/k/v, gate/up), so a layer runs one matmul where the HF module runs three or two.

On a CPU in float32 with oneDNN (kvmem/cpu_linear.py: what the loader gives the HF modules too) the packed
weight is kept only in oneDNN's blocked layout, the layout its linear reads fastest; elsewhere the packed
weight is one tensor and the HF modules' weights become views of it (no second copy of the weights on a GPU).
Knows nothing of attention or of the model's layer order.
"""

from __future__ import annotations

import torch

from kvmem import cpu_linear


def _base(module: torch.nn.Module) -> torch.nn.Module:
    """The plain layer under a peft LoRA wrapper (its adapters run on the generic path: runner.py)."""
    return getattr(module, "base_layer", module)


def _uses_onednn(layers: list[torch.nn.Module]) -> bool:
    """The loader gave these layers oneDNN copies (float32 on a CPU): the packed weight gets one too."""
    return all(getattr(m, cpu_linear.ATTR, None) is not None for m in layers)


class Packed:
    """The weights (and biases) of `modules`' base layers, concatenated along the output dimension; called on
    x [T, in] it returns [T, sum of outs]. `sources`: each source weight with its data pointer and version
    counter when packed (`stale` says whether one was changed or replaced since)."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        layers = [_base(m) for m in modules]
        assert all(isinstance(m, torch.nn.Linear) for m in layers), (
            "plain linear layers only (models.why_not)"
        )
        weights = [m.weight for m in layers]
        self.sizes = [w.shape[0] for w in weights]
        self.bias = None
        if any(m.bias is not None for m in layers):
            self.bias = torch.cat(
                [
                    m.bias.detach() if m.bias is not None else w.new_zeros(w.shape[0])
                    for m, w in zip(layers, weights, strict=True)
                ]
            )
        self.onednn = None
        self.weight = None
        with torch.no_grad():
            if _uses_onednn(layers):
                if len(layers) == 1:  # the loader's own oneDNN copy: no second one
                    self.onednn = getattr(layers[0], cpu_linear.ATTR).weight
                else:
                    whole = torch.cat([w.detach() for w in weights])  # [outs, in], dropped once reordered
                    self.onednn = torch.ops.mkldnn._reorder_linear_weight(whole, 8)
            elif len(layers) == 1:
                self.weight = weights[0].detach()
            else:
                self.weight = torch.cat([w.detach() for w in weights])  # [outs, in]
                start = 0
                for w, n in zip(weights, self.sizes, strict=True):  # the HF modules now read the packed copy
                    w.data = self.weight[start : start + n]
                    start += n
        self.sources = [(w, w.data_ptr(), w._version) for w in weights]
        # [in, outs]: what F.linear multiplies by, as a view made once (F.linear makes it on every call)
        self.weight_t = None if self.weight is None else self.weight.t()

    @property
    def stale(self) -> bool:
        """A source weight was written in place or replaced since it was packed (its copy is out of date)."""
        return any(w.data_ptr() != ptr or w._version != version for w, ptr, version in self.sources)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight_t)  # x [T, in]: F.linear's own matmul, one operator
        return torch.addmm(self.bias, x, self.weight_t)

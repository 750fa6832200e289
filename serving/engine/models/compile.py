"""The fast layer's element-wise functions, eager or under torch.compile.

`functions(compile=False)` returns layers.py's functions as they are. With compile=True each is wrapped in
torch.compile (inductor; dynamic shapes, so one compiled kernel serves every token count), its artifacts
cached on disk under `cache_dir` (inductor's FX graph cache and its kernels: a restart with the same data
dir loads them instead of compiling again); `warm` runs each once at load so the compile happens there, not
on the first request, and its time is logged.
"""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import torch

from serving.engine.models import layers

log = logging.getLogger(__name__)

NAMES = ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul")


def functions(compile: bool, cache_dir: str | None = None) -> SimpleNamespace:
    """The element-wise functions, each eager or compiled; `.compiled` says which."""
    fns = {n: getattr(layers, n) for n in NAMES}
    if not compile:
        return SimpleNamespace(compiled=False, **fns)
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)  # read when inductor first caches
        torch._inductor.config.fx_graph_cache = True
    return SimpleNamespace(compiled=True, **{n: torch.compile(f, dynamic=True) for n, f in fns.items()})


def warm(decoder, model: torch.nn.Module) -> float:
    """Runs each compiled function once on tensors of the model's shapes (compiling it, or loading it from the
    cache); logs and returns the seconds it took."""
    start = time.perf_counter()
    layer = decoder.layers[0]
    param = next(model.parameters())
    hidden = layer.input_norm.weight.shape[0]
    heads, kv, d = layer.heads, layer.kv_heads, layer.head_dim
    fns = decoder.fns
    with torch.inference_mode():
        for t in (1, 3):  # two token counts: the dynamic-shape kernel, not one specialised to 1
            x = torch.zeros(t, hidden, dtype=param.dtype, device=param.device)
            fns.rms_norm(x, layer.input_norm)
            fns.add_rms_norm(x, x, layer.input_norm)
            qk = torch.zeros(t, heads + kv, d, dtype=param.dtype, device=param.device)
            if layer.qk_norm is not None:
                fns.rms_norm(qk, layer.qk_norm)
            table = torch.zeros(t, 1, d, dtype=param.dtype, device=param.device)
            fns.rotary(qk, table, table)
            inter = layer.gate_up.sizes[0]
            fns.silu_and_mul(torch.zeros(t, 2 * inter, dtype=param.dtype, device=param.device))
    seconds = time.perf_counter() - start
    log.info("engine layers: torch.compile of the element-wise functions took %.1f s at start", seconds)
    return seconds

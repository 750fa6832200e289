"""Where a token's K/V goes in vLLM's paged cache on a GPU, and which attention backends we can write.

Owns the GPU write of our connector: which of vLLM's attention backends and KV cache dtypes it supports (the
rest are refused at start, naming what is supported), the check that a layer's cache view follows the layout
vLLM resolved, and the write itself, by tensor indexing. Knows nothing of items, stores or requests: it is
given one layer's cache view, K/V in our item format and slots. The CPU backend is not written here: its
blocks have an ISA-dependent interior, so the connector keeps vLLM's own CPU cache-write op for it.

What vLLM 0.32 hands a connector (read from vllm/v1/kv_cache_interface.py `create_kv_cache_views`,
vllm/v1/worker/utils.py `allocate_kv_cache`, vllm/v1/kv_cache_layout.py `KVCacheLayout`): one flat buffer per
cache group, viewed per layer as a logical `[num_blocks, num_kv_heads, block_size, head_size + head_size_v]`
tensor (`[B, H, N, C]`; K is `C[:head_size]`, V the rest) whose strides follow one engine-wide layout, a
permutation of `[L, B, H, N, C]` (`cache_config.kv_cache_layout`, resolved from what every backend declares
in `supported_kv_cache_layouts()`; e.g. LBNHC, the default, is "NHD" per layer, LBHNC "HND", BLNHC blocks of
all layers side by side). The older `get_kv_cache_shape` / `get_kv_cache_stride_order` static methods are gone
in 0.32: the layout is the stride order. Writing through the logical view by index is correct for every
layout because the strides carry it; `check_layer_view` refuses a view whose strides are not the layout's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serving.backends.base import BackendError

# vLLM attention backends (their `get_name()`) whose pages are the plain logical [B, H, N, 2 * head_size]
# view above, K then V in C, unquantized: FlashAttention (vllm/v1/attention/backends/flash_attn.py,
# `kv_cache.transpose(1, 2).split(head_size, dim=-1)`), FlashInfer (flashinfer.py, `kv_cache.permute(
# *layout.layer_view_order)` then `split(head_size, dim=-1)`) and Triton (triton_attn.py, as FlashAttention).
SUPPORTED_GPU_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
CPU_BACKEND = "CPU_ATTN"  # written by vLLM's CPU cache op (vllm_connector), never by index
# `cache_config.cache_dtype` values whose pages hold the model's own K/V values ("auto": the model dtype)
SUPPORTED_CACHE_DTYPES = ("auto", "float16", "bfloat16")


class UnsupportedKVCache(BackendError):
    """vLLM chose a KV cache our connector cannot write (an MLA or unknown attention backend, a quantized
    cache dtype, a view that is not the layout's): raised at start, before any request is served."""


def _supported_backends() -> str:
    return ", ".join((*SUPPORTED_GPU_BACKENDS, CPU_BACKEND))


def _refuse_mla(what: str) -> UnsupportedKVCache:
    return UnsupportedKVCache(
        f"the vllm backend cannot load stored KV into {what}: MLA caches a latent vector, not K/V heads; "
        f"supported attention backends: {_supported_backends()}"
    )


def _refuse_dtype(cache_dtype: str, what: str) -> UnsupportedKVCache:
    return UnsupportedKVCache(
        f"the vllm backend cannot load stored KV into a {cache_dtype!r} KV cache ({what}): quantized KV "
        f"caches are not supported; supported kv_cache_dtype: {', '.join(SUPPORTED_CACHE_DTYPES)}"
    )


def check_supported(backend_name: str, *, cache_dtype: str, use_mla: bool) -> None:
    """Raise UnsupportedKVCache unless our connector writes this backend's cache. MLA (one latent vector per
    token, no K/V heads) is refused on every platform; on a GPU, so are unknown backends and quantized caches
    (fp8 and the like: our items hold the model's K/V, and the scales would be vLLM's). The CPU backend is
    accepted as before (vLLM's CPU op writes what it takes)."""
    if use_mla or "MLA" in backend_name.upper():
        raise _refuse_mla(f"the MLA attention backend {backend_name}")
    if backend_name == CPU_BACKEND:
        return
    if backend_name not in SUPPORTED_GPU_BACKENDS:
        raise UnsupportedKVCache(
            f"the vllm backend cannot load stored KV into vLLM's {backend_name} attention backend; supported "
            f"attention backends: {_supported_backends()} (choose one with vLLM's attention_backend setting)"
        )
    if cache_dtype not in SUPPORTED_CACHE_DTYPES:
        raise _refuse_dtype(cache_dtype, backend_name)


def check_engine_config(*, use_mla: bool, cache_dtype: str, on_cpu: bool) -> None:
    """What `check_supported` refuses that the engine config alone shows, before any worker starts: an MLA
    model everywhere, a quantized KV cache on a GPU (the CPU path takes what vLLM's CPU op takes, as before)."""
    if use_mla:
        raise _refuse_mla("a model with multi-head latent attention (MLA)")
    if not on_cpu and cache_dtype not in SUPPORTED_CACHE_DTYPES:
        raise _refuse_dtype(cache_dtype, "kv_cache_dtype of the engine")


def physical_order(layout_stride_order: Sequence[int]) -> tuple[int, ...]:
    """The axes of a per-layer [B, H, N, C] view from outermost to innermost in memory, given a layout's
    5-D stride order over [L, B, H, N, C] (`KVCacheLayout.value`): the order without L, shifted down by one."""
    return tuple(axis - 1 for axis in layout_stride_order if axis != 0)


def check_layer_view(
    layer_name: str, cache: torch.Tensor, layout_name: str, layout_stride_order: Sequence[int]
) -> None:
    """Raise UnsupportedKVCache unless `cache` is a 4-D [B, H, N, C] view with an even C whose strides
    decrease in the layout's physical order (axes of size 1 aside: their stride is free)."""
    if cache.dim() != 4 or cache.shape[-1] % 2:
        raise UnsupportedKVCache(
            f"KV cache of layer {layer_name}: expected a [num_blocks, kv_heads, block_size, 2 * head_size] "
            f"view, got shape {tuple(cache.shape)}"
        )
    order = [axis for axis in physical_order(layout_stride_order) if cache.shape[axis] > 1]
    strides = [cache.stride(axis) for axis in order]
    if strides != sorted(strides, reverse=True) or (order and order[-1] == 3 and strides[-1] != 1):
        raise UnsupportedKVCache(
            f"KV cache of layer {layer_name}: strides {cache.stride()} of shape {tuple(cache.shape)} do not "
            f"follow the resolved KV cache layout {layout_name}"
        )


def write_tokens(cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Write K/V of tokens into one layer's paged cache. `cache`: the layer's [num_blocks, kv_heads, block_size,
    2 * head_size] view, any strides; `kv`: [2, kv_heads, tokens, head_size] (our item format, one layer);
    `slots`: [tokens] int64, block id * block size + offset, the slot mapping vLLM's own cache writes use.
    The block size is the view's own (a manager block vLLM splits into kernel blocks is split in order, so
    slot // block_size is right for either)."""
    num_kv_heads, num_tokens, head_size = kv.shape[1], kv.shape[2], kv.shape[3]
    assert kv.shape[0] == 2 and slots.shape == (num_tokens,), (tuple(kv.shape), tuple(slots.shape))
    assert cache.shape[1] == num_kv_heads and cache.shape[3] == 2 * head_size, (cache.shape, kv.shape)
    slots = slots.to(cache.device)
    blocks = slots // cache.shape[2]  # [tokens]
    offsets = slots % cache.shape[2]  # [tokens]
    kv = kv.to(device=cache.device, dtype=cache.dtype)
    # advanced indices around a slice put the token axis first: cache[blocks, :, offsets] is [tokens, heads, C]
    cache[blocks, :, offsets, :head_size] = kv[0].transpose(0, 1)  # [tokens, kv_heads, head_size]
    cache[blocks, :, offsets, head_size:] = kv[1].transpose(0, 1)

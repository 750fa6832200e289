"""Backends by name: a tiny registry; each backend's heavy imports stay inside its own module.

`create_backend(config)` builds one without loading weights (the server calls `load()` in a thread).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from serving.backends.base import (
    Backend,
    BackendError,
    GenerationRequest,
    GenerationResult,
    LaidOutPrompt,
    NotReady,
    PromptTooLong,
    QueueFull,
    SamplingParams,
    TokenDelta,
)
from serving.config import DEFAULT_MODEL, ServingConfig

__all__ = [
    "Backend",
    "BackendError",
    "GenerationRequest",
    "GenerationResult",
    "LaidOutPrompt",
    "NotReady",
    "PromptTooLong",
    "QueueFull",
    "SamplingParams",
    "TokenDelta",
    "create_backend",
    "supported_backends",
]


def _fake(config: ServingConfig) -> Backend:
    from serving.backends.fake import FakeBackend

    return FakeBackend(queue_size=config.queue_size)


def _transformers(config: ServingConfig) -> Backend:
    from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig

    model = None if config.model == DEFAULT_MODEL else config.model
    return TransformersBackend(
        TransformersBackendConfig(
            model=model,
            device=config.device,
            dtype=config.dtype,
            data_dir=str(config.data_dir),
            max_queue=config.queue_size,
            session_kv_bytes=config.session_kv_bytes,
            kv_pool_mb=config.kv_pool_mb,
            kv_pool_fraction=config.kv_pool_fraction,
            kv_wait_s=config.kv_wait_s,
            kv_user_bytes=None if config.kv_user_mb is None else config.kv_user_mb << 20,
            kv_evict_policy=config.kv_evict_policy,
            host_kv_bytes=config.kv_host_mb << 20,
            disk_kv_bytes=None if config.kv_disk_gb is None else int(config.kv_disk_gb * 1e9),
            cuda_graphs=config.cuda_graphs,
            engine_layers=config.engine_layers,
            prefill_graphs=config.prefill_graphs,
        )
    )


def _vllm(config: ServingConfig) -> Backend:
    if importlib.util.find_spec("vllm") is None:
        raise BackendError("the vllm backend needs the vllm package: pip install 'kvmem[vllm]'")
    from serving.backends.vllm.backend import VllmBackend, VllmBackendConfig

    model = None if config.model == DEFAULT_MODEL else config.model
    # dtype "auto" keeps the backend's own default (float32: see VllmBackendConfig.dtype); --kv-pool-mb,
    # when given, sizes vLLM's paged KV cache (the fastest tier, as the engine's page pool is)
    dtype = {} if config.dtype == "auto" else {"dtype": config.dtype}
    pool = {} if config.kv_pool_mb is None else {"kv_cache_bytes": config.kv_pool_mb << 20}
    return VllmBackend(
        VllmBackendConfig(
            model=model,
            data_dir=str(config.data_dir),
            max_queue=config.queue_size,
            enable_lora=config.enable_lora,
            host_kv_bytes=config.kv_host_mb << 20,
            disk_kv_bytes=None if config.kv_disk_gb is None else int(config.kv_disk_gb * 1e9),
            **pool,
            **dtype,
        )
    )


_REGISTRY: dict[str, Callable[[ServingConfig], Backend]] = {
    "fake": _fake,
    "transformers": _transformers,
    "vllm": _vllm,
}


def supported_backends() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def create_backend(config: ServingConfig) -> Backend:
    """The backend named by `config.backend`. Raises ValueError for an unknown name, BackendError if the
    backend cannot be constructed here (e.g. its package is not installed)."""
    factory = _REGISTRY.get(config.backend)
    if factory is None:
        raise ValueError(f"unknown backend {config.backend!r}; supported: {', '.join(supported_backends())}")
    return factory(config)

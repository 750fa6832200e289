"""The transformers backend's settings (`kvmem serve`'s engine flags land here), checked when made: a bad value
is a ValueError naming the field. Imported by backend.py, which re-exports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransformersBackendConfig:
    model: str | None = None  # alias, local dir, .gguf file or HF id; None = the default model
    device: str = "auto"  # cpu, cuda[:n] or auto (cuda when available, else cpu)
    dtype: str | None = None  # None or auto: float32 on CPU, bfloat16 on a GPU that has it (else float32)
    data_dir: str = ".kvmem"
    max_queue: int = 16  # requests admitted at once (running + waiting); more -> QueueFull (429)
    # the store's tiers of stored blocks (`--kv-host-mb`, `--kv-disk-gb`); None: unlimited. Their device tier is
    # the page pool (kv_pool_mb): the store keeps none, so a block is never on the device twice
    host_kv_bytes: int | None = 4 << 30
    disk_kv_bytes: int | None = None
    system_prompt: str | None = None
    session_kv_bytes: int = (
        1 << 30
    )  # live sessions' KV caches (serving/engine/sessions.py), all users; 0: no reuse
    sessions_per_user: int = 4  # live sessions kept per user, least recently used dropped first
    prefill_chunk_tokens: int = 512  # a longer prefill runs in chunks between other requests' decode steps
    # the engine's KV page pool (serving/engine), where every request's K/V lives; None: 1024 MiB on CPU, on a
    # GPU kv_pool_fraction of the device memory free after the model loaded
    kv_pool_mb: int | None = None
    kv_pool_fraction: float = 0.8  # serving.engine.pages.DEVICE_POOL_FRACTION
    kv_page_tokens: int = 16  # tokens per KV page
    cuda_graphs: bool = (
        True  # on a CUDA device, the engine's pure decode steps replay CUDA graphs (graphs.py)
    )
    # "auto": the engine's own fused layers (serving/engine/models) when the model qualifies, else the generic
    # path with a log line saying why; "generic": the HF forward always
    engine_layers: str = "auto"
    # lone prefill chunks padded to buckets over static buffers (serving/engine/prefill_graphs.py): "auto" on a
    # CUDA device when cuda_graphs is on (captured at load), "on" also on CPU (run eagerly), "off" never
    prefill_graphs: str = "auto"
    kv_wait_s: float = 10.0  # a request waits this long for KV pages, then gets 429
    # the pool pages one user's cached K/V may keep (their blocks, cached prefixes, sessions: `--kv-user-mb`);
    # None: no quota. kv_evict_policy: which unread K/V goes first when the pool is short, "lru" or "heat"
    # (the coldest user's first, by `pool.residency.heat`; residency.py)
    kv_user_bytes: int | None = None
    kv_evict_policy: str = "lru"
    # a block build's prefill chunk (engine) while other requests decode: builds run in the background, so
    # theirs are small and a step that carries one delays the streams little (a 64-token chunk at ~4k tokens
    # of context took ~0.85 s on 2 CPU cores against a 0.09 s decode step); with nothing else decoding a
    # build takes prefill_chunk_tokens at a time
    build_chunk_tokens: int = 16
    # and at most this many chunk tokens x tokens of context while others decode: on 2 CPU cores a 16-token
    # chunk's attention over 3.6k tokens took ~80 ms of a step whose decode row took ~90 ms; with 32,768 the
    # chunks stay 16 tokens up to 2k of context and shrink to 8 at 4k
    build_attention_budget: int = 32768

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"TransformersBackendConfig.max_queue must be >= 1, got {self.max_queue}")
        if self.session_kv_bytes < 0 or self.sessions_per_user < 1:
            raise ValueError(
                "TransformersBackendConfig needs session_kv_bytes >= 0 and sessions_per_user >= 1"
            )
        if not 0 < self.kv_pool_fraction <= 1:
            raise ValueError(
                f"TransformersBackendConfig.kv_pool_fraction must be in (0, 1], got {self.kv_pool_fraction}"
            )
        if (
            (self.kv_pool_mb is not None and self.kv_pool_mb < 1)
            or any(b is not None and b < 0 for b in (self.host_kv_bytes, self.disk_kv_bytes))
            or self.kv_page_tokens < 1
            or self.kv_wait_s < 0
            or self.build_chunk_tokens < 1
            or self.build_attention_budget < 1
        ):
            raise ValueError(
                "TransformersBackendConfig needs kv_pool_mb >= 1 (every request's K/V lives in it), "
                "host_kv_bytes and disk_kv_bytes >= 0 or None, "
                "kv_page_tokens >= 1, kv_wait_s >= 0, "
                "build_chunk_tokens >= 1 and build_attention_budget >= 1"
            )
        if self.prefill_chunk_tokens < 1:
            raise ValueError(
                f"TransformersBackendConfig.prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}"
            )
        if self.engine_layers not in ("auto", "generic"):
            raise ValueError(
                f"TransformersBackendConfig.engine_layers must be 'auto' or 'generic', got {self.engine_layers!r}"
            )
        if self.prefill_graphs not in ("auto", "on", "off"):
            raise ValueError(
                "TransformersBackendConfig.prefill_graphs must be 'auto', 'on' or 'off', "
                f"got {self.prefill_graphs!r}"
            )

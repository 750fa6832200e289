"""The vLLM backend's settings: the engine's model, dtype, KV cache and queue sizes, LoRA, the stored-KV tier.

Owns the settings and their checks at construction only; the backend (backend.py) and the engine it starts
(engine.py) read them. Knows nothing of vLLM itself, requests or how the engine is stepped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmBackendConfig:
    model: str | None = None  # local safetensors dir or HF id; None = the default model (provisioned)
    data_dir: str = ".kvmem"
    max_queue: int = 16  # requests admitted at once (running + waiting); more -> QueueFull (429)
    kv_cache_bytes: int = 1 << 30  # vLLM's paged KV cache (on CPU: host memory)
    block_size: int | None = None  # vLLM's KV block size; None = the platform default (128 on CPU)
    max_model_len: int | None = None  # None = the model's context length
    system_prompt: str | None = None
    enable_lora: bool = False
    max_lora_rank: int = 8
    seed: int = 0  # vLLM seeds this process's global RNGs with it (the engine runs in-process)
    # vLLM's model dtype. float32 on CPU (bf16 is ~10x slower there); on a CUDA GPU float32 runs vLLM's Triton
    # attention, bfloat16/float16 its FlashAttention (FlashInfer on Blackwell): all three take stored KV.
    # `kvmem serve --dtype` sets it; its "auto" keeps this default
    dtype: str = "float32"
    host_kv_bytes: int | None = 2 << 30  # RAM tier of stored KV items (verified once, then lent by reference)
    disk_kv_bytes: int | None = None  # disk tier of stored KV items; None: unlimited

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"VllmBackendConfig.max_queue must be >= 1, got {self.max_queue}")
        if self.kv_cache_bytes < 1 << 20:
            raise ValueError(f"VllmBackendConfig.kv_cache_bytes must be >= 1 MiB, got {self.kv_cache_bytes}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"VllmBackendConfig.block_size must be >= 1, got {self.block_size}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"VllmBackendConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}"
            )

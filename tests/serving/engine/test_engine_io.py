"""The store's disk work runs off the model thread: a request whose KV item is on disk is admitted to the
model loop once an I/O thread has loaded and verified it, while the other streams keep decoding; a block
build prefills on the model thread and writes (file, fsync, SHA-256) on an I/O thread, visible to readers
only once written; a corrupt item read on the I/O thread means full prefill, a log line and a fallback kind.

Ordering is asserted on recorded events, never on wall-clock time."""

from __future__ import annotations

import asyncio
import threading

import pytest

import kvmem.kv.store as store_module
from serving.backends.base import GenerationRequest, GenerationResult, SamplingParams, TokenDelta
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
from tests.conftest import EngineForwards

MEMORIES = ["I live in Lisbon.", "My dog is called Miso.", "I play the violin on Tuesdays."]


@pytest.fixture
def disk_backend(tmp_path, tiny_handle):
    """The tiny llama with RAM tiers of 0 bytes: every stored item lives on disk only."""
    model_dir = tmp_path / "model"
    tiny_handle.model.save_pretrained(model_dir)
    tiny_handle.tokenizer.save_pretrained(model_dir)
    backend = TransformersBackend(
        TransformersBackendConfig(model=str(model_dir), data_dir=str(tmp_path / "data"), host_kv_bytes=0)
    )
    backend.load()
    yield backend
    asyncio.run(backend.aclose())


def request(backend, rid: str, question: str, block=None, max_new: int = 6) -> GenerationRequest:
    prompt = backend.layout_prompt(
        MEMORIES if block else [],
        [],
        [{"role": "user", "content": question}],
        block.token_ids if block else None,
    )
    return GenerationRequest(
        rid,
        "u",
        prompt,
        block.item_id if block else None,
        SamplingParams(max_new_tokens=max_new, temperature=0),
    )


async def collect(backend, req, events: list, lock: threading.Lock) -> tuple[list[int], GenerationResult]:
    ids, result = [], None
    async for item in backend.stream(req):
        if isinstance(item, TokenDelta):
            ids.extend(item.token_ids)
            with lock:  # one event a token: a delta can carry two (text held back until it decodes whole)
                events.extend([(req.request_id, "token")] * len(item.token_ids))
        else:
            result = item
    return ids, result


def test_a_disk_item_loads_on_an_io_thread_while_another_stream_decodes(disk_backend):
    backend = disk_backend
    block = backend.build_block("u", MEMORIES, ["m1", "m2", "m3"])
    assert backend.store.tier_of(block.item_id) == "disk"
    slow = request(backend, "slow", "Where do I live?", block, max_new=5)
    other = request(backend, "other", "What is the capital of France, and why?", max_new=9)
    alone = asyncio.run(collect(backend, slow, [], threading.Lock()))  # the reference: no hook
    assert alone[1].cached_tokens == block.num_tokens and alone[1].kv_fallback_reason is None
    backend.pool.prefix.drop_user("u")  # the repeat below starts from the block, not the prefix cache

    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    load_started, release = threading.Event(), threading.Event()
    reads: list[tuple[str, bool]] = []  # (reading thread, whether the test released it before its guard)

    def slow_read(item_id: str) -> None:  # the injected delay: the read waits until the test says go
        with lock:
            events.append(("slow", "load started"))
        load_started.set()
        released = release.wait(timeout=120)  # a guard against a hang only; the test releases it
        reads.append((threading.current_thread().name, released))

    backend.store.before_disk_read = slow_read
    try:

        async def scenario():
            slow_task = asyncio.create_task(collect(backend, slow, events, lock))
            assert await asyncio.to_thread(load_started.wait, 120)
            other_out = await collect(backend, other, events, lock)  # runs while the load waits
            with lock:
                events.append(("test", "released"))
            release.set()
            return await slow_task, other_out

        (slow_ids, slow_result), (other_ids, _) = asyncio.run(scenario())
    finally:
        backend.store.before_disk_read = None
    assert len(reads) == 1 and reads[0][0].startswith("kvmem-io") and reads[0][1]
    assert len(other_ids) == 9
    assert events == (
        [("slow", "load started")]
        + [("other", "token")] * 9
        + [("test", "released")]
        + [("slow", "token")] * len(slow_ids)
    )
    assert slow_ids == alone[0] and slow_result.cached_tokens == block.num_tokens  # injected, same tokens


def test_a_corrupt_item_read_on_the_io_thread_falls_back_to_full_prefill(disk_backend, caplog):
    backend = disk_backend
    block = backend.build_block("u", MEMORIES, ["m1", "m2", "m3"])
    req = request(backend, "r", "What is my dog called?", block)
    threads: list[str] = []
    backend.store.before_disk_read = lambda _id: threads.append(threading.current_thread().name)
    tensor_file = backend.store.directory / f"{block.item_id}.safetensors"
    data = bytearray(tensor_file.read_bytes())
    data[-5] ^= 0xFF  # same size, wrong checksum
    tensor_file.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        ids, result = asyncio.run(collect(backend, req, [], threading.Lock()))
    assert threads and threads[0].startswith("kvmem-io")
    assert result.kv_fallback_reason == "corrupt" and result.cached_tokens == 0
    assert any("KV fallback for request r" in r.getMessage() for r in caplog.records)
    plain = GenerationRequest("p", "u", req.prompt, None, req.sampling)  # the same ids, no item
    assert ids == asyncio.run(collect(backend, plain, [], threading.Lock()))[0]
    assert not backend.store.contains(block.item_id)  # dropped; the next build replaces it


def test_a_build_prefills_on_the_model_thread_and_writes_on_an_io_thread(disk_backend, monkeypatch):
    backend = disk_backend
    forwards: list[str] = []
    hook = EngineForwards(lambda ids: forwards.append(threading.current_thread().name))
    # (writing thread, whether readers could see the item mid-write, whether the write was paced)
    writes: list[tuple[str, bool, bool]] = []
    real_save = store_module.save_item

    def save(item, directory, pace=None):
        writes.append(
            (threading.current_thread().name, backend.store.contains(item.item_id), pace is not None)
        )
        return real_save(item, directory, pace)

    monkeypatch.setattr(store_module, "save_item", save)
    try:
        built = backend.build_block("u", MEMORIES[:2], ["m1", "m2"])
    finally:
        hook.remove()
    assert built.built and forwards == ["kvmem-model"]  # one prefill, on the model thread
    assert len(writes) == 1 and writes[0][0].startswith("kvmem-io") and writes[0][1:] == (False, True)
    assert backend.store.contains(built.item_id) and backend.store.is_valid_on_disk(built.item_id)
    again = backend.build_block("u", MEMORIES[:2], ["m1", "m2"])  # stored: found, not rebuilt
    assert not again.built and again.item_id == built.item_id and len(writes) == 1


def test_a_knowledge_childs_own_kv_is_read_on_the_model_thread_and_the_building_thread_copies_none(
    tmp_path, tiny_handle
):
    """The engine reads a block's K/V after its knowledge parent's tokens straight into the child's own
    tensor on the model thread. Slicing and copying it on the building thread ran a parallel torch copy there
    (184 MB for a 4k-token block of the default model): a second OpenMP team in the process."""

    from kvmem.kv import knowledge

    model_dir = tmp_path / "model"
    tiny_handle.model.save_pretrained(model_dir)
    tiny_handle.tokenizer.save_pretrained(model_dir)
    knowledge.install(tmp_path / "data", ["The office opens at nine.", "Parking is on level two."])
    backend = TransformersBackend(
        TransformersBackendConfig(model=str(model_dir), data_dir=str(tmp_path / "data"))
    )
    backend.load()
    try:
        _check_a_knowledge_child(backend)
    finally:
        asyncio.run(backend.aclose())


def _check_a_knowledge_child(backend) -> None:
    import torch
    from torch.overrides import TorchFunctionMode

    from kvmem.kv import build_item

    fresh: list[str] = []  # tensors with storage of their own made on this (the building) thread

    class Record(TorchFunctionMode):  # a mode is per thread: the model and I/O threads are not recorded
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out._base is None and out.numel() >= 1024:
                fresh.append(getattr(func, "__name__", str(func)))
            return out

    with Record():
        built = backend.build_block("u", MEMORIES, ["m1", "m2", "m3"])
    assert fresh == []
    item = backend.store.get(built.item_id)
    parent_tokens = item.meta.parent_tokens
    assert parent_tokens > 0 and built.shared_tokens == parent_tokens  # a knowledge child
    assert item.kv.shape[3] == item.num_tokens - parent_tokens and item.kv.is_contiguous()
    assert (
        item.meta.num_bytes == item.kv.numel() * item.kv.element_size() // item.kv.shape[3] * item.num_tokens
    )
    reference = build_item(backend.handle, item.token_ids, user_id="u")  # all its tokens, one prefill
    assert torch.allclose(item.kv, reference.kv[:, :, :, parent_tokens:], atol=1e-5, rtol=1e-4)
    empty = backend.build_block("u", [], [])  # no memories: whatever its own tokens are, it builds
    assert empty.built and backend.store.get(empty.item_id).num_tokens == empty.num_tokens

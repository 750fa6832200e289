"""Block builds in the engine's steps (the transformers backend's): a block's K/V computed as a request's prefill
is, in chunks packed with the running streams' decode steps, so a long build never stalls them; under the
user's LoRA adapter when it has one (held, never evicted, while the build runs). The knowledge item first when
the layout has one and it is not stored yet. Files are read and written on the I/O threads only; the K/V are
read from the build's pages on the model thread, a piece per model-loop turn.

A mixin of TransformersBackend: it uses its model loop (`_loop`), I/O threads (`_io`), handle, layout, store,
builder and adapter slots.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from serving.backends.base import BackendError, BuildCancelled
from serving.engine.model_loop import LoopClosed

READ_PIECE = 512  # tokens of a finished build's K/V read from its pages per model-loop turn (_read_steps)


class EngineBuilds:
    def _adapter_for_engine(self, user_id: str, adapter_id: str, pending) -> str:
        """`_hold_for_engine` on the model thread, the adapter's weights read and verified first on an I/O
        thread (the model thread only attaches them)."""
        self._io.submit(self.adapters.prefetch, user_id, adapter_id).result()
        return self._loop.call(lambda: self._hold_for_engine(user_id, adapter_id, pending))

    def _hold_for_engine(self, user_id: str, adapter_id: str, pending) -> str:
        """Model thread: the peft name of the user's adapter, loaded if needed and held (never evicted nor
        unloaded) for a build in the engine's steps. Raises BackendError when it cannot be loaded (the engine
        cannot run it, among others), or is not the version the block's address names."""
        name, why = self.adapters.resolve(user_id, adapter_id)
        if name is None or self.adapters.served[name] != pending.adapter:
            raise BackendError(f"adapter {adapter_id} of user {user_id!r} cannot be loaded: {why}")
        self.adapters.hold(name)
        return name

    def _build_under_adapter(self, pending, name: str):
        """The block's item under the held adapter `name`, computed in the engine's steps as a request under
        it is: chunked, batched with the streams. The whole block is its own (the shared knowledge item is
        the base model's, so no parent); `pending.prefix` is an earlier block of the same adapter."""
        try:
            kv = self._engine_kv(pending.ids, pending.prefix, 0, adapter=name)
        finally:
            try:
                self._loop.call_soon(lambda: self.adapters.unhold(name))
            except LoopClosed:  # closing: the adapters go with the model
                pass
        return self.builder.item_from_kv(pending, kv, None)

    def _build_in_engine(self, pending):
        """The block's item, its K/V computed by the engine as a request's prefill is: in chunks, in the steps
        every stream runs, so a long build never stalls them. The knowledge item (when the layout has one and
        it is not stored yet) first, the same way. Files are read and written on the I/O threads only."""
        from kvmem.kv.item import item_from_kv
        from kvmem.kv.knowledge import KNOWLEDGE_OWNER

        parent, missing = self._io.submit(self.builder.stored_parent, pending).result()
        if missing:
            ids = tuple(self.layout.knowledge_ids)
            kv = self._engine_kv(ids, None)
            parent = item_from_kv(
                ids, kv, user_id=KNOWLEDGE_OWNER, memory_ids=(), fingerprint=self.handle.fingerprint
            )
            self._io.submit(self.store.put, parent).result()
        # the K/V after the parent's tokens only: the child's own tensor, read on the model thread. Slicing
        # and copying it here (184 MB for a 4k-token block) ran a parallel torch copy on this thread: a
        # second OpenMP team in the process, which slowed every step of the model thread's team after it
        own_from = 0 if parent is None or parent.num_tokens >= len(pending.ids) else parent.num_tokens
        kv = self._engine_kv(pending.ids, pending.prefix or parent, own_from)
        return self.builder.item_from_kv(pending, kv, parent)

    def cancel_builds(self) -> int:
        """Cancel the builds in flight: each ends at its next step boundary (its pages go back) and its
        `build_block` raises BuildCancelled; nothing of it is stored. Builds started later run. Returns how
        many were cancelled (shutdown: a restart rebuilds what it needs)."""
        with self._build_cancels_lock:
            cancels = list(self._build_cancels)
        for cancel in cancels:
            cancel.set()
        return len(cancels)

    def _engine_kv(self, ids, prefix, own_from: int = 0, adapter: str | None = None) -> object:
        """The K/V of `ids[own_from:]` ([layers, 2, kv_heads, n - own_from, head_dim]) from a prefill in the
        engine's steps over the pages of `prefix` (an item whose tokens start ids, or None), under the held
        peft adapter `adapter` (None: the base model). Blocks the calling thread; raises BuildCancelled after
        `cancel_builds`."""
        future: Future = Future()
        cancel = threading.Event()
        with self._build_cancels_lock:
            self._build_cancels.add(cancel)
        try:
            self._loop.start(self._prefill_steps(list(ids), prefix, own_from, future, adapter, cancel))
            return future.result()
        finally:
            with self._build_cancels_lock:
                self._build_cancels.discard(cancel)

    def _prefill_steps(
        self, ids, prefix, own_from: int, future: Future, adapter: str | None, cancel: threading.Event
    ):
        """On the model thread: a sequence that prefills `ids` (one token sampled and dropped), then its K/V;
        BuildCancelled once `cancel` is set (checked at each step boundary)."""
        from kvmem.kv import Sampling
        from serving.engine.sequence import AdmissionWait, admit

        seq = None
        try:
            for got in admit(
                self.pool,
                self.handle.model,
                ids,
                item=prefix,
                max_new_tokens=1,
                wait_s=self.config.kv_wait_s,
                yield_to_chat=True,  # a build that waits for pages never holds a chat request back (waiting.py)
                sampling=Sampling(max_new_tokens=1),
                prefill_chunk_tokens=self.config.build_chunk_tokens,
                idle_chunk_tokens=self.config.prefill_chunk_tokens,
                busy_attention_budget=self.config.build_attention_budget,
                adapter=adapter,
                should_stop=cancel.is_set,
            ):
                if isinstance(got, AdmissionWait):  # no room yet: parked until the pool's room changes
                    yield got
                else:
                    seq = got
            if seq is None:  # admission gave up: cancelled while it waited for pages
                raise BuildCancelled("the build was cancelled before it was admitted")
            yield seq  # the batcher sends its token once every id's K/V is in its pages
            if seq.finish_reason == "cancelled":
                raise BuildCancelled("the build was cancelled between two of its steps")
            self._loop.start(self._read_steps(seq, own_from, len(ids), future))  # the pages are its now
            seq = None
        except GeneratorExit:
            if not future.done():
                future.set_exception(LoopClosed("the model loop closed during a build"))
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the building thread
            if not future.done():
                future.set_exception(exc)
        finally:
            if seq is not None:
                seq.release()

    def _read_steps(self, seq, first: int, n: int, future: Future):
        """On the model thread: a finished build's K/V of tokens [first, n) read from its pages READ_PIECE
        tokens a turn, so the streams' steps go on between the pieces (a 4k-token block of the 135M model is
        ~184 MB: read at once, it made the longest gap of a stream during a build); then its pages go back."""
        import torch

        try:
            kv = None
            for start in range(first, n, READ_PIECE):
                piece = seq.table.read(min(n, start + READ_PIECE), start)
                if kv is None:
                    kv = torch.empty(
                        (*piece.shape[:3], n - first, piece.shape[4]), dtype=piece.dtype, device=piece.device
                    )
                kv[:, :, :, start - first : start - first + piece.shape[3]] = piece
                yield
            future.set_result(kv)
        except GeneratorExit:
            if not future.done():
                future.set_exception(LoopClosed("the model loop closed during a build"))
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the building thread
            future.set_exception(exc)
        finally:
            seq.release()

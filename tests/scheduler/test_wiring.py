"""scheduler/wiring.py: the scheduler's BlockMaker over a serving backend calls the Backend interface only
(issue 27 item 19): a backend without blocks of its own (the fake) gets the interface's defaults, a backend
whose blocks are files under the data dir is restorable. No weights are loaded here."""

from __future__ import annotations

import inspect

import scheduler.wiring
from scheduler.wiring import BackendBlockMaker
from serving.backends.fake import FakeBackend
from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig


def test_a_backend_without_stored_blocks_gets_the_interfaces_defaults():
    backend = FakeBackend()
    builder = BackendBlockMaker(backend)
    assert builder.layout_generation() == 0  # no knowledge to switch: the layout never changes
    assert builder.warm_block("kv-0") is None
    assert builder.forget_adapters("alice", ["alice-v1"]) == []
    assert (builder.serves_adapters, builder.builds_under_adapter) == (True, False)
    assert backend.fingerprint_digest() is None
    assert backend.find_block("alice", ["t"], ["m"]) is None and backend.stored_memory_ids("alice") == []
    assert not builder.finds_stored_blocks  # nothing to restore at start: the app does not wait for it


def test_a_backend_with_stored_blocks_is_restorable(tmp_path):
    backend = TransformersBackend(TransformersBackendConfig(model="unloaded", data_dir=str(tmp_path)))
    builder = BackendBlockMaker(backend)
    assert builder.finds_stored_blocks
    assert builder.stored_memory_ids("alice") == []  # not loaded: no store, no blocks
    assert builder.layout_generation() == 0  # not loaded: nothing switched
    assert (builder.serves_adapters, builder.builds_under_adapter) == (False, True)
    assert backend.fingerprint_digest() is None  # no model loaded


def test_the_wiring_finds_no_backend_method_by_name():
    assert "getattr(" not in inspect.getsource(scheduler.wiring)


def test_the_scheduler_calls_the_builders_methods_not_getattr():
    """The builder's interface is declared once (scheduler/block_maker.py): a builder without stored blocks
    says so with `finds_stored_blocks`, not by lacking `find_block` (issue 27 item 19)."""
    import scheduler.guard
    import scheduler.service
    import scheduler.worker

    for module in (scheduler.guard, scheduler.service, scheduler.worker):
        source = inspect.getsource(module)
        assert "getattr(builder" not in source and "getattr(self.builder" not in source, module.__name__

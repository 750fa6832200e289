"""LoRA adapters in the transformers backend: peft multi-adapter on the served model, loaded from the registry
on first use and evicted least recently used, switched per request step on the model thread.

The model is wrapped by peft in place the first time an adapter is loaded; from then on every forward runs
with the adapter layers disabled (exactly the base model: peft's LoRA layer then calls only its base layer)
unless a step of a request with an adapter is running, and it is disabled again after that step, so block
builds and other requests between steps see the base model. Only the model thread touches the model.
Knows nothing of plans: a request names its adapter id; the registry's manifest says whose it is.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from kvmem.adapters import AdapterError, AdapterManifest, AdapterRegistry

log = logging.getLogger(__name__)

T = TypeVar("T")
_LORA_KEYS = ("r", "lora_alpha", "target_modules", "lora_dropout", "bias", "fan_in_fan_out", "use_rslora")


def user_adapter(
    registry: AdapterRegistry, user_id: str, adapter_id: str
) -> tuple[AdapterManifest | None, str | None]:
    """(the user's adapter version `adapter_id`, None) or (None, why not): isolation, an adapter id of another
    user's is refused. A JSON read; any thread; no peft needed."""
    try:
        user_dir, version = adapter_id.rsplit("/v", 1)
        manifest = registry.manifest(user_id, int(version))
    except (ValueError, AdapterError) as exc:
        return None, f"adapter {adapter_id} unusable: {exc}"
    if registry.user_dir(user_id).name != user_dir or manifest.user_id != user_id:
        return None, f"adapter {adapter_id} is not user {user_id!r}'s"
    return manifest, None


def _peft_name(served: str) -> str:
    """A served name as peft's adapter name (peft names become module attributes)."""
    return served.replace("/", "_").replace(".", "_")


class AdapterSlots:
    def __init__(self, registry: AdapterRegistry, handle: Any, max_loaded: int = 8) -> None:
        self.registry, self.handle, self.max_loaded = registry, handle, max_loaded
        self._loaded: OrderedDict[str, None] = OrderedDict()  # served names, least recently used first
        self._in_use: dict[str, int] = {}  # name -> requests running it (never evicted while > 0)
        self._peft: Any = None  # the peft wrapper around handle.model, once an adapter was loaded
        self._lock = threading.Lock()
        self.served: dict[str, str] = {}  # peft name -> the served name (what KV items built under it carry)
        self._doomed: set[str] = set()  # peft names of erased versions whose weights are still in the model
        # weights read and verified off the model thread (`prefetch`), waiting for `resolve` to attach them:
        # peft name -> (served name, LoadedAdapter), oldest first, at most max_loaded
        self._read: OrderedDict[str, tuple[str, Any]] = OrderedDict()
        self._forgets = 0  # delete cascades seen (`forget`): `resolve` checks none erased what it attaches

    def manifest(self, user_id: str, adapter_id: str) -> tuple[AdapterManifest | None, str | None]:
        """(the user's adapter version `adapter_id`, None) or (None, why not). A JSON read; any thread."""
        return user_adapter(self.registry, user_id, adapter_id)

    def prefetch(self, user_id: str, adapter_id: str) -> None:
        """Any thread but the model's (the I/O threads): read and verify the version's weights (a file read and
        a SHA-256 of it) ahead of `resolve`, which then only attaches them. Nothing more is read for a version
        already loaded or read; an unusable one is left to `resolve`, which reads again and says why."""
        manifest, _ = self.manifest(user_id, adapter_id)
        if manifest is None:
            return
        name = _peft_name(manifest.name)
        with self._lock:
            if name in self._loaded or name in self._read:
                return
        try:
            loaded = self.registry.load(manifest, self.handle.fingerprint.digest)
        except AdapterError:
            return
        with self._lock:
            self._read[name] = (manifest.name, loaded)
            while len(self._read) > self.max_loaded:
                self._read.popitem(last=False)

    def resolve(self, user_id: str, adapter_id: str) -> tuple[str | None, str | None]:
        """(the peft adapter name to run, None) or (None, why not). Model thread only: attaches the weights
        `prefetch` read, else reads them here. The manifest is read here in any case (a small JSON file), so
        a version erased since it was prefetched is refused."""
        self.purge()
        with self._lock:
            forgets = self._forgets
        manifest, why = self.manifest(user_id, adapter_id)
        if manifest is None:
            return None, why
        name = _peft_name(manifest.name)
        self.served[name] = manifest.name
        with self._lock:
            read = self._read.pop(name, None)
            if name in self._loaded:
                self._loaded.move_to_end(name)
                return name, None
        if read is not None:
            loaded = read[1]
        else:
            try:
                loaded = self.registry.load(manifest, self.handle.fingerprint.digest)
            except AdapterError as exc:
                return None, str(exc)

        def erased() -> bool:  # under the lock: a delete cascade since the manifest was read erased it
            return self._forgets != forgets and self.manifest(user_id, adapter_id)[0] is None

        try:
            attached = self._attach(name, loaded, erased)
        except AdapterError as exc:  # it does not fit this model, or the engine cannot run it
            return None, str(exc)
        if not attached:
            self.purge()
            return None, f"adapter {manifest.name} was erased while it was being attached"
        return name, None

    def _attach(self, name: str, loaded: Any, erased: Callable[[], bool]) -> bool:
        """Add the version's weights to the model and make it loaded, unless `erased()` says a delete cascade
        erased it meanwhile (its `forget` found it not loaded yet): then it is doomed at once, never loaded
        (False)."""
        import peft

        from serving.engine import lora

        config = peft.LoraConfig(**{k: loaded.config[k] for k in _LORA_KEYS if k in loaded.config})
        if self._peft is None:
            self._peft = peft.PeftModel(self.handle.model, config, adapter_name=name)
        else:
            self._peft.add_adapter(name, config)
        result = peft.set_peft_model_state_dict(self._peft, loaded.state, adapter_name=name)
        missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
        if missing or result.unexpected_keys:
            self._peft.delete_adapter(name)
            raise AdapterError(f"adapter {name} does not fit this model ({len(missing)} missing weights)")
        if not lora.supports(self.handle.model, name):  # the engine runs every request, adapters' too
            self._peft.delete_adapter(name)
            raise AdapterError(
                f"adapter {name} adapts layers the engine cannot run an adapter on (only linear and embedding "
                "layers: serving/engine/lora.py)"
            )
        self._peft.base_model.disable_adapter_layers()
        self._peft.eval()
        with self._lock:
            if erased():
                self._doomed.add(name)  # `purge` deletes its weights
                return False
            self._loaded[name] = None
            idle = [n for n in self._loaded if not self._in_use.get(n) and n != name]
            for old in idle[: max(0, len(self._loaded) - self.max_loaded)]:
                del self._loaded[old]
                self.served.pop(old, None)
                self._peft.delete_adapter(old)
                log.info("adapter %s evicted (LRU, %d loaded)", old, self.max_loaded)
        log.info("adapter %s loaded", name)
        return True

    def forget(self, served_names: Iterable[str]) -> bool:
        """The delete cascade erased these versions (served names; any thread): they leave `loaded` now, and
        `purge` (model thread) deletes their weights from the model; a version a running request uses, once it
        ends. (They could not be served again anyway: resolving reads the erased manifest.) True if one of them
        was loaded, i.e. a purge is due."""
        names = set(served_names)
        with self._lock:
            self._forgets += 1
            for n in [n for n, (served, _) in self._read.items() if served in names]:
                del self._read[n]  # read ahead, never attached: dropped
            doomed = [n for n, s in self.served.items() if s in names and n in self._loaded]
            for n in doomed:
                del self._loaded[n]
            self._doomed.update(doomed)
        return bool(doomed)

    def purge(self) -> list[str]:
        """Model thread only: delete from the model the weights of forgotten versions no request runs."""
        with self._lock:
            gone = [n for n in self._doomed if not self._in_use.get(n)]
            for n in gone:
                self._doomed.discard(n)
                self.served.pop(n, None)
        for n in gone:
            self._peft.delete_adapter(n)
            log.info("adapter %s unloaded: its version was erased", n)
        return gone

    def hold(self, name: str) -> None:
        """A request runs `name` (in the engine's steps, serving/engine/lora.py): never evicted nor unloaded
        until `unhold`. Model thread only."""
        with self._lock:
            self._in_use[name] = self._in_use.get(name, 0) + 1

    def unhold(self, name: str) -> None:
        """The request that held `name` ended; an erased version no request runs leaves the model now."""
        with self._lock:
            self._in_use[name] -= 1
        self.purge()

    def run(self, name: str, fn: Callable[[], T]) -> T:
        """`fn()` (a block prefill) with the adapter `name` on, off again after. Model thread only."""
        lora = self._peft.base_model
        with self._lock:
            self._in_use[name] = self._in_use.get(name, 0) + 1
        try:
            lora.enable_adapter_layers()
            lora.set_adapter(name)
            try:
                return fn()
            finally:
                lora.disable_adapter_layers()
        finally:
            with self._lock:
                self._in_use[name] -= 1
            self.purge()

    @property
    def loaded(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._loaded)


def unload_erased(
    slots: AdapterSlots | None, served_names: Iterable[str], call_soon: Callable[[Callable[[], Any]], Any]
) -> None:
    """The delete cascade in a backend: erased versions leave the slots, their weights deleted on the model
    thread (`call_soon` runs a function there without waiting: the cascade never waits for a model step)."""
    from serving.engine.model_loop import LoopClosed

    if slots is not None and slots.forget(served_names):
        try:
            call_soon(slots.purge)
        except LoopClosed:  # closing: the weights go with the model
            pass


def adapter_slots(data_dir: str, handle: Any) -> AdapterSlots | None:
    """The backend's adapter slots, or None when peft is not installed (adapters are then never served)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        log.info("peft is not installed: LoRA adapters will not be served (pip install 'kvmem[lora]')")
        return None
    from kvmem.datadir import DataDir

    return AdapterSlots(AdapterRegistry(DataDir.at(data_dir).adapters_dir), handle)


def under_adapter(
    slots: AdapterSlots | None, builder: Any, user_id: str, adapter_id: str
) -> tuple[str, Callable[[Any], Any]]:
    """(the served name a block built under the user's adapter `adapter_id` carries, a `builder.prefill` that
    runs with the adapter on: loaded first if needed; model thread only). The block's content address covers
    the name (kvmem Fingerprint.adapter), so it is only injected under that adapter version. Raises
    BackendError when the adapter is not the user's or cannot be served."""
    from serving.backends.base import BackendError

    manifest, why = (None, "peft is not installed") if slots is None else slots.manifest(user_id, adapter_id)
    if manifest is None:
        raise BackendError(f"no block under adapter {adapter_id} for user {user_id!r}: {why}")

    def prefill(pending: Any) -> Any:
        name, why = slots.resolve(user_id, adapter_id)
        if name is None or slots.served[name] != pending.adapter:
            raise BackendError(f"adapter {adapter_id} of user {user_id!r} cannot be loaded: {why}")
        return slots.run(name, lambda: builder.prefill(pending))

    return manifest.name, prefill


def item_fits(req: Any, item: Any, served: str) -> tuple[Any, str | None]:
    """The item if its K/V were computed under the adapter the request runs (`served`: its served name, ""
    for the base model), else (None, "fingerprint_mismatch"): a base-model block under an adapter, or the
    reverse, or another adapter version's block, is never injected (the adapter changes the K/V)."""
    built = item.meta.fingerprint.adapter
    if built == served:
        return item, None
    log.warning(
        "request %s runs %s: block item %s was built under %s; not injected",
        req.request_id,
        served or "the base model",
        item.item_id,
        built or "the base model",
    )
    return None, "fingerprint_mismatch"


def with_adapter(slots: AdapterSlots | None, req: Any, item: Any, fallback: str | None):
    """(KV item, fallback kind, peft adapter name or None) for a request. The item is injected only if it was
    built under the adapter the request runs (kvmem Fingerprint.adapter). An adapter that cannot be served is
    logged and the request runs on the base model (serving checked the adapter before it left its facts out
    of the prompt; this is the rare case of files that broke since)."""
    name, why = None, None
    if req.adapter_id is not None:
        name, why = (
            (None, "peft is not installed") if slots is None else slots.resolve(req.user_id, req.adapter_id)
        )
        if name is None:
            log.error("request %s runs without its adapter: %s", req.request_id, why)
    if item is not None:
        item, bad = item_fits(req, item, slots.served[name] if name is not None else "")
        fallback = bad or fallback
    return item, fallback, name

"""The pair encoder (kvmem/formation/pair_encoder.py): its file format and checks, the merged deltas reading as
the trained ones, the shipped file, and consolidation's use of its reading (readings.encoded_retirement)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import kvmem.formation.pair_encoder as pair_encoder_module
from benchmarks.memory.train_pair_encoder import PROBES
from kvmem.formation.consolidate import (
    ExistingMemory,
    consolidate,
)
from kvmem.formation.pair_encoder import (
    TENSORS,
    PairEncoderLoadError,
    PairModel,
    load_pair_encoder,
    pair_text,
    save_pair_encoder,
)
from kvmem.formation.readings import ENCODED_CANDIDATES, ENCODED_SIMILARITY, ChangeReading
from kvmem.formation.types import Decision, Fact
from kvmem.text import MemoryStore
from kvmem.text.search.embedders import minilm_model_dir
from tests.kvmem.formation.test_change_head import formed

ROOT = Path(__file__).resolve().parents[3]
T1, T2 = "2026-03-01T10:00:00.000000Z", "2026-05-01T10:00:00.000000Z"


def _trained(seed: int = 3) -> PairModel:
    """A model with fresh deltas moved off zero (as training leaves them)."""
    model = PairModel(minilm_model_dir(), 4, 8.0, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.trainable:
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def _save(path: Path, tensors: dict, **metadata: str) -> str:
    return save_pair_encoder(path, tensors, {"rank": "4", "alpha": "8.0", "threshold": "0.9", **metadata})


def test_a_saved_encoder_reads_what_the_trained_model_reads(tmp_path: Path) -> None:
    """The deltas merged into the weights at load give the probabilities the unmerged training model gives."""
    model = _trained()
    pairs = [("I moved to Hull last month.", "I live in York."), ("I had pasta.", "I love hiking.")]
    with torch.inference_mode():
        expected = torch.sigmoid(model.logits([m for _, m in pairs], [n for n, _ in pairs])).numpy()
    _save(tmp_path / "e.safetensors", model.tensors())
    encoder = load_pair_encoder(tmp_path / "e.safetensors")
    assert (encoder.rank, encoder.alpha, encoder.threshold) == (4, 8.0, 0.9)
    got = encoder.retire_probability(pairs)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert not np.allclose(got[0], got[1])  # the two pairs read differently
    assert encoder.retire_probability([]).shape == (0,)


def test_closing_punctuation_is_not_read() -> None:
    """The sets end their turns with a stop, real chat mostly does not: the encoder reads neither (pair_text)."""
    assert pair_text("  I moved   to Leeds!! ") == pair_text("I moved to Leeds") == "I moved to Leeds"
    assert pair_text("Did you? I did.") == "Did you? I did"
    encoder = load_pair_encoder()
    stops = encoder.retire_probability(
        [("We moved to Leeds.", "I live in York."), ("I quit...", "I'm a nurse!")]
    )
    bare = encoder.retire_probability([("We moved to Leeds", "I live in York"), ("I quit", "I'm a nurse")])
    np.testing.assert_array_equal(stops, bare)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t, m: m.update(threshold="1.5"), "threshold in (0, 1)"),
        (lambda t, m: m.update(rank="x"), "must be numbers"),
        (lambda t, m: m.update(rank="3"), "must be of shape (3, 384)"),
        (lambda t, m: t.update({"head.bias": np.zeros(2, np.float32)}), "head.bias must be of shape (1,)"),
        (lambda t, m: t.__setitem__("head.weight", np.full((1, 384), np.nan, np.float32)), "not finite"),
    ],
)
def test_bad_encoders_are_refused_with_the_reason(tmp_path: Path, edit, message: str) -> None:
    from kvmem import small_heads

    tensors = {name: np.zeros(shape, np.float32) for name, shape in _shapes(4).items()}
    metadata = {"rank": "4", "alpha": "8.0", "threshold": "0.9", "format": "kvmem-pair-encoder/1"}
    metadata["base"] = "all-MiniLM-L6-v2"
    edit(tensors, metadata)
    tmp = small_heads.write_head(tmp_path / "e.safetensors", tensors, metadata, TENSORS)
    with pytest.raises(PairEncoderLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_pair_encoder(tmp)


def _shapes(rank: int) -> dict[str, tuple[int, ...]]:
    out = {}
    for name in TENSORS:
        kind = name.rsplit(".", 1)[-1]
        out[name] = {"lora_a": (rank, 384), "lora_b": (384, rank), "weight": (1, 384), "bias": (1,)}[kind]
    return out


def test_missing_other_base_and_substituted_encoders_are_refused(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(PairEncoderLoadError, match="no such file"):
        load_pair_encoder(tmp_path / "none.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(PairEncoderLoadError, match="not a safetensors file"):
        load_pair_encoder(tmp_path / "bad.safetensors")
    from kvmem import small_heads

    tensors = {name: np.zeros(shape, np.float32) for name, shape in _shapes(4).items()}
    metadata = {
        "rank": "4",
        "alpha": "8",
        "threshold": "0.9",
        "format": "kvmem-pair-encoder/1",
        "base": "bert",
    }
    tmp = small_heads.write_head(tmp_path / "b.safetensors", tensors, metadata, TENSORS)
    with pytest.raises(PairEncoderLoadError, match="base must be 'all-MiniLM-L6-v2'"):
        load_pair_encoder(tmp)
    _save(tmp_path / "other.safetensors", tensors)  # a valid file, but not the shipped one
    monkeypatch.setattr(pair_encoder_module, "DEFAULT_ENCODER", tmp_path / "other.safetensors")
    with pytest.raises(PairEncoderLoadError, match="is not the shipped pair encoder's"):
        load_pair_encoder()


def test_the_shipped_encoder_is_the_pinned_one_and_reads_its_training_probes() -> None:
    """The shipped file loads (content sha256 pinned) and reads the three probes as its training run recorded
    (benchmarks/results/cpu/pair_encoder_train.json, written by the command in train_pair_encoder's docstring)."""
    encoder = load_pair_encoder()
    result = json.loads((ROOT / "benchmarks/results/cpu/pair_encoder_train.json").read_text())
    assert result["content_sha256"].startswith(encoder.fingerprint)
    assert [(p["new"], p["memory"]) for p in result["probes"]] == list(PROBES)
    got = encoder.retire_probability(list(PROBES))
    np.testing.assert_allclose(got, [p["probability"] for p in result["probes"]], atol=1e-4)


def test_the_training_command_in_its_docstring_trains_the_shipped_sets() -> None:
    import benchmarks.memory.train_pair_encoder as train_module

    result = json.loads((ROOT / "benchmarks/results/cpu/pair_encoder_train.json").read_text())
    sets = " ".join(result["sets"])
    assert f"--sets {sets} " in " ".join(train_module.__doc__.replace("\\\n", " ").split())


# ---- the policy over the reading (consolidate.py) -----------------------------------------------------------


def _memory(i: int, text: str, said: str = T1) -> ExistingMemory:
    return ExistingMemory(f"m{i}", text, None, None, said, said)


def _reading(probabilities: dict[str, float], closeness: dict[str, float], calls: list | None = None):
    def encoded(fact: str, memories: list[str]) -> list[float]:
        if calls is not None:
            calls.append(list(memories))
        return [probabilities.get(m, 0.0) for m in memories]

    def similarity(a: str, b: str) -> float:
        return closeness.get(b, closeness.get(a, 0.0))

    return ChangeReading({}, {}, similarity, None, 1.0, encoded, 0.9)


def test_the_encoder_retires_the_most_probable_close_memory_at_its_threshold() -> None:
    quit = Fact("Handed back my radio and my hi-vis on Friday.", ("t9",), T2)
    warden, hiking, gym = (
        _memory(1, "I am a traffic warden."),
        _memory(2, "I love hiking."),
        _memory(3, "Gym daily."),
    )
    closeness = {warden.text: 0.3, hiking.text: 0.25, gym.text: 0.5}  # the closest is not the most probable
    reading = _reading({warden.text: 0.95, gym.text: 0.92}, closeness)
    assert consolidate(quit, [hiking, gym, warden], changes=reading) == Decision("supersede", ("m1",))
    # a memory below ENCODED_SIMILARITY is never read, however probable
    far = _reading({warden.text: 0.99}, {warden.text: ENCODED_SIMILARITY - 0.01})
    assert consolidate(quit, [warden], changes=far) == Decision("add")
    below = _reading({warden.text: 0.89}, closeness)
    assert consolidate(quit, [hiking, warden], changes=below) == Decision("add")
    # a memory said after the fact is never retired by it
    later = _memory(4, warden.text, "2026-06-01T10:00:00.000000Z")
    assert consolidate(quit, [later], changes=reading, said_at=T2) == Decision("add")


def test_the_encoder_reads_only_the_closest_candidates() -> None:
    fact = Fact("Not doing that any more.", ("t9",), T2)
    memories = [_memory(i, f"memory {i}") for i in range(ENCODED_CANDIDATES + 3)]
    closeness = {m.text: 0.3 + 0.05 * i for i, m in enumerate(memories)}  # the last ones are the closest
    calls: list = []
    far = memories[0].text  # the farthest: not read although the encoder would retire it
    reading = _reading({far: 0.99}, closeness, calls)
    assert consolidate(fact, memories, changes=reading) == Decision("add")
    assert calls == [[m.text for m in reversed(memories[-ENCODED_CANDIDATES:])]]


def test_a_fact_the_guard_blocks_is_never_read_by_the_encoder() -> None:
    from scheduler.formation_decisions import _encoded

    class Counting:
        threshold = 0.9
        pairs: list = []

        def retire_probability(self, pairs):
            self.pairs.extend(pairs)
            return np.full(len(pairs), 0.99, np.float32)

    encoder = Counting()
    sister, mine, never = "My sister moved to Berlin.", "Handed back my radio.", "I never sold my piano."
    read = _encoded(encoder, {sister: "another person", mine: None, never: "negated"})
    assert read(sister, ["I live in Lisbon."]) == [0.0]
    assert read(never, ["I play the piano."]) == [0.0]
    assert read(mine, ["I am a warden.", "I am a warden."]) == pytest.approx([0.99, 0.99])
    assert read(mine, ["I am a warden."]) == pytest.approx([0.99])  # read once a pair
    assert encoder.pairs == [(mine, "I am a warden.")]


def _corrupt_base(tmp_path: Path) -> Path:
    """A copy of the base model whose weights file is cut short."""
    src, dst = minilm_model_dir(), tmp_path / "minilm"
    dst.mkdir()
    for p in src.iterdir():
        if p.name != "model.safetensors":
            (dst / p.name).symlink_to(p)
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:1000])
    return dst


@pytest.mark.parametrize("broken", ["empty", "corrupt"])
def test_a_base_model_that_cannot_be_loaded_leaves_formation_to_the_other_readings(
    tmp_path: Path, monkeypatch, caplog, broken: str
) -> None:
    """The shipped file is fine but its base model is missing or corrupt: the worker's loader logs it once and
    returns None, a formation pass goes on with the other readings, and an encoder loaded by hand says why."""
    import scheduler.formation_decisions as decisions

    base = tmp_path / "no-minilm" if broken == "empty" else _corrupt_base(tmp_path)
    base.mkdir(exist_ok=True)
    monkeypatch.setenv("KVMEM_MINILM_DIR", str(base))
    decisions._load_shipped_encoder.cache_clear()
    try:
        assert decisions.shipped_pair_encoder() is None
        assert decisions.shipped_pair_encoder() is None
        logged = [r for r in caplog.records if "pair encoder cannot be loaded" in r.getMessage()]
        assert len(logged) == 1
        if broken == "corrupt":  # the default embedder's tokenizer is in that directory too: it must be there
            with MemoryStore(tmp_path / "m.sqlite") as store:
                _retired(store, ["I work as a nurse.", "I also love hiking."])
                assert sorted(m.text for m in store.list("u").items) == [
                    "I also love hiking.",
                    "I work as a nurse.",
                ]
    finally:
        decisions._load_shipped_encoder.cache_clear()
    with pytest.raises(PairEncoderLoadError, match="base model cannot be loaded"):
        load_pair_encoder(base_dir=base).retire_probability([("a", "b")])


def test_a_pass_without_the_change_head_never_loads_the_encoder(tmp_path: Path, monkeypatch) -> None:
    import scheduler.formation_decisions as decisions

    calls: list = []
    monkeypatch.setattr(decisions, "shipped_pair_encoder", lambda: calls.append(1))
    with MemoryStore(tmp_path / "m.sqlite") as store:
        decisions.decide(store, "u", [Fact("I work as a nurse", ("t1",), "")], {}, 5, change_head=None)
    assert calls == []


def test_concurrent_first_passes_load_the_shipped_encoder_once(monkeypatch) -> None:
    import threading
    import time

    import scheduler.formation_decisions as decisions

    built: list = []

    class Slow:
        def load(self):
            built.append(self)
            time.sleep(0.3)
            return self

    monkeypatch.setattr(decisions, "load_pair_encoder", lambda: Slow())
    decisions._load_shipped_encoder.cache_clear()
    try:
        got: list = []
        threads = [
            threading.Thread(target=lambda: got.append(decisions.shipped_pair_encoder())) for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(built) == 1 and got[0] is got[1]
    finally:
        decisions._load_shipped_encoder.cache_clear()


def _retired(store: MemoryStore, turns: list[str]) -> list[str]:
    """The turns said as one user's, each formed by the worker (rules, the shipped head and encoder) in turn:
    the memories retired."""
    return formed(store, turns)[1]


@pytest.mark.parametrize(
    "turns",
    [
        ["I play the piano.", "I never sold my piano."],  # negated: the guard blocks it (a review's finding)
        ["I play guitar in a band.", "I sold my car."],  # a review's finding: read 0.63, under the threshold
        ["I play guitar in a band.", "I sold my bike."],
        ["I work as a nurse.", "I moved to a flat in Leeds."],  # a change of something else
    ],
)
def test_the_worker_retires_nothing_for_a_negation_or_a_change_of_something_else(
    tmp_path: Path, turns
) -> None:
    with MemoryStore(tmp_path / "m.sqlite") as store:
        assert _retired(store, turns) == []


def test_a_taste_is_retired_by_the_encoder_only_for_a_fact_telling_a_taste_or_a_change() -> None:
    """As for the pair layer: the encoder read "I had mushrooms at dinner" as retiring "I can't stand mushrooms"."""
    hate = _memory(1, "I can't stand mushrooms.")
    probable = {hate.text: 0.95}

    def reading(areas: dict) -> ChangeReading:
        base = _reading(probable, {hate.text: 0.6})
        return ChangeReading({}, areas, base.similarity, None, 1.0, base.encoded, 0.9)

    mention = Fact("I had mushrooms at dinner.", ("t9",), T2)
    told = Fact("Mushrooms are my favourite thing now.", ("t9",), T2)
    assert consolidate(mention, [hate], changes=reading({hate.text: "pref"})) == Decision("add")
    assert consolidate(told, [hate], changes=reading({hate.text: "pref"})) == Decision("supersede", ("m1",))
    assert consolidate(mention, [hate], changes=reading({})) == Decision("supersede", ("m1",))  # no area read
    # or telling a change of one: a word of change the guard lets through ("Uninstalled WoW and cancelled the sub")
    stopped = Fact("I stopped picking mushrooms out.", ("t9",), T2)
    planned = Fact("I might stop picking mushrooms out.", ("t9",), T2)
    assert consolidate(stopped, [hate], changes=reading({hate.text: "pref"})) == Decision(
        "supersede", ("m1",)
    )
    assert consolidate(planned, [hate], changes=reading({hate.text: "pref"})) == Decision("add")

"""The learned change head: its file checks, the shipped file (pinned, and what its training writes again), the
policy consolidation applies with its reading, and the worker's decisions that read it over the default
embedder (and never over another embedder's vectors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvmem.formation.change_head as change_head_module
from benchmarks.memory.formation_public import DEFAULT_DATA_DIR
from benchmarks.memory.train_change_head import train
from kvmem.formation.base import make_extractor
from kvmem.formation.change_head import (
    AREAS,
    DEFAULT_HEAD_SHA256,
    ChangeHeadLoadError,
    load_change_head,
    save_change_head,
)
from kvmem.formation.consolidate import (
    ExistingMemory,
    consolidate,
    consolidate_batch,
)
from kvmem.formation.readings import PREF_SIMILARITY, TOLD_SIMILARITY, ChangeReading
from kvmem.formation.types import Decision, Fact
from kvmem.text import MemoryStore, default_embedder
from scheduler.formation import FormationWorker
from scheduler.formation_decisions import change_reading

T1 = "2026-03-01T10:00:00.000000Z"
T2 = "2026-11-26T14:41:09.000000Z"
META = {
    "embedder": "e",
    "areas": ",".join(AREAS),
    "threshold": "0.35",
    "area_threshold": "0.9",
    "pair_threshold": "0.5",
}


def _tensors(dim: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "change.weight": rng.normal(size=(2, dim)).astype(np.float32),
        "change.bias": np.zeros(2, np.float32),
        "area.weight": rng.normal(size=(len(AREAS), dim)).astype(np.float32),
        "area.bias": np.zeros(len(AREAS), np.float32),
        "pair.weight": np.zeros((2, 3 * dim), np.float32),
        "pair.bias": np.zeros(2, np.float32),
    }


def test_a_saved_head_reads_probabilities_and_confident_areas(tmp_path: Path) -> None:
    tensors = _tensors()
    tensors["area.weight"][:] = 0.0
    tensors["area.weight"][1, 0] = 10.0  # feature 0 says "job", strongly
    tensors["change.weight"][:] = 0.0
    tensors["change.weight"][1, 1] = 2.0  # feature 1 says "a change"
    save_change_head(tmp_path / "h.safetensors", tensors, META)
    head = load_change_head(tmp_path / "h.safetensors")
    v = np.zeros((3, 8), np.float32)
    v[0, 0] = 1.0  # job, p(job) = e^10 / (e^10 + 3): above 0.9
    v[1, 0] = 0.1  # job only weakly (e^1 / (e^1 + 3) = 0.48): no area
    v[2, 1] = 1.0  # a change: sigmoid(2)
    assert head.area(v) == ["job", None, None]
    assert head.change_probability(v) == pytest.approx([0.5, 0.5, 1 / (1 + np.exp(-2.0))], abs=1e-6)
    assert (head.embedder, head.threshold, head.area_threshold, head.areas) == ("e", 0.35, 0.9, AREAS)
    assert head.pair_threshold == 0.5


def test_the_pair_layer_reads_both_vectors_and_their_product(tmp_path: Path) -> None:
    tensors = _tensors()
    tensors["pair.weight"][1, 8 + 2] = 1.0  # the memory's feature 2
    tensors["pair.weight"][1, 16 + 3] = 3.0  # the product's feature 3
    save_change_head(tmp_path / "h.safetensors", tensors, META)
    head = load_change_head(tmp_path / "h.safetensors")
    new, memory = np.zeros((2, 8), np.float32), np.zeros((2, 8), np.float32)
    memory[0, 2] = 1.0  # logit 1
    new[1, 3], memory[1, 3] = 1.0, 0.5  # product 0.5: logit 1.5
    expected = [1 / (1 + np.exp(-1.0)), 1 / (1 + np.exp(-1.5))]
    assert head.retire_probability(new, memory) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t, m: m.update(threshold="1.5"), "threshold must be a probability in (0, 1), got '1.5'"),
        (lambda t, m: m.pop("area_threshold"), "area_threshold must be a probability in (0, 1), got None"),
        (
            lambda t, m: m.update(pair_threshold="0"),
            "pair_threshold must be a probability in (0, 1), got '0'",
        ),
        (
            lambda t, m: t.update({"pair.weight": np.zeros((2, 8), np.float32)}),
            "pair.weight must be of shape (2, 24), got (2, 8)",
        ),
        (lambda t, m: m.pop("embedder"), "metadata must name its areas and its embedder"),
        (lambda t, m: m.update(areas="home,job"), "area.weight must be of shape (2, 8), got (4, 8)"),
        (
            lambda t, m: t.update({"change.bias": np.zeros(3, np.float32)}),
            "change.bias must be of shape (2,)",
        ),
        (lambda t, m: t.pop("area.bias"), "tensors must be exactly"),
        (
            lambda t, m: t["area.weight"].__setitem__((0, 0), np.nan),
            "area.weight holds a value that is not finite",
        ),
    ],
)
def test_bad_heads_are_refused_with_the_reason(tmp_path: Path, edit, message: str) -> None:
    from safetensors.numpy import save_file

    tensors, metadata = _tensors(), {**META, "format": "kvmem-change-head/2"}
    edit(tensors, metadata)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ChangeHeadLoadError, match=str(path).replace(".", r"\.")) as info:
        load_change_head(path)
    assert message in str(info.value)


def test_missing_corrupt_and_substituted_heads_are_refused(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ChangeHeadLoadError, match="change head cannot be read"):
        load_change_head(tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ChangeHeadLoadError, match="not a safetensors file"):
        load_change_head(tmp_path / "junk.safetensors")
    other = tmp_path / "other.safetensors"
    save_change_head(other, _tensors(384), {**META, "embedder": "all-MiniLM-L6-v2-onnx-int8"})
    monkeypatch.setattr(change_head_module, "DEFAULT_HEAD", other)  # another file under the shipped name
    with pytest.raises(ChangeHeadLoadError, match=f"is not the shipped head's {DEFAULT_HEAD_SHA256}"):
        load_change_head()


def test_the_shipped_head_is_the_pinned_one_and_its_training_writes_it_again() -> None:
    """The shipped file loads (its content sha256 is the pinned one) and reads the default embedder's vectors;
    train() on the nine scored sealed sets and REALTALK's tune split (benchmarks/memory/train_change_head.py)
    gives the same weights. REALTALK is not in the repository (no licence): where it is not provisioned only the
    area layer, which its turns do not train, is checked, and the test says so."""
    head = load_change_head()
    assert head.embedder == default_embedder().name
    assert (head.threshold, head.area_threshold, head.pair_threshold, head.areas) == (0.35, 0.9, 0.5, AREAS)
    chats = DEFAULT_DATA_DIR if list(DEFAULT_DATA_DIR.glob("Chat_1_*.json")) else None
    sets = ["heldout", *(f"heldout_v{i}" for i in range(2, 10))]
    tensors, info = train(sets, chats=chats)
    assert info["embedder"] == head.embedder
    got = (info["num_texts"], info["num_chat_negatives"], info["num_pairs"], info["num_retiring_pairs"])
    assert got == ((8987, 4801, 19657, 954) if chats else (4186, 0, 2251, 954))
    layers = [("area.weight", head.area_weight), ("area.bias", head.area_bias)]
    if chats is not None:
        layers += [
            ("change.weight", head.change_weight),
            ("change.bias", head.change_bias),
            ("pair.weight", head.pair_weight),
            ("pair.bias", head.pair_bias),
        ]
    for name, shipped in layers:
        # the layers REALTALK's turns train reproduced within 2.7e-3 on one machine (14 of the pair layer's
        # 2,304 weights past 2e-3, 2026-12-02, at 15b513b too; the cause not traced), so those are held to 5e-3
        atol = 2e-3 if name.startswith("area.") else 5e-3
        np.testing.assert_allclose(tensors[name], shipped, atol=atol, err_msg=name)
    if chats is None:
        pytest.skip(f"REALTALK not in {DEFAULT_DATA_DIR}: the area layer was checked, the others were not")


# ---- the policy over a reading (consolidate.py) -------------------------------------------------------------


def fact(text: str, turn: str = "t9") -> Fact:
    return Fact(text, (turn,), T2)


YORK = ExistingMemory("m1", "I live in York", None, None, T1, T1)
NURSE = ExistingMemory("m2", "I work as a nurse at St Mary's", None, None, T1, T1)
COFFEE = ExistingMemory("m3", "I drink coffee every morning", None, None, T1, T1)
ROOM = ExistingMemory(
    "m4", "We rent a room in Leeds", None, None, "2026-04-01T10:00:00.000000Z", "2026-04-01T10:00:00.000000Z"
)
AREAS_OF = {YORK.text: "home", NURSE.text: "job", COFFEE.text: "pref", ROOM.text: "home"}


def test_a_change_read_by_the_head_retires_the_latest_memory_of_its_area() -> None:
    moved = fact("So we left, living in Hull now")
    reading = ChangeReading({moved.text: "home"}, {**AREAS_OF, moved.text: "home"})
    assert consolidate(moved, [YORK, NURSE, COFFEE], changes=reading) == Decision("supersede", ("m1",))
    assert consolidate(moved, [YORK, ROOM, NURSE], changes=reading) == Decision("supersede", ("m4",))
    assert consolidate(moved, [YORK], changes=None) == Decision("add")  # no reading: the rules alone
    older = Fact(moved.text, ("t9",), "2026-01-01T00:00:00.000000Z")
    assert consolidate(older, [YORK], changes=reading, said_at="2026-01-01T00:00:00.000000Z") == Decision(
        "add"
    )


def test_the_head_never_retires_a_restatement_another_area_or_its_own_turn() -> None:
    still = fact("I live in York")  # the rules read the same slot and value: a duplicate, not a change
    assert consolidate(still, [YORK], changes=ChangeReading({still.text: "home"}, AREAS_OF)) == Decision(
        "duplicate", ("m1",)
    )
    job = fact("I started as a paramedic")
    reading = ChangeReading({job.text: "job"}, {**AREAS_OF, job.text: "job"})
    assert consolidate(job, [YORK, COFFEE], changes=reading) == Decision("add")  # nothing of its area
    packed, moved = fact("We've packed up", "t9"), fact("Moved down to Hobart", "t9")
    reading = ChangeReading(
        {packed.text: "home", moved.text: "home"}, {**AREAS_OF, packed.text: "home", moved.text: "home"}
    )
    got = consolidate_batch([packed, moved], [YORK], changes=reading, said_at=[T2, T2])
    # the first retires York; the second finds only its own turn's fact in its area: added beside it
    assert [d.kind for d in got.decisions] == ["supersede", "add"]
    assert got.current == ("batch:0", "batch:1")


def test_a_pref_change_retires_only_a_close_taste() -> None:
    hiking = ExistingMemory("m5", "I love hiking", None, None, T1, T1)
    close = {("I gave up coffee completely", COFFEE.text): PREF_SIMILARITY}
    similarity = lambda a, b: close.get((a, b), PREF_SIMILARITY - 0.01)  # noqa: E731
    quit_coffee = fact("I gave up coffee completely")
    areas = {**AREAS_OF, hiking.text: "pref", quit_coffee.text: "pref"}
    reading = ChangeReading({quit_coffee.text: "pref"}, areas, similarity)
    # hiking is the later memory of the area, but not close: coffee is retired
    assert consolidate(quit_coffee, [COFFEE, hiking], changes=reading) == Decision("supersede", ("m3",))
    tea = fact("I switched to tea")
    reading = ChangeReading({tea.text: "pref"}, {**areas, tea.text: "pref"}, similarity)
    assert consolidate(tea, [COFFEE, hiking], changes=reading) == Decision("add")
    # without a similarity no taste is retired
    reading = ChangeReading({quit_coffee.text: "pref"}, areas)
    assert consolidate(quit_coffee, [COFFEE], changes=reading) == Decision("add")


def test_a_taste_is_retired_by_the_pair_reading_only_where_close_current_and_likely() -> None:
    mushrooms = ExistingMemory("m5", "I can't stand mushrooms", None, None, T1, T1)
    hiking = ExistingMemory("m6", "I love hiking", None, None, T1, T1)
    later = ExistingMemory("m7", "I hate olives", None, None, T2, T2)
    now = fact("Mushrooms are my favourite now")
    olives = fact("I eat olives every day", "t8")
    areas = {**AREAS_OF, mushrooms.text: "pref", hiking.text: "pref", later.text: "pref"}
    likely = {(now.text, mushrooms.text): 0.6, (now.text, hiking.text): 0.9, (now.text, YORK.text): 0.9}
    likely[(olives.text, later.text)] = 0.9
    close = {(now.text, mushrooms.text), (now.text, YORK.text), (olives.text, later.text)}

    def reading(retire_at: float = 0.5) -> ChangeReading:
        similarity = lambda a, b: PREF_SIMILARITY if (a, b) in close else 0.0  # noqa: E731
        return ChangeReading({}, areas, similarity, lambda a, b: likely.get((a, b), 0.0), retire_at)

    # hiking is more likely but not close; York is close and likely but no taste
    assert consolidate(now, [mushrooms, hiking, YORK], changes=reading()) == Decision("supersede", ("m5",))
    assert consolidate(now, [mushrooms], changes=reading(retire_at=0.7)) == Decision("add")
    # a memory said after the fact is not retired by it
    assert consolidate(olives, [later], changes=reading(), said_at=T1) == Decision("add")
    # no pair reading: nothing
    assert consolidate(now, [mushrooms], changes=ChangeReading({}, areas)) == Decision("add")


# ---- the worker's decisions (formation_decisions.py) over the default embedder -----------------------------


def test_change_reading_passes_only_unblocked_changes() -> None:
    head = load_change_head()
    facts = [
        Fact("We sold up and left Brisbane, living in Hobart now", ("a",), T2),
        Fact(
            "My sister sold up and left Brisbane, living in Hobart now", ("b",), T2
        ),  # another person: the guard blocks it
        Fact("I might sell up and leave Brisbane for Hobart", ("c",), T2),  # a plan
        Fact("I love the beaches in Hobart", ("d",), T2),  # no change word
    ]
    texts = [f.text for f in facts] + ["I live in York"]
    vectors = dict(zip(texts, default_embedder().embed(texts), strict=True))
    reading = change_reading(head, facts, vectors)
    assert reading.changed == {facts[0].text: "home"}
    assert reading.areas["I live in York"] == "home"
    assert set(reading.areas) <= set(texts)


def test_a_change_told_in_words_alone_in_a_single_valued_area_is_read() -> None:
    """The head reads "We bought a flat in Bristol" as about home (change probability 0.13): in one of the areas
    with one current value a word of change is enough (change_guard.tells_change, strict), and the change retires
    only a memory at least TOLD_SIMILARITY close."""
    head = load_change_head()
    bought = Fact("We bought a flat in Bristol", ("a",), T2)
    since = Fact("I have since found chemistry useful", ("b",), T2)  # "since" says how long, not a change
    texts = [bought.text, since.text, "I live in Leeds, near the station"]
    vectors = dict(zip(texts, default_embedder().embed(texts), strict=True))
    reading = change_reading(head, [bought, since], vectors)
    assert reading.changed == {bought.text: "home"} and reading.told == {bought.text}


def test_a_change_told_in_words_takes_the_area_of_the_memory_closest_to_it(tmp_path: Path) -> None:
    """The head reads "I have given up the sudoku in the paper" in no area: told as a change in words, it takes the
    area of the closest memory (a taste, cosine above TOLD_NEAR) and retires it; a negation that says a state is
    over is a word of change ("Not seeing Ollie any more")."""
    said = ["I do the sudoku in the paper every morning.", "I have given up the sudoku in the paper."]
    with MemoryStore(tmp_path / "a.sqlite") as store:
        current, retired = formed(store, said)
    assert (current, retired) == ([said[1]], [said[0]])
    said = ["I'm seeing a guy called Ollie, early days.", "Not seeing Ollie any more."]
    with MemoryStore(tmp_path / "b.sqlite") as store:
        current, retired = formed(store, said)
    assert (current, retired) == ([said[1]], [said[0]])


def test_a_named_partners_ending_retires_only_a_memory_naming_them(tmp_path: Path) -> None:
    said = [
        "My partner Rory and I share a flat in Douglas.",
        "Rory and I are done, it's been coming a while.",
    ]
    with MemoryStore(tmp_path / "a.sqlite") as store:
        current, retired = formed(store, said)
    assert retired == [said[0]]
    said = ["My partner Rory and I share a flat in Douglas.", "Tom and I are done, it's been coming a while."]
    with MemoryStore(tmp_path / "b.sqlite") as store:
        current, retired = formed(store, said)
    assert retired == []


def test_a_change_told_in_words_alone_retires_only_a_close_memory() -> None:
    bought = fact("We bought a flat in Bristol")
    areas = {**AREAS_OF, bought.text: "home"}
    closeness = {(bought.text, YORK.text): TOLD_SIMILARITY}
    similarity = lambda a, b: closeness.get((a, b), 0.0)  # noqa: E731
    told = ChangeReading({bought.text: "home"}, areas, similarity, told=frozenset({bought.text}))
    assert consolidate(bought, [YORK], changes=told) == Decision("supersede", ("m1",))
    closeness[(bought.text, YORK.text)] = TOLD_SIMILARITY - 0.01
    assert consolidate(bought, [YORK], changes=told) == Decision("add")
    # the rules read the fact a slot of the same area: no floor ("I've retired": the job); of another area: the floor
    retired = Fact("I've retired", ("t9",), T2, slot="user|job", value="retired")
    far = {**areas, retired.text: "job"}
    told = ChangeReading({retired.text: "job"}, far, lambda a, b: 0.0, told=frozenset({retired.text}))
    assert consolidate(retired, [NURSE], changes=told) == Decision("supersede", ("m2",))
    liked = Fact("Like they'd see it", ("t9",), T2, slot="user|likes:they'd_see_it", value="yes")
    far = {**areas, liked.text: "job"}
    told = ChangeReading({liked.text: "job"}, far, lambda a, b: 0.0, told=frozenset({liked.text}))
    assert consolidate(liked, [NURSE], changes=told) == Decision("add")
    # read by the head's probability instead: no floor
    read = ChangeReading({bought.text: "home"}, areas, similarity)
    assert consolidate(bought, [YORK], changes=read) == Decision("supersede", ("m1",))


BRISBANE = [
    "We're in Brisbane, in an old Queenslander in Paddington.",
    "We sold up and left Brisbane, living in Hobart now.",
]


def formed(store: MemoryStore, texts: list[str]) -> tuple[list[str], list[str]]:
    """The texts said as one user's turns, each formed by the worker (rules) in turn: (current, retired)."""
    worker = FormationWorker(store, make_extractor("rules"))
    for i, text in enumerate(texts):
        store.log_turns(
            "u", [{"role": "user", "content": text, "chat_time": f"2026-0{i + 3}-02T09:00:00.000000Z"}]
        )
        worker.form_user("u")
    rows = store.list("u", state="all", include_superseded=True, page_size=100).items
    gone = [m.superseded_by is not None or m.valid_to is not None for m in rows]
    return sorted(m.text for m, g in zip(rows, gone, strict=True) if not g), sorted(
        m.text for m, g in zip(rows, gone, strict=True) if g
    )


def test_the_worker_retires_a_home_the_rules_read_no_slot_for(tmp_path: Path) -> None:
    with MemoryStore(tmp_path / "m.sqlite") as store:  # the server's default embedder
        current, retired = formed(store, BRISBANE)
    # the rules read no slot in either turn ("left Brisbane, living in Hobart now" has no subject): without
    # the head nothing is retired (the next test)
    assert retired == [BRISBANE[0]]
    assert current == ["Left Brisbane, living in Hobart now.", "We sold up."]


def test_another_embedders_vectors_are_never_read(tmp_path: Path) -> None:
    from kvmem.text import load_embedder

    with MemoryStore(tmp_path / "m.sqlite", embedder=load_embedder("hash")) as store:
        current, retired = formed(store, BRISBANE)
    assert retired == [] and current == sorted(
        [BRISBANE[0], "Left Brisbane, living in Hobart now.", "We sold up."]
    )


def test_the_worker_retires_a_taste_given_up_and_keeps_the_others(tmp_path: Path) -> None:
    with MemoryStore(tmp_path / "m.sqlite") as store:  # the server's default embedder
        current, retired = formed(
            store,
            [
                "I play the piano most evenings.",
                "I love hiking in the Peak District.",
                "Sold my piano, I just don't play anymore.",
            ],
        )
    assert retired == ["I play the piano most evenings."]
    assert current == ["I just don't play anymore.", "I love hiking in the Peak District.", "Sold my piano."]


def test_the_worker_retires_a_taste_taken_up_by_the_pair_reading(tmp_path: Path) -> None:
    """ "Mushrooms are my favourite thing now" tells no change the first layer reads; the pair layer reads that
    it retires "I can't stand mushrooms" (and not the hiking)."""
    with MemoryStore(tmp_path / "m.sqlite") as store:
        current, retired = formed(
            store,
            [
                "I can't stand mushrooms, I always pick them out.",
                "I love hiking in the Peak District.",
                "Mushrooms are my favourite thing now, I put them in everything.",
            ],
        )
    assert retired == ["I can't stand mushrooms."]
    assert current == [
        "I always pick them out.",
        "I love hiking in the Peak District.",
        "I put them in everything.",
        "Mushrooms are my favourite thing now.",
    ]
    with MemoryStore(tmp_path / "other.sqlite") as store:  # another person's taste retires nothing
        current, retired = formed(store, ["I never liked jazz.", "My sister has started listening to jazz."])
    assert retired == []


# ---- a review's findings (each test failed before its fix) -------------------------------------------------


class _Embeds:
    embedder = default_embedder()


def _reading(facts: list[Fact], memories: list[ExistingMemory]) -> ChangeReading:
    from scheduler.formation_decisions import _vectors

    vectors = _vectors(_Embeds(), facts, [m.text for m in memories], with_turns=True)
    return change_reading(load_change_head(), facts, vectors, memories=[m.text for m in memories])


@pytest.mark.parametrize("said", ["I cooked mushrooms for the kids.", "I had mushrooms at dinner."])
def test_a_mention_without_a_taste_retires_no_taste(tmp_path: Path, said: str) -> None:
    # the pair layer reads these as likely as a change (0.8-0.9): the fact must tell a taste
    with MemoryStore(tmp_path / "m.sqlite") as store:
        assert formed(store, ["I can't stand mushrooms.", said])[1] == []


def test_another_persons_news_in_the_turn_lends_the_users_fact_no_change(tmp_path: Path) -> None:
    jazz = ExistingMemory("m1", "I hate jazz", None, None, T1, T1)
    facts = [fact("I listened to some jazz", "t2"), fact("My wife started eating meat again", "t2")]
    got = consolidate_batch(facts, [jazz], said_at=[T2, T2], changes=_reading(facts, [jazz]))
    assert got.supersessions == ()
    with MemoryStore(tmp_path / "m.sqlite") as store:
        turns = ["I hate jazz.", "I listened to some jazz last night. My wife started eating meat again."]
        assert formed(store, turns)[1] == []


@pytest.mark.parametrize(
    ("said", "about", "other"),
    [
        ("I switched to oat milk", "I drink milk", "I love cheese"),
        ("I don't play guitar anymore", "I play the guitar", "I play the piano"),
    ],
)
def test_a_taste_change_retires_the_taste_it_is_about_not_the_latest(
    said: str, about: str, other: str
) -> None:
    old = ExistingMemory("m1", about, None, None, T1, T1)
    june = "2026-06-01T10:00:00.000000Z"
    newer = ExistingMemory("m2", other, None, None, june, june)
    change = fact(said, "t3")
    reading = _reading([change], [old, newer])
    assert reading.changed.get(change.text) == "pref"
    got = consolidate_batch([change], [old, newer], said_at=[T2], changes=reading)
    assert [s.old_id for s in got.supersessions] == ["m1"]


def test_a_pair_reading_without_similarity_retires_nothing() -> None:
    taste = ExistingMemory("m1", "I can't stand mushrooms", None, None, T1, T1)
    reading = ChangeReading({}, {taste.text: "pref"}, retires=lambda a, b: 0.9, retire_at=0.5)
    assert consolidate(fact("Mushrooms are my favourite now"), [taste], changes=reading) == Decision("add")


def test_the_training_command_in_its_docstring_trains_the_shipped_sets() -> None:
    import re

    from safetensors import safe_open

    import benchmarks.memory.train_change_head as training

    named = re.search(r"--sets ([\w ]+?)\s+--head-out", training.__doc__ or "").group(1).split()
    with safe_open(str(change_head_module.DEFAULT_HEAD), "numpy") as f:
        trained_on = f.metadata()["trained_on"].split(",")
    assert named == [s for s in trained_on if not s.startswith("realtalk:")]


@pytest.mark.parametrize(
    ("taste", "said"),
    [
        ("I can't stand mushrooms.", "I had mushrooms at dinner, like my dad."),
        ("I don't eat meat.", "I cooked meat for the kids, like every Sunday."),
        ("I can't stand mushrooms.", "I'm cooking mushrooms for the kids now."),
        ("I can't stand mushrooms.", "I had mushrooms at dinner with a fan of my work."),
        ("I can't stand mushrooms.", "I bought mushrooms at my favourite shop."),
        ("I can't stand mushrooms.", "I cooked mushrooms for the kids into the evening."),
        ("I can't stand mushrooms.", "I cooked mushrooms for the kids, they love them."),
        ("I love cooking Italian food.", "I moved into a flat above an Italian restaurant."),
    ],
)
def test_a_word_that_only_sounds_like_a_taste_retires_no_taste(tmp_path: Path, taste: str, said: str) -> None:
    # a second review: "like my dad", "now", "a fan of my work", "my favourite shop", "into the evening" and
    # another's "they love them" each let a mention back into the pair reading
    with MemoryStore(tmp_path / "m.sqlite") as store:
        assert formed(store, [taste, said])[1] == []


def test_a_home_change_retires_no_taste_through_the_pair_reading(tmp_path: Path) -> None:
    with MemoryStore(tmp_path / "m.sqlite") as store:
        turns = ["I love cooking Italian food.", "I moved to a flat above an Italian restaurant, loving it."]
        assert formed(store, turns)[1] == []

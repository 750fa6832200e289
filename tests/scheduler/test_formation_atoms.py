"""A compound statement forms one memory per fact in the store (issue 45 item 5): a later move supersedes the
city alone, and the spouse's name stays served."""

from __future__ import annotations

from kvmem.formation.rules import RuleExtractor
from kvmem.text import MemoryStore
from scheduler.formation import FormationWorker


def test_a_move_retires_the_city_and_never_the_wifes_name(store: MemoryStore) -> None:
    worker = FormationWorker(store, RuleExtractor())
    store.log_turns("u", [{"role": "user", "content": "I live in Lisbon with my wife Ana."}])
    assert worker.form_user("u").num_added == 2
    lisbon, ana = sorted(store.list("u").items, key=lambda m: m.text)
    assert [(m.text, m.slot, m.slot_value) for m in (lisbon, ana)] == [
        ("I live in Lisbon.", "user|home_city", "lisbon"),
        ("My wife is Ana.", "wife|name", "ana"),
    ]
    store.log_turns("u", [{"role": "user", "content": "We moved to Porto."}])
    result = worker.form_user("u")
    assert (result.num_added, result.num_superseded) == (1, 1)
    served = sorted((m.text, m.superseded_by) for m in store.list("u", page_size=100).items)
    [porto] = [m for m in store.list("u").items if m.slot == "user|home_city"]
    assert served == [("My wife is Ana.", None), ("We moved to Porto.", None)]
    assert store.get("u", lisbon.id).superseded_by == porto.id
    assert store.get("u", ana.id).superseded_by is None

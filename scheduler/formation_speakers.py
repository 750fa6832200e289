"""Formation over a log that names its speakers (an import of a multi-party chat: turns logged with `name`).

Each speaker's facts are decided against that speaker's memories only, and every memory formed keeps who said
it (its metadata's "speaker", as an importer's own memories keep theirs): one person's move never retires
another's home, and a search that names a person lifts what that person said. A log that names nobody (the
user's own chat) is one group, decided over the same memories as before.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from kvmem.formation.types import Fact

# how many more hits than asked a speaker's search fetches before keeping that speaker's: enough where a few
# people share a log; fewer kept than asked is only fewer candidates for consolidation, never a wrong one
OVERFETCH = 4


def memory_speaker(memory: Any) -> str | None:
    """Who said a memory, as formation groups them: its metadata's "speaker", or None (the user themselves)."""
    value = memory.metadata.get("speaker") if isinstance(memory.metadata, dict) else None
    return value if isinstance(value, str) else None


def speaker_key(name: str | None) -> str | None:
    """A speaker's name as formation compares them: case and spacing ignored ("Kate", "kate", " Kate" are one
    person); None (the user) stays None."""
    if name is None:
        return None
    return " ".join(name.split()).casefold() or None


def own_turns(fact: Fact, turns: dict[str, Any]) -> Fact:
    """`fact` citing only the turn that said it where it cites turns of several speakers or sessions (an LLM
    extractor cites every user turn of its batch): the cited turn sharing the most words with it (the first
    of those on a tie), so its speaker, its session and its provenance agree. Otherwise unchanged."""
    cited = [turns[t] for t in fact.turn_ids if t in turns]
    if len({(speaker_key(t.speaker), t.session_id) for t in cited}) <= 1:
        return fact
    words = _content_words(fact.text)
    best = max(cited, key=lambda t: len(words & _content_words(t.text)))  # the first of the best
    return dataclasses.replace(fact, turn_ids=(best.id,))


_STOP = frozenset("the and but for you your our are was were has have had this that with from not".split())


def _content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"\w+", text.casefold()) if len(w) > 2 and w not in _STOP}


class SpeakerView:
    """A store as one speaker's formation decisions read it: slot candidates and search hits of that speaker's
    memories only; everything else is the store's own."""

    def __init__(self, store: Any, speaker: str | None) -> None:
        self._store = store
        self.speaker = speaker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _theirs(self, memory: Any) -> bool:
        return speaker_key(memory_speaker(memory)) == speaker_key(self.speaker)

    def slot_candidates(self, user_id: str, slot: str, *, prefix: bool = False) -> list[Any]:
        found = self._store.slot_candidates(user_id, slot, prefix=prefix)
        return [m for m in found if self._theirs(m)]

    def search(self, user_id: str, query: str, *, top_k: int = 10, **kwargs: Any) -> list[Any]:
        hits = self._store.search(user_id, query, top_k=top_k, **kwargs)
        if all(self._theirs(h.memory) for h in hits):
            return hits  # nobody else's among them (always so in a log that names nobody)
        wider = min(top_k * OVERFETCH, self._store.config.max_top_k)
        hits = self._store.search(user_id, query, top_k=wider, **kwargs)
        return [h for h in hits if self._theirs(h.memory)][:top_k]


def decide_by_speaker(
    decider: Callable[..., tuple[list[Any], list[Any], list[Any], list[Any]]],
    store: Any,
    user_id: str,
    facts: list[Fact],
    said: dict[str, str],
    num_candidates: int,
    turns: dict[str, Any],
) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """`decider`'s adds, duplicates, supersessions and outdated for `facts`, each speaker's facts decided over
    that speaker's memories (`SpeakerView`), merged into one commit (add indices shifted). A fact's speaker and
    session are its first turn's (`turns`: the pass's log turns by id) once it cites only its own turn
    (`own_turns`); every add is filed under them, so a session's delete takes the memories formed from it.
    Speakers are told apart by `speaker_key`. The user's own chat is one group, None, whose view
    leaves out only memories an import said were someone else's."""
    groups: dict[str | None, list[Fact]] = {}
    names: dict[str | None, str | None] = {}  # a group's name as its first turn spelled it, spaces trimmed
    for fact in (own_turns(f, turns) for f in facts):
        name = _first(turns, fact.turn_ids, "speaker")
        key = speaker_key(name)
        names.setdefault(key, " ".join(name.split()) if key is not None else None)
        groups.setdefault(key, []).append(fact)
    adds: list[Any] = []
    duplicates: list[Any] = []
    supersessions: list[Any] = []
    outdated: list[Any] = []
    for key, group in groups.items():
        speaker = names[key]
        view = SpeakerView(store, speaker)
        g_adds, g_duplicates, g_supersessions, g_outdated = decider(
            view, user_id, group, said, num_candidates
        )
        shift = len(adds)
        adds += [
            dataclasses.replace(
                a, speaker=speaker, session_id=_first(turns, a.source_turn_ids, "session_id") or a.session_id
            )
            for a in g_adds
        ]
        duplicates += g_duplicates
        supersessions += [
            (old if isinstance(old, str) else old + shift, new + shift) for old, new in g_supersessions
        ]
        outdated += [(index + shift, newer) for index, newer in g_outdated]
    return adds, duplicates, supersessions, outdated


def _first(turns: dict[str, Any], turn_ids: tuple[str, ...], attribute: str) -> str | None:
    """`attribute` of the first of `turn_ids` among `turns` (None where there is none)."""
    turn = turns.get(turn_ids[0]) if turn_ids else None
    return getattr(turn, attribute, None)

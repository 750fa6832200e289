"""The extractor interface (turns in, atomic facts out) and the registry that builds one by name.

Knows nothing of the conversation log, the memory store or consolidation; implementations live in
`rules.py` (no LLM), `llm.py` (an OpenAI-compatible endpoint) and `self_model.py` (the served model, through
the `generate` the server passes), imported only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvmem.formation.types import Fact, TurnInput


class Extractor(Protocol):
    """Forms atomic facts from a batch of log turns.

    `extract` is pure with respect to the turns: it reads only them (their text, role and chat_time), never
    a clock, and the same turns give the same facts (the rule extractor; an LLM need not be deterministic).
    It returns facts from the user's turns only, in turn order, and raises `ExtractionError` when it cannot
    (its `transient` says whether the same turns may succeed later). It holds no lock and mutates nothing
    shared, so one instance may serve several threads.
    """

    name: str

    def extract(self, turns: Sequence[TurnInput]) -> list[Fact]: ...


def _rules(**options: Any) -> Extractor:
    from kvmem.formation.rules import RuleExtractor

    return RuleExtractor(**options)


def _openai(**options: Any) -> Extractor:
    from kvmem.formation.llm import OpenAIExtractor

    return OpenAIExtractor(**options)


def _self(**options: Any) -> Extractor:
    from kvmem.formation.self_model import ModelExtractor

    return ModelExtractor(**options)


_REGISTRY: dict[str, Callable[..., Extractor]] = {"rules": _rules, "openai": _openai, "self": _self}
EXTRACTOR_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def make_extractor(name: str, **options: Any) -> Extractor:
    """The extractor registered as `name`, built with `options` (see each class for its own)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"extractor: unknown name {name!r}; supported: {', '.join(EXTRACTOR_NAMES)}"
        ) from None
    return factory(**options)

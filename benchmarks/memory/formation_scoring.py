"""Scoring memory formation against labelled cases: how a predicted fact matches a labelled one, extraction
precision/recall and relative dates, supersession accuracy (RuleExtractor's facts consolidated turn by turn),
and the hand-labelled public sample.

Owns the matching rule (normalized equality, or a Jaccard overlap of content words of at least 0.6, one to
one, best overlap first) and each score's figures. Knows nothing of how cases are generated, of timing or of
the report: formation_bench.py runs the sets and prints.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.memory.formation_data import ExtractionCase, SupersessionCase
from kvmem.formation.base import Extractor, make_extractor
from kvmem.formation.consolidate import ExistingMemory, batch_ref, consolidate_batch
from kvmem.formation.types import Fact, TurnInput

MATCH_OVERLAP = 0.6
_WORD = re.compile(r"[a-z0-9@][a-z0-9@.'+-]*[a-z0-9]|[a-z0-9]")
_STOPWORDS = frozenset(
    "i me my we our us a an the to of in on at for with and but or so is am are was were be been it its this "
    "that just really now i'm i've we're".split()
)


# ---- matching ---------------------------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def text_score(predicted: str, expected: str) -> float:
    """1.0 for equal normalized texts, else the Jaccard overlap of content words."""
    a, b = _words(predicted), _words(expected)
    if a == b:
        return 1.0
    ca, cb = set(a) - _STOPWORDS, set(b) - _STOPWORDS
    return len(ca & cb) / len(ca | cb) if ca | cb else 0.0


def match_count(predicted: Sequence[str], expected: Sequence[str], min_overlap: float = MATCH_OVERLAP) -> int:
    """How many predicted texts match an expected one (score at least `min_overlap`), one to one, best
    pairs first."""
    pairs = sorted(
        ((text_score(p, e), i, j) for i, p in enumerate(predicted) for j, e in enumerate(expected)),
        reverse=True,
    )
    used_p: set[int] = set()
    used_e: set[int] = set()
    for score, i, j in pairs:
        if score < min_overlap:
            break
        if i not in used_p and j not in used_e:
            used_p.add(i)
            used_e.add(j)
    return len(used_p)


def same_set(predicted: Sequence[str], expected: Sequence[str]) -> bool:
    return len(predicted) == len(expected) == match_count(predicted, expected)


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


# ---- extraction ---------------------------------------------------------------------------------------------


def score_extraction(
    cases: Sequence[tuple[Sequence[TurnInput], Sequence[str]]],
    extractor: Extractor | None = None,
    min_overlap: float = MATCH_OVERLAP,
) -> dict:
    """Precision, recall and F1 of `extractor` (RuleExtractor by default) over (turns, expected fact texts)
    cases, and the share of cases expecting nothing that yield nothing. The hook for any labelled set."""
    extractor = extractor or make_extractor("rules")
    num_pred = num_exp = num_matched = 0
    empty = empty_ok = 0
    for turns, expected in cases:
        predicted = [f.text for f in extractor.extract(turns)]
        num_pred += len(predicted)
        num_exp += len(expected)
        num_matched += match_count(predicted, expected, min_overlap)
        if not expected:
            empty += 1
            empty_ok += not predicted
    precision, recall = _ratio(num_matched, num_pred), _ratio(num_matched, num_exp)
    f1 = round(2 * precision * recall / (precision + recall), 4) if precision and recall else None
    return {
        "num_cases": len(cases),
        "num_expected": num_exp,
        "num_predicted": num_pred,
        "num_matched": num_matched,
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "num_empty_cases": empty,
        "empty_case_accuracy": _ratio(empty_ok, empty),
    }


def score_dates(cases: Sequence[ExtractionCase], extractor: Extractor) -> dict:
    """Share of relative-date cases where every expected absolute phrase appears in some predicted fact."""
    dated = [c for c in cases if c.date_phrases]
    ok = 0
    misses = []
    for case in dated:
        texts = [f.text.lower() for f in extractor.extract(case.turns)]
        if all(any(p.lower() in t for t in texts) for p in case.date_phrases):
            ok += 1
        else:
            misses.append({"turn": case.turns[0].text, "expected": case.date_phrases[0], "got": texts})
    return {"num_cases": len(dated), "accuracy": _ratio(ok, len(dated)), "misses": misses[:10]}


# ---- supersession -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    current: tuple[str, ...]
    superseded: tuple[str, ...]


def consolidate_history(
    batches: Sequence[Sequence[Fact]], said_at: Sequence[str], pass_said_at: bool = True
) -> Outcome:
    """The memories after consolidating each batch of facts in order against those current so far;
    `said_at[i]` is when batch i was said, given to consolidation only with `pass_said_at` (without it,
    "newer" is judged by valid_from alone)."""
    texts: dict[str, str] = {}
    current: dict[str, ExistingMemory] = {}
    superseded: list[str] = []
    for facts, when in zip(batches, said_at, strict=True):
        if not facts:
            continue
        result = consolidate_batch(
            facts, list(current.values()), said_at=[when] * len(facts) if pass_said_at else None
        )
        ids: dict[str, str] = {}
        for index, (fact, decision) in enumerate(zip(facts, result.decisions, strict=True)):
            if decision.kind == "duplicate":
                continue
            new_id = f"m{len(texts)}"
            ids[batch_ref(index)] = new_id
            texts[new_id] = fact.text
            if decision.kind == "outdated":  # added already superseded by a newer memory: history
                superseded.append(new_id)
                continue
            current[new_id] = ExistingMemory(
                new_id, fact.text, fact.slot, fact.value, fact.valid_from, when if pass_said_at else ""
            )
        for s in result.supersessions:
            old = ids.get(s.old_id, s.old_id)
            if current.pop(old, None) is not None:
                superseded.append(old)
    return Outcome(tuple(texts[i] for i in current), tuple(texts[i] for i in superseded))


def run_history(turns: Sequence[TurnInput], extractor: Extractor, pass_said_at: bool = True) -> Outcome:
    """The memories after forming and consolidating each turn in order, as a background worker would."""
    batches = [extractor.extract([turn]) for turn in turns]
    return consolidate_history(batches, [t.chat_time for t in turns], pass_said_at)


def score_supersession(
    cases: Sequence[SupersessionCase], extractor: Extractor, pass_said_at: bool = True
) -> dict:
    """Per case: exact (the current and the superseded sets both right), the superseded set right, and for
    distractors whether anything was superseded; shares overall and per category, and the first misses."""
    by_category: dict[str, list[dict]] = defaultdict(list)
    misses = []
    for case in cases:
        out = run_history(case.turns, extractor, pass_said_at)
        superseded_ok = same_set(out.superseded, case.superseded)
        row = {
            "exact": superseded_ok and same_set(out.current, case.current),
            "superseded_ok": superseded_ok,
            "false_supersession": bool(out.superseded) if case.distractor else None,
        }
        by_category[case.category].append(row)
        if not row["exact"] and len(misses) < 15:
            misses.append(
                {
                    "id": case.id,
                    "user_turns": [t.text for t in case.turns if t.role == "user"],
                    "expected": {"current": case.current, "superseded": case.superseded},
                    "got": {"current": out.current, "superseded": out.superseded},
                }
            )

    def shares(rows: list[dict]) -> dict:
        distractors = [r for r in rows if r["false_supersession"] is not None]
        return {
            "num_cases": len(rows),
            "accuracy": _ratio(sum(r["exact"] for r in rows), len(rows)),
            "superseded_set_accuracy": _ratio(sum(r["superseded_ok"] for r in rows), len(rows)),
            "num_distractor_cases": len(distractors),
            "false_supersession_rate": _ratio(
                sum(r["false_supersession"] for r in distractors), len(distractors)
            ),
        }

    rows = [r for rs in by_category.values() for r in rs]
    return {
        **shares(rows),
        "supersession_cases": shares([r for r in rows if r["false_supersession"] is None]),
        "per_category": {category: shares(rs) for category, rs in by_category.items()},
        "misses": misses,
    }


# ---- public sample ----------------------------------------------------------------------------------------------


def public_cases(labels_path: Path, data_dir: Path | None) -> dict | str:
    """The hand-labelled public sample as extraction cases per split ("tune", "report", "all"), or why not."""
    if not labels_path.is_file():
        return f"{labels_path} not found"
    try:
        from benchmarks.memory.formation_public import DEFAULT_DATA_DIR, load_public_sample
    except ImportError as e:
        return f"benchmarks.memory.formation_public unavailable: {e}"
    try:
        turns = load_public_sample(labels_path, data_dir or DEFAULT_DATA_DIR)
    except (FileNotFoundError, KeyError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return {
        split: [
            ([TurnInput(f"{t.chat}:{t.dia_id}", "user", t.text, t.chat_time, t.chat, t.speaker)], t.facts)
            for t in turns
            if split in ("all", t.split)
        ]
        for split in sorted({t.split for t in turns}) + ["all"]
    }


def score_public(labels_path: Path, data_dir: Path | None, extractor: Extractor) -> dict:
    """Extraction scores on the hand-labelled public sample (per split), or {"skipped": why}."""
    splits = public_cases(labels_path, data_dir)
    if isinstance(splits, str):
        return {"skipped": splits}
    out = {}
    for split, cases in splits.items():
        out[split] = score_extraction(cases, extractor)
        # its labels are paraphrases in the labeller's words, never the turn's: a looser match, for scale only
        loose = score_extraction(cases, extractor, 0.3)
        out[split]["loose_match_0.3"] = {k: loose[k] for k in ("precision", "recall", "f1")}
    return out

"""Memory formation on the synthetic sets of benchmarks/memory/formation_data.py and formation_heldout.py: extraction
precision/recall, relative-date resolution, supersession accuracy and false supersessions, and extraction throughput.

Run: python -m benchmarks.memory.formation_bench --out benchmarks/results/cpu/formation.json
     [--public benchmarks/data/formation_labels/realtalk_sample.json --data-dir DIR]
A predicted fact matches a labelled one when their normalized texts are equal (lowercase words) or the
Jaccard overlap of their content words (stopwords below removed) is at least 0.6; matching is one to one,
greedy, best overlap first. The supersession pipeline runs RuleExtractor on each turn and consolidate_batch
of its facts against the memories current so far, with said_at = the turn's time (no embedding
similarity: the near-duplicate step is off). Three sets, reported apart: "dev" (the templates the rules were written against), "heldout_v1"
(phrasings written after the rules were first frozen; its figures then are in formation_heldout_v1.json,
after which it was used to improve the rules) and "heldout_v2" (written after that, never used to change
them). Prints a table; the last stdout line is one JSON document (git sha included).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import cpu_name, git_sha, print_table, write_outputs
from benchmarks.memory.formation_data import (
    SEED,
    ExtractionCase,
    SupersessionCase,
    extraction_cases,
    supersession_cases,
)
from benchmarks.memory.formation_heldout import (
    heldout2_extraction_cases,
    heldout2_supersession_cases,
    heldout_extraction_cases,
    heldout_supersession_cases,
)
from kvmem.formation.base import Extractor, make_extractor
from kvmem.formation.consolidate import ExistingMemory, batch_ref, consolidate_batch
from kvmem.formation.errors import ExtractionError
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


def evaluate(
    ext_cases: Sequence[ExtractionCase], sup_cases: Sequence[SupersessionCase], extractor: Extractor
) -> dict:
    """Extraction (overall and per category), relative dates, and supersession with and without said_at."""
    per_cat: dict[str, list[ExtractionCase]] = defaultdict(list)
    for case in ext_cases:
        per_cat[case.category].append(case)
    extraction = score_extraction([(c.turns, c.expected) for c in ext_cases], extractor)
    extraction["per_category"] = {
        category: score_extraction([(c.turns, c.expected) for c in cs], extractor)
        for category, cs in per_cat.items()
    }
    without = score_supersession(sup_cases, extractor, pass_said_at=False)
    return {
        "extraction": extraction,
        "dates": score_dates(ext_cases, extractor),
        "supersession": score_supersession(sup_cases, extractor),
        "supersession_without_said_at": {
            k: v for k, v in without.items() if k not in ("per_category", "misses")
        },
    }


def print_report(name: str, report: dict) -> None:
    extraction, supersession = report["extraction"], report["supersession"]
    print(f"extraction ({name})")
    print_table(
        ["category", "cases", "expected", "predicted", "precision", "recall"],
        [
            [
                k,
                v["num_cases"],
                v["num_expected"],
                v["num_predicted"],
                v["precision"] or "-",
                v["recall"] or "-",
            ]
            for k, v in [*extraction["per_category"].items(), ("ALL", extraction)]
        ],
    )
    dates = report["dates"]
    print(f"relative dates ({name}): {dates['accuracy']} of {dates['num_cases']} cases resolved\n")
    print(f"supersession ({name})")
    print_table(
        ["category", "cases", "exact", "superseded set", "false supersession"],
        [
            [
                k,
                v["num_cases"],
                v["accuracy"],
                v["superseded_set_accuracy"],
                "-" if v["false_supersession_rate"] is None else v["false_supersession_rate"],
            ]
            for k, v in [*supersession["per_category"].items(), ("ALL", supersession)]
        ],
    )
    without = report["supersession_without_said_at"]
    print(
        f"without said_at (valid_from only): exact {without['accuracy']}, false supersession "
        f"{without['false_supersession_rate']}\n"
    )


# ---- throughput ----------------------------------------------------------------------------------------------


def throughput(turns: Sequence[TurnInput], extractor: Extractor, passes: int = 5) -> dict:
    """Turns per second of `extractor.extract` over all `turns`, one at a time: a warm-up pass, then the
    median of `passes` timed passes, with the load averages before and after (the machine is shared)."""
    loadavg_before = list(os.getloadavg())
    for turn in turns:
        extractor.extract([turn])
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for turn in turns:
            extractor.extract([turn])
        times.append(time.perf_counter() - start)
    median_s = statistics.median(times)
    return {
        "num_turns": len(turns),
        "num_user_turns": sum(t.role == "user" for t in turns),
        "passes": passes,
        "pass_s": [round(t, 4) for t in times],
        "median_pass_s": round(median_s, 4),
        "turns_per_s": round(len(turns) / median_s, 1),
        "loadavg_before": loadavg_before,
        "loadavg_after": list(os.getloadavg()),
    }


def consolidation_throughput(
    cases: Sequence[SupersessionCase], extractor: Extractor, passes: int = 5
) -> dict:
    """Facts per second through `consolidate_history` of every case (extraction done beforehand)."""
    batches = [
        ([extractor.extract([t]) for t in case.turns], [t.chat_time for t in case.turns]) for case in cases
    ]
    num_facts = sum(len(f) for per_case, _ in batches for f in per_case)
    for per_case, said_at in batches:
        consolidate_history(per_case, said_at)
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for per_case, said_at in batches:
            consolidate_history(per_case, said_at)
        times.append(time.perf_counter() - start)
    median_s = statistics.median(times)
    return {
        "num_facts": num_facts,
        "median_pass_s": round(median_s, 4),
        "facts_per_s": round(num_facts / median_s, 1),
    }


# ---- public sample ----------------------------------------------------------------------------------------------


def score_public(labels_path: Path, data_dir: Path | None, extractor: Extractor) -> dict:
    """Extraction scores on the hand-labelled public sample (per split), or {"skipped": why}."""
    if not labels_path.is_file():
        return {"skipped": f"{labels_path} not found"}
    try:
        from benchmarks.memory.formation_public import DEFAULT_DATA_DIR, load_public_sample
    except ImportError as e:
        return {"skipped": f"benchmarks.memory.formation_public unavailable: {e}"}
    try:
        turns = load_public_sample(labels_path, data_dir or DEFAULT_DATA_DIR)
    except (FileNotFoundError, KeyError, ValueError) as e:
        return {"skipped": f"{type(e).__name__}: {e}"}
    out = {}
    for split in sorted({t.split for t in turns}) + ["all"]:
        chosen = [t for t in turns if split in ("all", t.split)]
        cases = [
            ([TurnInput(f"{t.chat}:{t.dia_id}", "user", t.text, t.chat_time, t.chat, t.speaker)], t.facts)
            for t in chosen
        ]
        out[split] = score_extraction(cases, extractor)
        # its labels are paraphrases in the labeller's words, never the turn's: a looser match, for scale only
        loose = score_extraction(cases, extractor, 0.3)
        out[split]["loose_match_0.3"] = {k: loose[k] for k in ("precision", "recall", "f1")}
    return out


# ---- main ----------------------------------------------------------------------------------------------------------


def _sample(cases: list, per_category: int | None) -> list:
    if per_category is None:
        return cases
    seen: dict[str, int] = defaultdict(int)
    kept = []
    for case in cases:
        if seen[case.category] < per_category:
            seen[case.category] += 1
            kept.append(case)
    return kept


def _env() -> dict:
    return {
        "python": platform.python_version(),
        "git_sha": git_sha(),
        "cpu": cpu_name(),
        "num_cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


class _Remembered:
    """An LLM extractor as the scores call it: each distinct batch asked once (the scores ask the same turns
    several times), and a failed call (ExtractionError) scored as no facts and counted, as the server's worker
    would dead-letter it."""

    def __init__(self, extractor: Extractor) -> None:
        self.inner, self.name = extractor, extractor.name
        self.answers: dict[tuple, list] = {}
        self.errors: list[str] = []

    def extract(self, turns: Sequence[TurnInput]) -> list:
        key = tuple((t.id, t.role, t.text, t.chat_time) for t in turns)
        if key not in self.answers:
            try:
                self.answers[key] = self.inner.extract(turns)
            except ExtractionError as e:
                self.errors.append(str(e)[:300])
                self.answers[key] = []
        return self.answers[key]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--per-category", type=int, default=None, help="at most this many cases per category")
    parser.add_argument("--passes", type=int, default=5, help="timed throughput passes (median reported)")
    parser.add_argument("--public", type=Path, default=None, help="labelled public sample (formation_labels)")
    parser.add_argument("--data-dir", type=Path, default=None, help="REALTALK copy for --public")
    parser.add_argument(
        "--extractor-url",
        default=None,
        help="score the openai extractor over this OpenAI-compatible endpoint instead of the rules (held-out v2 "
        "only, no throughput passes; use --per-category to bound the calls)",
    )
    parser.add_argument(
        "--extractor-model", default="default", help="the model name sent with --extractor-url"
    )
    parser.add_argument(
        "--extraction-only", action="store_true", help="with --extractor-url: no supersession cases"
    )
    args = parser.parse_args(argv)

    if args.extractor_url:
        extractor = _Remembered(
            make_extractor("openai", url=args.extractor_url, model=args.extractor_model, timeout_s=600.0)
        )
    else:
        extractor = make_extractor("rules")
    sets = {
        "dev": (extraction_cases(args.seed), supersession_cases(args.seed)),
        "heldout_v1": (heldout_extraction_cases(args.seed), heldout_supersession_cases(args.seed)),
        "heldout_v2": (heldout2_extraction_cases(args.seed), heldout2_supersession_cases(args.seed)),
    }
    if args.extractor_url:  # an LLM: seconds per call on this CPU
        sets = {"heldout_v2": (sets["heldout_v2"][0], () if args.extraction_only else sets["heldout_v2"][1])}
    sets = {k: (_sample(e, args.per_category), _sample(c, args.per_category)) for k, (e, c) in sets.items()}
    started = time.perf_counter()
    reports = {name: evaluate(ext, sup, extractor) for name, (ext, sup) in sets.items()}
    evaluate_s = time.perf_counter() - started
    all_turns = [t for ext, sup in sets.values() for c in [*ext, *sup] for t in c.turns]
    if args.extractor_url:
        speed = {
            "evaluate_s": round(evaluate_s, 1),
            "num_turns": len(all_turns),
            "num_calls": len(extractor.answers),
            "num_failed_calls": len(extractor.errors),
            "failed_calls": extractor.errors,
            "skipped": "throughput passes (LLM extractor)",
        }
    else:
        speed = throughput(all_turns, extractor, args.passes)
        speed["consolidation"] = consolidation_throughput(
            [c for _, sup in sets.values() for c in sup], extractor, args.passes
        )
    public = (
        score_public(args.public, args.data_dir, extractor) if args.public else {"skipped": "no --public"}
    )

    for name, report in reports.items():
        print_report(name, report)
    if "turns_per_s" in speed:
        print(
            f"throughput: {speed['turns_per_s']} turns/s over {speed['num_turns']} turns "
            f"(median of {speed['passes']}), loadavg {speed['loadavg_before']}; consolidation "
            f"{speed['consolidation']['facts_per_s']} facts/s"
        )
    else:
        print(f"evaluated {speed['num_turns']} turns in {speed['evaluate_s']} s")
    for split, scores in public.items():
        if isinstance(scores, dict):
            loose = scores["loose_match_0.3"]
            print(
                f"public {split}: {scores['num_cases']} turns, precision {scores['precision']} recall "
                f"{scores['recall']} f1 {scores['f1']} (Jaccard >= 0.3: precision {loose['precision']} recall "
                f"{loose['recall']})"
            )
        else:
            print(f"public: {split} {scores}")
    result = {
        "benchmark": "formation",
        "env": _env(),
        "config": {
            "seed": args.seed,
            "per_category": args.per_category,
            "extractor": extractor.name,
            "extractor_url": args.extractor_url,
            "extractor_model": args.extractor_model if args.extractor_url else None,
            "match_rule": f"normalized text equal or content-word Jaccard >= {MATCH_OVERLAP}, one to one",
            "similarity": None,
        },
        **reports,
        "throughput": speed,
        "public": public,
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

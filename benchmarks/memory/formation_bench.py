"""Memory formation on the synthetic sets (benchmarks/memory/formation_extraction.py, formation_supersession.py,
formation_heldout.py): extraction precision/recall, relative-date resolution, supersession accuracy and false
supersessions, and extraction throughput. The scoring is formation_scoring.py's; this module runs and reports.

Run: python -m benchmarks.memory.formation_bench --out benchmarks/results/cpu/formation.json
     [--public benchmarks/data/formation_labels/realtalk_sample.json --data-dir DIR]
A predicted fact matches a labelled one when their normalized texts are equal (lowercase words) or the
Jaccard overlap of their content words (stopwords removed: formation_scoring.py) is at least 0.6; matching is one to one,
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
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import cpu_name, git_sha, print_table, write_outputs
from benchmarks.memory.formation_data import SEED, ExtractionCase, SupersessionCase
from benchmarks.memory.formation_extraction import extraction_cases
from benchmarks.memory.formation_heldout import (
    heldout2_extraction_cases,
    heldout2_supersession_cases,
    heldout_extraction_cases,
    heldout_supersession_cases,
)
from benchmarks.memory.formation_scoring import (
    MATCH_OVERLAP,
    consolidate_history,
    public_cases,
    score_dates,
    score_extraction,
    score_public,
    score_supersession,
)
from benchmarks.memory.formation_scoring import match_count as match_count  # re-exported
from benchmarks.memory.formation_scoring import text_score as text_score  # re-exported
from benchmarks.memory.formation_supersession import supersession_cases
from kvmem.formation.base import Extractor, make_extractor
from kvmem.formation.errors import ExtractionError
from kvmem.formation.types import TurnInput

# ---- evaluation ------------------------------------------------------------------------------------------


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

    @staticmethod
    def _key(turns: Sequence[TurnInput]) -> tuple:
        return tuple((t.id, t.role, t.text, t.chat_time) for t in turns)

    def extract(self, turns: Sequence[TurnInput]) -> list:
        key = self._key(turns)
        if key not in self.answers:
            try:
                answer = self.inner.extract(turns)
            except ExtractionError as e:
                self.errors.append(str(e)[:300])
                answer = []
            self.answers[key] = answer
        return self.answers[key]

    def prefetch(self, batches: Sequence[Sequence[TurnInput]], concurrency: int) -> None:
        """Ask every batch now, `concurrency` at once (an engine batches their rows), so that the scores,
        which ask in order, read remembered answers. Each batch is its own key, so the answers are the same
        as one at a time."""
        if concurrency > 1:
            distinct = {self._key(b): b for b in batches if self._key(b) not in self.answers}
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(self.extract, distinct.values()))


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
    parser.add_argument(
        "--self-model",
        default=None,
        help="score the self extractor (the model in this process's own engine, replies under the facts "
        "schema; 'default': the provisioned default model, 'demo': the demo model) instead of the rules; "
        "held-out v2 only, as --extractor-url. Supersession still goes through consolidation's rules over "
        "its facts",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="an LLM extractor's calls in flight at once (the engine batches their rows); answers are then "
        "scored in order, as with 1",
    )
    parser.add_argument(
        "--public-only", action="store_true", help="score only --public (no synthetic sets, no throughput)"
    )
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.public_only and not args.public:
        parser.error("--public-only needs --public")

    env = _env()  # before the model loads and the turns run: the load the run started on
    backend = None
    if args.self_model:
        from kvmem.models import provision, provision_demo_model
        from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
        from serving.background.self_generate import backend_generate

        named = {"default": provision, "demo": provision_demo_model}
        model = str(named[args.self_model]()) if args.self_model in named else args.self_model
        backend = TransformersBackend(
            TransformersBackendConfig(model=model, data_dir="/tmp/kvmem-formation-self", dtype="float32")
        )
        backend.load()
        extractor = _Remembered(make_extractor("self", generate=backend_generate(backend)))
        args.extractor_url = f"self:{model}"  # scored as an LLM extractor is
    elif args.extractor_url:
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
    if args.public_only:
        sets = {}
    splits = public_cases(args.public, args.data_dir) if args.public else {}
    public_turns = [turns for turns, _ in (splits.get("all", []) if isinstance(splits, dict) else [])]
    started = time.perf_counter()
    if isinstance(extractor, _Remembered):
        extractor.prefetch(
            [
                *(c.turns for ext, _ in sets.values() for c in ext),
                *([t] for _, sup in sets.values() for c in sup for t in c.turns),
                *public_turns,
            ],
            args.concurrency,
        )
    reports = {name: evaluate(ext, sup, extractor) for name, (ext, sup) in sets.items()}
    evaluate_s = time.perf_counter() - started
    all_turns = [t for ext, sup in sets.values() for c in [*ext, *sup] for t in c.turns]
    if args.extractor_url:
        speed = {
            "evaluate_s": round(evaluate_s, 1),
            "num_turns": len(all_turns) + len(public_turns),
            "num_calls": len(extractor.answers),
            "num_failed_calls": len(extractor.errors),
            "failed_calls": extractor.errors,
            "skipped": "throughput passes (LLM extractor)",
        }
    elif args.public_only:
        speed = {
            "evaluate_s": None,
            "num_turns": len(public_turns),
            "skipped": "throughput passes (--public-only)",
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
    elif "evaluate_s" in speed:
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
        "env": {**env, "loadavg_after": list(os.getloadavg())},
        "config": {
            "seed": args.seed,
            "per_category": args.per_category,
            "extractor": extractor.name,
            "extractor_url": args.extractor_url,
            "extractor_model": args.extractor_model if args.extractor_url else None,
            "match_rule": f"normalized text equal or content-word Jaccard >= {MATCH_OVERLAP}, one to one",
            "similarity": None,
            "concurrency": args.concurrency,
            "public_only": args.public_only,
        },
        **reports,
        "throughput": speed,
        "public": public,
        # an LLM's facts for the tune half of the public sample beside the labels, to read what it misses (the
        # report half stays unread)
        "public_tune_answers": [
            {
                "turn": turns[0].text,
                "predicted": [f.text for f in extractor.extract(turns)],
                "labelled": list(labelled),
            }
            for turns, labelled in (splits.get("tune", []) if isinstance(splits, dict) else [])
        ]
        if isinstance(extractor, _Remembered)
        else None,
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

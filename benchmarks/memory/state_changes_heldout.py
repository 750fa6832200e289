"""Score an extractor on the sealed held-out set of changes of state (benchmarks/data/state_changes, issue 45
item 3): each item's earlier turns and then its new turn are formed and consolidated one turn at a time, as
the background worker does, and the memories each turn formed are followed.

- changes caught: share of change items where a memory formed from the named earlier turn is superseded and
  no memory from any other earlier turn is;
- false supersessions: share of non-change items where any memory is superseded;
- chit-chat stored: chit-chat items whose new turn formed any memory (a count; target 0); questions stored
  likewise; and, over all items labelled with no new fact, how many formed one.

Run once for a report (the set must not be used to change the rules):

    python -m benchmarks.memory.state_changes_heldout --out benchmarks/results/cpu/state_changes_heldout.json

`--extractor self` (the served model forming memories, issue 45 item 2) goes through the server's own path:
each turn logged in a MemoryStore (the server's default embedder) and formed by scheduler.formation's
FormationWorker with kvmem/formation/self_model.py's ModelExtractor over a TransformersBackend
(serving/background/self_generate.py), which decides add / update / delete / none itself; `--served` takes
that path for any extractor. Its one scoring (the demo model, float32; 8 items at once, their rows batched
in the engine; over an hour on a 2-core CPU):

    python -m benchmarks.memory.state_changes_heldout --extractor self --concurrency 8 \
        --out benchmarks/results/cpu/state_changes_heldout_self.json

The data's sha256 is checked against the sealed one first; a mismatch is an error. `--set heldout_v2` scores
the second sealed set (written after the first was scored once for `self`, so that a change made after that
score, the rules' guard over the model's updates, kvmem/formation/change_guard.py, is scored on text nothing
was tuned on). `--set heldout_v3` scores the third (written after the second's misses were read, for the
slot check over the model's updates, change_guard.other_area). `--set heldout_v4` scores the fourth (written
after the third was scored once for `self` and its misses read, for the guard's "no change word" and "plan"
readings and change_guard.same_value). `--set heldout_v5` scores the fifth (written after the fourth was
scored for the rules and its misses read; it scored a lexical link between a change and the memory it names,
since taken out, and the rules without it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from benchmarks.common import env_info, write_outputs
from kvmem.formation.base import Extractor, make_extractor
from kvmem.formation.consolidate import ExistingMemory, batch_ref, consolidate_batch
from kvmem.formation.types import Fact, TurnInput

DATA = Path(__file__).resolve().parents[1] / "data" / "state_changes"
_START = datetime(2026, 3, 2, 9, 0)
_GAP = timedelta(days=60)  # the new turn comes two months after the earlier ones


SETS = (
    "heldout",
    "heldout_v2",
    "heldout_v3",
    "heldout_v4",
    "heldout_v5",
    "heldout_v6",
    "heldout_v7",
    "heldout_v8",
    "heldout_v9",
    "heldout_v10",
    "heldout_v11",
    "heldout_v12",
    "heldout_v13",
    "heldout_v14",
    "heldout_v15",
    "heldout_v16",
    "heldout_v17",
    "heldout_v18",
    "heldout_v19",
    "heldout_v20",
    "heldout_v21",
    "heldout_v22",
)  # the first (2026-11-28), three more (2026-11-29), the fifth (2026-11-30), the sixth to the eleventh (2026-12-01),
# the twelfth to the twentieth (2026-12-02), the twenty-first and twenty-second (2026-12-03)


def load_items(data_dir: Path = DATA, name: str = "heldout") -> list[dict]:
    """The set `name` (`<name>.jsonl`), checked against its sealed sha256 (`<name>.jsonl.sha256`)."""
    raw = (data_dir / f"{name}.jsonl").read_bytes()
    digest = (data_dir / f"{name}.jsonl.sha256").read_text().split()[0]
    if hashlib.sha256(raw).hexdigest() != digest:
        raise ValueError(f"{data_dir / f'{name}.jsonl'}: sha256 differs from the sealed {digest}")
    return [json.loads(line) for line in raw.decode().splitlines()]


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.000000Z")


@dataclass(frozen=True)
class Retired:
    """A memory a later fact retired, and the index of the turn it was formed from."""

    memory: ExistingMemory
    turn: int
    by: Fact


class ChangeReader:
    """The change head's reading of a batch (scheduler.formation_decisions.change_reading, the worker's code)
    over the server's default embedder, each text embedded once."""

    def __init__(self, head, embedder=None, encoder=None) -> None:
        from kvmem.text import default_embedder

        self.head, self.embedder, self.encoder = head, embedder or default_embedder(), encoder
        self._vectors: dict[str, object] = {}

    def __call__(self, facts: list[Fact], memories: Sequence[ExistingMemory]):
        from scheduler.formation_decisions import change_reading, turn_texts

        texts = [*(f.text for f in facts), *(m.text for m in memories), *turn_texts(facts).values()]
        missing = list(dict.fromkeys(t for t in texts if t not in self._vectors))
        if missing:
            self._vectors.update(zip(missing, self.embedder.embed(missing), strict=True))
        return change_reading(
            self.head, facts, {t: self._vectors[t] for t in texts}, self.encoder, [m.text for m in memories]
        )


def form_in_order(
    turns: Sequence[TurnInput], extractor: Extractor, reader: ChangeReader | None = None
) -> Iterator[tuple[list[Fact], list[Retired]]]:
    """One user's turns formed and consolidated in order against every memory still current, as the worker
    does with its candidates all the memories: per turn, the facts it formed and the memories they retired (a
    fact retired by a later one of its own turn included). `reader`: the change head's reading, as the
    worker's rules decisions use it (None: none)."""
    current: dict[str, ExistingMemory] = {}
    origin: dict[str, int] = {}
    for index, turn in enumerate(turns):
        facts = extractor.extract([turn])
        retired: list[Retired] = []
        if facts:
            memories = list(current.values())
            changes = reader(facts, memories) if reader is not None else None
            result = consolidate_batch(
                facts, memories, said_at=[turn.chat_time] * len(facts), changes=changes
            )
            ids: dict[str, str] = {}
            for k, (fact, decision) in enumerate(zip(facts, result.decisions, strict=True)):
                if decision.kind in ("duplicate", "outdated"):
                    continue
                new_id = f"m{len(origin)}"
                ids[batch_ref(k)] = new_id
                origin[new_id] = index
                current[new_id] = ExistingMemory(
                    new_id, fact.text, fact.slot, fact.value, fact.valid_from, turn.chat_time
                )
            for s in result.supersessions:
                old = ids.get(s.old_id, s.old_id)
                memory = current.pop(old, None)
                if memory is not None:
                    retired.append(Retired(memory, origin[old], facts[s.new_index]))
        yield facts, retired


def run_item(item: dict, extractor: Extractor) -> dict:
    """The item's turns formed and consolidated in order: which earlier turns lost a memory, and the texts
    the new turn formed."""
    session = f"sc-{item['id']}"
    times = [_START + timedelta(minutes=5 * i) for i in range(len(item["prefix"]))]
    times.append(times[-1] + _GAP)
    texts = [*item["prefix"], item["turn"]]
    turns = [
        TurnInput(f"{session}-t{index}", "user", text, _iso(moment), session)
        for index, (text, moment) in enumerate(zip(texts, times, strict=True))
    ]
    per_turn = list(form_in_order(turns, extractor))
    return {
        "superseded_turns": [r.turn for _, retired in per_turn for r in retired],
        "new_facts": [f.text for f in per_turn[-1][0]],
    }


def run_item_served(item: dict, worker, store) -> dict:
    """As run_item, through the server's own formation path: each turn logged in a MemoryStore and formed by
    scheduler.formation.FormationWorker with the extractor's decider (for `self`: the served model's add /
    update / delete / none against the store's most similar current memories)."""
    user = f"sc-{item['id']}"
    times = [_START + timedelta(minutes=5 * i) for i in range(len(item["prefix"]))]
    times.append(times[-1] + _GAP)
    index_of: dict[str, int] = {}
    for index, (text, moment) in enumerate(zip([*item["prefix"], item["turn"]], times, strict=True)):
        logged = store.log_turns(user, [{"role": "user", "content": text, "chat_time": _iso(moment)}])
        index_of[logged[0].id] = index
        while store.pending_turns(user, limit=1):
            result = worker.form_user(user)
            if result.error is not None:
                raise RuntimeError(f"item {item['id']}: formation failed: {result.error}")
    rows = store.list(user, state="all", include_superseded=True, page_size=1000).items
    superseded_from: list[int] = []
    new_facts: list[str] = []
    for memory in sorted(rows, key=lambda m: m.created_at):
        turns = sorted({index_of[t] for t in memory.source_turn_ids if t in index_of})
        if memory.superseded_by is not None or memory.valid_to is not None:
            superseded_from += turns
        if len(item["prefix"]) in turns and memory.state == "active":
            new_facts.append(memory.text)
    return {"superseded_turns": superseded_from, "new_facts": new_facts}


def served_runner(
    extractor_name: str,
    model: str | None,
    store_dir: Path,
    embedder=None,
    change_head: str | None = "shipped",
    pair_encoder: str | None = "shipped",
):
    """`item -> run_item_served(...)` for an extractor formed as the server forms it; for `self`, the model's
    engine (serving/background/self_generate.py over a TransformersBackend: the server's code) decides. The
    rules' decisions read changes with the shipped change head and pair encoder (`change_head`,
    `pair_encoder`: a file instead, or "none")."""
    from functools import partial

    from kvmem.formation.change_head import load_change_head
    from kvmem.text import MemoryStore
    from scheduler.formation import FormationWorker
    from scheduler.formation_decisions import SHIPPED, decide

    store = MemoryStore(store_dir / "memories.sqlite", embedder=embedder)  # None: the server's default
    if extractor_name == "self":
        from kvmem.formation.self_model import ModelExtractor
        from kvmem.models import provision_demo_model
        from serving.backends.transformers.backend import TransformersBackend, TransformersBackendConfig
        from serving.background.self_generate import backend_generate

        backend = TransformersBackend(
            TransformersBackendConfig(
                model=model or str(provision_demo_model()),
                data_dir=str(store_dir / "engine"),
                dtype="float32",
            )
        )
        backend.load()
        extractor = ModelExtractor(backend_generate(backend))
        worker = FormationWorker(store, extractor, decider=extractor.decide)
    else:
        head = {"shipped": SHIPPED, "none": None}.get(change_head or "none", None)
        if change_head not in (None, "shipped", "none"):
            head = load_change_head(change_head)
        worker = FormationWorker(
            store,
            make_extractor(extractor_name),
            decider=partial(decide, change_head=head, pair_encoder=load_encoder(pair_encoder)),
        )
    run = lambda item: run_item_served(item, worker, store)  # noqa: E731
    run.extractor = worker.extractor  # the scorer reports what the self extractor's guard turned
    return run


def load_encoder(spec: str | None):
    """The pair encoder a --pair-encoder value names: "shipped" (decide's SHIPPED), "none"/None, or a file."""
    from kvmem.formation.pair_encoder import load_pair_encoder
    from scheduler.formation_decisions import SHIPPED

    if spec in (None, "none"):
        return None
    return SHIPPED if spec == "shipped" else load_pair_encoder(spec).load()


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def score(items: Sequence[dict], extractor: Extractor | Callable[[dict], dict], concurrency: int = 1) -> dict:
    """The scores over `items`; with `concurrency` > 1, that many items formed at once on threads (each item is
    its own user: for `self` the engine batches their rows), scored in the set's order all the same."""
    run = extractor if callable(extractor) else (lambda item: run_item(item, extractor))
    if concurrency > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(concurrency) as pool:
            formed = dict(zip((item["id"] for item in items), pool.map(run, items), strict=True))
        run = lambda item: formed[item["id"]]  # noqa: E731 - the results above, in the set's order
    per_category: dict[str, list[bool]] = defaultdict(list)
    caught = changes = false_sup = non_changes = 0
    wrong_in_changes = 0
    chit = chit_stored = questions = questions_stored = empty = empty_stored = 0
    misses: list[dict] = []
    for item in items:
        got = run(item)
        lost = got["superseded_turns"]
        if item["kind"] == "change":
            changes += 1
            ok = item["superseded_turn"] in lost and all(t == item["superseded_turn"] for t in lost)
            caught += ok
            wrong_in_changes += any(t != item["superseded_turn"] for t in lost)
        else:
            non_changes += 1
            ok = not lost
            false_sup += not ok
        if item["category"] == "chit_chat":
            chit += 1
            chit_stored += bool(got["new_facts"])
        if item["category"] == "question":
            questions += 1
            questions_stored += bool(got["new_facts"])
        if item["new_fact"] is None:
            empty += 1
            empty_stored += bool(got["new_facts"])
        per_category[f"{item['kind']}/{item['category']}"].append(ok)
        if not ok:
            misses.append({"id": item["id"], "turn": item["turn"], "superseded_turns": lost, **got})
    return {
        "num_changes": changes,
        "changes_caught": _ratio(caught, changes),
        "changes_superseding_another_memory": wrong_in_changes,
        "num_non_changes": non_changes,
        "false_supersessions": _ratio(false_sup, non_changes),
        "num_chit_chat": chit,
        "chit_chat_stored": chit_stored,
        "num_questions": questions,
        "questions_stored": questions_stored,
        "num_no_new_fact": empty,
        "no_new_fact_but_stored": empty_stored,
        "per_category": {k: {"n": len(v), "ok": sum(v)} for k, v in sorted(per_category.items())},
        "misses": misses,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extractor", default="rules", help="a registered extractor name (default rules)")
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument(
        "--set",
        default="heldout",
        choices=SETS,
        help="which sealed set: heldout (the first, 2026-11-28), or heldout_v2 ... heldout_v12 (each "
        "written after the one before it was scored and read; see benchmarks/data/state_changes/README.md)",
    )
    parser.add_argument("--limit", type=int, default=0, help="score only the first N items (smoke runs)")
    parser.add_argument(
        "--served",
        action="store_true",
        help="form through the server's path (a MemoryStore and scheduler.formation.FormationWorker with the "
        "extractor's decider); always so for `self`",
    )
    parser.add_argument(
        "--model", default=None, help="`self`'s model dir (default: the provisioned demo model)"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="the store's and engine's dir (default: a temp)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="items formed at once (each its own user; `self`'s engine batches their rows)",
    )
    parser.add_argument(
        "--change-head",
        default="shipped",
        help="with --served and a rules extractor: the change head the decisions read (kvmem/formation/"
        "change_head.py): 'shipped' (the server's), 'none', or a head file",
    )
    parser.add_argument(
        "--pair-encoder",
        default="shipped",
        help="with --served and a rules extractor: the pair encoder the decisions read (kvmem/formation/"
        "pair_encoder.py): 'shipped' (the server's), 'none', or an encoder file",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error(f"--concurrency must be >= 1, got {args.concurrency}")
    env = env_info()
    items = load_items(args.data_dir, args.set)
    if args.limit:
        items = items[: args.limit]
    result = {
        "env": env,
        "set": args.set,
        "data_sha256": (args.data_dir / f"{args.set}.jsonl.sha256").read_text().split()[0],
        "extractor": args.extractor,
        "targets": {"changes_caught": ">= 0.8", "false_supersessions": "<= 0.02", "chit_chat_stored": 0},
    }
    if args.served or args.extractor == "self":
        import tempfile

        work = args.work_dir or Path(tempfile.mkdtemp(prefix="kvmem-heldout-"))
        result["path"] = "served (MemoryStore + FormationWorker)"
        result["concurrency"] = args.concurrency
        runner = served_runner(
            args.extractor, args.model, work, change_head=args.change_head, pair_encoder=args.pair_encoder
        )
        if args.extractor != "self":
            result["change_head"] = args.change_head
            result["pair_encoder"] = args.pair_encoder
        result.update(score(items, runner, args.concurrency))
        guarded = getattr(runner.extractor, "guarded", None)
        if guarded is not None:  # self: the model's updates and deletes the rules' guard kept as new facts
            result["updates_guarded"] = dict(sorted(guarded.items()))
    else:
        result.update(score(items, make_extractor(args.extractor)))
    if args.out is not None:
        write_outputs(result, args.out)
    else:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

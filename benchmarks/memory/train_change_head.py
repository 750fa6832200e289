"""Trains the change head (kvmem/formation/change_head.py: the area a statement is about, whether it tells a
change of state, and whether it retires a given memory) on the sealed held-out sets of changes of state that have
been scored and read.

Run (the shipped head, a minute once the embedder is provisioned and REALTALK copied by
`python -m benchmarks.memory.conversations`):
    python -m benchmarks.memory.train_change_head \
        --sets heldout heldout_v2 heldout_v3 heldout_v4 heldout_v5 heldout_v6 heldout_v7 heldout_v8 heldout_v9 \
        --head-out kvmem/formation/change_head.safetensors --out benchmarks/results/cpu/change_head_train.json
(a head other than the shipped one is refused until DEFAULT_HEAD_SHA256 in change_head.py holds the sha256 this
prints). Choosing the settings (docs/benchmarks.md): the same on the sets before one not yet trained on (they were
chosen with `--sets heldout ... heldout_v5 --head-out H`), then `python -m benchmarks.memory.state_changes_heldout
--set heldout_v6 --served --change-head H` and `python -m benchmarks.memory.realtalk_supersessions --chats report
--change-head H`.

Data: every item of the named sets (benchmarks/data/state_changes; each checked against its sealed sha256), and
every turn of REALTALK's tune split's five chats (NEGATIVE_CHATS: real chat, where almost nothing said is a change
of state; the report split's five are kept for realtalk_supersessions to report on). Every text is embedded by the
server's default embedder (its memory vectors, as the store keeps them). Labels:
- change: an item's new turn is 1 for a change item, 0 otherwise; every earlier turn is 0 (a statement of how
  things are, not a change); every REALTALK turn is 0 (without them the head read a change in one of eight
  of that chat's statements, and a change read in passing talk retires a memory);
- area (home / job / partner / pref): a change item's new turn and the earlier turn it supersedes by the item's
  category (move: home; job_start, job_quit, job_duration, retired: job; relationship_start / _end: partner;
  pref_given_up / _taken_up: pref); a non-change item's only earlier turn, and a restatement's new turn, by the
  slot its `old_fact` names (home; job, employer, occupation, workplace: job; relationship, spouse, girlfriend:
  partner; any other: pref); other texts have no area label;
- retires (pairs): each item's new turn against each of its earlier turns, 1 for the one a change supersedes;
  and pairs of one REALTALK speaker's turns (a later one and an earlier one) as 0: RANDOM_PAIRS at random per
  speaker and each turn with its NEAREST_PAIRS nearest earlier turns by memory vector.
Model: three softmax-linear layers (change: 2 classes and area: 4, over the 384-d vectors; pair: 2, over a
pair's two vectors and their product), cross-entropy plus L2 * sum of squared weights, fitted by L-BFGS (torch,
strong-Wolfe line search, 500 iterations, float32, one thread, seed 0): the same command writes the same file.
Settings chosen on the fifth set with the head trained on the first four (see docs/benchmarks.md): L2 1e-5
(1e-4 and above under-fit: nothing passes a threshold above 0.5), threshold THRESHOLD; the pair threshold on the
sixth with the head trained on the first five. The shipped head is trained on the first nine (2026-12-01): on the
tenth, through the worker with the same rules and encoder, it caught 52 of 106 changes against the head trained on
seven's 50, at 2 false supersessions each, and retired 12 memories on REALTALK's report split, as that head did; the
same recipe on all ten sets retired 15 there, and was not kept; on thirteen and fourteen sets at threshold 0.5 (2026-12-02)
it caught 1 more on the fifteenth set and retired 11 there, fewer of them rightly: not kept (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import git_sha, write_outputs
from benchmarks.memory.formation_public import DEFAULT_DATA_DIR
from benchmarks.memory.realtalk_supersessions import NEGATIVE_CHATS, chat_paths, speakers_turns
from benchmarks.memory.state_changes_heldout import load_items
from kvmem.formation.change_head import AREAS, save_change_head
from kvmem.text import load_embedder

SEED = 0
L2 = 1e-5
THRESHOLD = 0.35
AREA_THRESHOLD = 0.9
PAIR_THRESHOLD = 0.5
RANDOM_PAIRS = 300  # random pairs of one REALTALK speaker's turns, per speaker
NEAREST_PAIRS = 3  # each REALTALK turn with its nearest earlier turns
CATEGORY_AREA = {
    "move": "home",
    "job_start": "job",
    "job_quit": "job",
    "job_duration": "job",
    "retired": "job",
    "relationship_start": "partner",
    "relationship_end": "partner",
    "pref_given_up": "pref",
    "pref_taken_up": "pref",
}
SLOT_AREA = {
    "home": "home",
    "job": "job",
    "employer": "job",
    "occupation": "job",
    "workplace": "job",
    "relationship": "partner",
    "spouse": "partner",
    "girlfriend": "partner",
}


def slot_area(fact: str | None) -> str | None:
    """The area of a labelled fact "slot: value" (None: no fact)."""
    if not fact:
        return None
    return SLOT_AREA.get(fact.split(":", 1)[0].strip().lower(), "pref")


def examples(items: list[dict]) -> tuple[list[str], list[str | None], list[int]]:
    """(texts, area labels or None, change labels) of the items' turns, as the module docstring says."""
    texts: list[str] = []
    areas: list[str | None] = []
    changes: list[int] = []
    for item in items:
        change = item["kind"] == "change"
        for index, text in enumerate(item["prefix"]):
            if change:
                area = CATEGORY_AREA[item["category"]] if index == item["superseded_turn"] else None
            else:
                area = slot_area(item.get("old_fact")) if len(item["prefix"]) == 1 else None
            texts.append(text), areas.append(area), changes.append(0)
        if change:
            area = CATEGORY_AREA[item["category"]]
        else:
            area = slot_area(item.get("old_fact")) if item["category"] == "restatement" else None
        texts.append(item["turn"]), areas.append(area), changes.append(int(change))
    return texts, areas, changes


def fit_softmax(x: np.ndarray, y: np.ndarray, classes: int, l2: float = L2) -> tuple[np.ndarray, np.ndarray]:
    """Softmax regression by L-BFGS: ([classes, D] weights, [classes] bias)."""
    torch.manual_seed(SEED)
    inputs, targets = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    weight = torch.zeros(classes, x.shape[1], requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(inputs @ weight.T + bias, targets) + l2 * (weight**2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return weight.detach().numpy(), bias.detach().numpy()


def chat_speakers(data_dir: Path) -> list[list[str]]:
    """Each speaker's distinct turns, in order, in REALTALK's tune split's chats (NEGATIVE_CHATS)."""
    paths = chat_paths(data_dir, NEGATIVE_CHATS)
    return [list(dict.fromkeys(text for text, _ in turns)) for _, turns in speakers_turns(paths)]


def set_pairs(items: list[dict]) -> tuple[list[str], list[str], list[int]]:
    """(new turns, earlier turns, retired?) of every item: its new turn against each earlier turn, 1 for the
    one a change supersedes."""
    new, old, labels = [], [], []
    for item in items:
        for index, text in enumerate(item["prefix"]):
            new.append(item["turn"]), old.append(text)
            labels.append(int(item["kind"] == "change" and index == item["superseded_turn"]))
    return new, old, labels


def chat_pairs(
    speakers: list[list[str]],
    vector: dict[str, np.ndarray],
    random_pairs: int = RANDOM_PAIRS,
    nearest_pairs: int = NEAREST_PAIRS,
) -> tuple[list[str], list[str]]:
    """Pairs (a later turn, an earlier turn of the same speaker) that retire nothing: per speaker
    `random_pairs` drawn at random (seed SEED), and each turn with its `nearest_pairs` closest earlier turns by
    memory vector (the candidates the worker weighs are the nearest)."""
    rng = random.Random(SEED)
    new, old = [], []
    for turns in speakers:
        if len(turns) < 2:
            continue
        for _ in range(random_pairs):
            i = rng.randrange(1, len(turns))
            new.append(turns[i]), old.append(turns[rng.randrange(i)])
        matrix = np.stack([vector[t] for t in turns])
        for i in range(1, len(turns)):
            for j in np.argsort(-(matrix[:i] @ matrix[i]), kind="stable")[:nearest_pairs]:
                new.append(turns[i]), old.append(turns[int(j)])
    return new, old


def train(
    sets: list[str], embedder_spec: str = "default", chats: Path | None = DEFAULT_DATA_DIR
) -> tuple[dict[str, np.ndarray], dict]:
    """The head's tensors and what it was trained on; `chats`: REALTALK's Chat_*.json (None: no real chat,
    for a head of the sets alone)."""
    items = [item for name in sets for item in load_items(name=name)]
    texts, areas, changes = examples(items)
    speakers = chat_speakers(chats) if chats is not None else []
    negatives = list(dict.fromkeys(t for turns in speakers for t in turns))
    texts, areas, changes = texts + negatives, areas + [None] * len(negatives), changes + [0] * len(negatives)
    embedder = load_embedder(embedder_spec)
    vectors = embedder.embed(texts)  # [n, D], the store's memory vectors
    labelled = [i for i, a in enumerate(areas) if a is not None]
    area_w, area_b = fit_softmax(
        vectors[labelled], np.array([AREAS.index(areas[i]) for i in labelled]), len(AREAS)
    )
    change_w, change_b = fit_softmax(vectors, np.array(changes), 2)
    vector = dict(zip(texts, vectors, strict=True))
    new, old, retired = set_pairs(items)
    chat_new, chat_old = chat_pairs(speakers, vector)
    new, old, retired = new + chat_new, old + chat_old, retired + [0] * len(chat_new)
    a, b = np.stack([vector[t] for t in new]), np.stack([vector[t] for t in old])
    pair_w, pair_b = fit_softmax(np.concatenate([a, b, a * b], axis=1), np.array(retired), 2)
    tensors = {
        "change.weight": change_w,
        "change.bias": change_b,
        "area.weight": area_w,
        "area.bias": area_b,
        "pair.weight": pair_w,
        "pair.bias": pair_b,
    }
    info = {
        "embedder": embedder.name,
        "num_texts": len(texts),
        "num_chat_negatives": len(negatives),
        "num_changes": int(sum(changes)),
        "num_area_labels": len(labelled),
        "area_counts": {a: sum(1 for x in areas if x == a) for a in AREAS},
        "num_pairs": len(retired),
        "num_chat_pairs": len(chat_new),
        "num_retiring_pairs": int(sum(retired)),
    }
    return tensors, info


def training_parser(doc: str, negatives: str) -> argparse.ArgumentParser:
    """The arguments a trainer on the sealed sets and REALTALK's tune split takes: --sets and --chats (whose
    `negatives` are the trained model's real-chat negatives)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--sets", nargs="+", required=True, help="sealed sets to train on (already scored)")
    parser.add_argument(
        "--chats",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help=f"REALTALK's Chat_*.json (python -m benchmarks.memory.conversations); its tune split's {negatives}",
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = training_parser(__doc__, "turns are the head's real-chat negatives")
    parser.add_argument("--embedder", default="default")
    parser.add_argument("--threshold", type=float, default=THRESHOLD)
    parser.add_argument("--area-threshold", type=float, default=AREA_THRESHOLD)
    parser.add_argument("--pair-threshold", type=float, default=PAIR_THRESHOLD)
    parser.add_argument("--head-out", type=Path, required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tensors, info = train(args.sets, args.embedder, args.chats)
    metadata = {
        "embedder": info["embedder"],
        "areas": ",".join(AREAS),
        "threshold": repr(args.threshold),
        "area_threshold": repr(args.area_threshold),
        "pair_threshold": repr(args.pair_threshold),
        "trained_on": ",".join([*args.sets, *(f"realtalk:{c}" for c in NEGATIVE_CHATS)]),
        "l2": repr(L2),
        "seed": str(SEED),
    }
    sha = save_change_head(args.head_out, tensors, metadata)
    result = {
        "benchmark": "change head training",
        "git_sha": git_sha(),
        "loadavg": [round(v, 2) for v in os.getloadavg()],
        "sets": args.sets,
        "threshold": args.threshold,
        "area_threshold": args.area_threshold,
        "pair_threshold": args.pair_threshold,
        "l2": L2,
        **info,
        "head": str(args.head_out),
        "content_sha256": sha,
    }
    print(f"wrote {args.head_out}: content sha256 {sha}")
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""Trains the pair encoder (kvmem/formation/pair_encoder.py: whether a new statement retires a given memory, MiniLM
over both texts) on the sealed held-out sets of changes of state that have been scored and read.

Run (the shipped encoder; ~8 minutes on two cores once the embedder is provisioned and REALTALK copied by
`python -m benchmarks.memory.conversations`):
    python -m benchmarks.memory.train_pair_encoder \
        --sets heldout heldout_v2 heldout_v3 heldout_v4 heldout_v5 heldout_v6 heldout_v7 heldout_v8 \
        --encoder-out kvmem/formation/pair_encoder.safetensors \
        --out benchmarks/results/cpu/pair_encoder_train.json
(an encoder other than the shipped one is refused until DEFAULT_ENCODER_SHA256 in pair_encoder.py holds the sha256
this prints). Choosing the threshold (docs/benchmarks.md): the same on the sets before one not yet trained on, then
`python -m benchmarks.memory.state_changes_heldout --set <that set> --served --pair-encoder E`.

Data: pairs (new statement, memory) labelled 1 where the statement retires the memory:
- every item of the named sets (benchmarks/data/state_changes; each checked against its sealed sha256): its new
  turn against each of its earlier turns, 1 for the one a change supersedes (train_change_head.set_pairs);
- pairs of one REALTALK speaker's turns (a later one, an earlier one) in the tune split's five chats, all 0 (real
  chat, where almost nothing said retires anything; the report split's five are kept for realtalk_supersessions):
  RANDOM_PAIRS at random per speaker and each turn with its NEAREST_PAIRS closest earlier turns by the default
  embedder's memory vectors (train_change_head.chat_pairs); `--random-pairs` / `--nearest-pairs` change the two
  counts (the shipped encoder was trained with the defaults).
Model: pair_encoder.PairModel (texts without their closing punctuation), rank RANK (alpha 2 x rank) deltas on each
layer's query and value, a zero-initialised logistic head over the mean-pooled last states. Loss: binary
cross-entropy. AdamW lr LR, no weight decay, batches of BATCH pairs in an order shuffled each epoch, EPOCHS epochs,
torch seed SEED (the deltas' initialisation) and python seed SEED (the order), two torch threads.
Settings: the first that were tried (a scratch run of the same recipe trained on the first six sets read 98 of
the seventh's 106 changes' superseded turns above 0.5, and 45 of its 109 non-changes); the threshold chosen on the
eighth set through the worker with the encoder trained on the first seven, after a review's fixes (texts read
without their closing punctuation, negated facts not read, candidates at cosine >= 0.2; results in
benchmarks/results/cpu/pair_encoder_dev/review/; docs/benchmarks.md): 0.5 / 0.6 / 0.7 / 0.8 / 0.9 caught 0.679 /
0.670 / 0.642 / 0.585 / 0.472 of its changes at 11 / 9 / 5 / 4 / 3 of 109 false (none: 0.453, 3); 0.7 makes the
fewest errors of the two kinds together. Tried and not kept: each change against two other items' turns about
another area as "retires nothing" (the encoder then read "I sold my car." against "I play guitar in a band." at 0.3,
not 0.9, but retired 129 memories on REALTALK's report split at 0.6). Trained on the first fourteen sets (2026-12-02, not
kept): 69 of the fifteenth set's 106 changes caught against the shipped 55, but 88 memories retired on the report
split against 12; with `--random-pairs 300 --nearest-pairs 3`, 68 and 56 caught on the fifteenth and sixteenth
against 55 and 46, and 50 retired (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch

from benchmarks.common import git_sha, write_outputs
from benchmarks.memory.realtalk_supersessions import NEGATIVE_CHATS
from benchmarks.memory.state_changes_heldout import load_items
from benchmarks.memory.train_change_head import chat_pairs, chat_speakers, set_pairs, training_parser
from kvmem.formation.pair_encoder import PairModel, save_pair_encoder
from kvmem.text import load_embedder
from kvmem.text.search.embedders import minilm_model_dir

SEED = 0
RANK = 8
LR = 5e-4
EPOCHS = 2
BATCH = 16
THRESHOLD = 0.7
RANDOM_PAIRS = 100
NEAREST_PAIRS = 1
# three fixed probes (new statement, memory) whose probabilities the result records, for the test that the
# shipped file reproduces them
PROBES = (
    ("We packed up and moved down to Hobart last month.", "I live in Melbourne."),
    ("Mushrooms are my favourite thing now.", "I can't stand mushrooms."),
    ("My sister moved to Berlin.", "I live in Lisbon."),
)


def training_pairs(
    sets: list[str], chats: Path | None, random_pairs: int = RANDOM_PAIRS, nearest_pairs: int = NEAREST_PAIRS
) -> tuple[list[str], list[str], list[int], int]:
    """(new statements, memories, labels, how many of them are REALTALK pairs), as the module docstring says."""
    items = [item for name in sets for item in load_items(name=name)]
    new, old, labels = set_pairs(items)
    speakers = chat_speakers(chats) if chats is not None else []
    texts = list(dict.fromkeys(t for turns in speakers for t in turns))
    vector = dict(zip(texts, load_embedder("default").embed(texts), strict=True)) if texts else {}
    chat_new, chat_old = chat_pairs(speakers, vector, random_pairs, nearest_pairs)
    return new + chat_new, old + chat_old, labels + [0] * len(chat_new), len(chat_new)


def train(new: list[str], old: list[str], labels: list[int], log=print) -> PairModel:
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    model = PairModel(minilm_model_dir(), RANK, 2.0 * RANK, seed=SEED)
    optimizer = torch.optim.AdamW(model.trainable, lr=LR, weight_decay=0.0)
    order = list(range(len(labels)))
    started, steps = time.perf_counter(), 0
    model.bert.train()
    for epoch in range(EPOCHS):
        rng.shuffle(order)
        for start in range(0, len(order), BATCH):
            batch = order[start : start + BATCH]
            logits = model.logits([old[i] for i in batch], [new[i] for i in batch])
            target = torch.tensor([float(labels[i]) for i in batch])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            if steps % 100 == 0:
                log(
                    f"epoch {epoch} step {steps}: loss {loss.item():.4f}, {time.perf_counter() - started:.0f} s"
                )
    model.bert.eval()
    return model


def main(argv: list[str] | None = None) -> dict:
    parser = training_parser(__doc__, "pairs of turns are the encoder's real-chat negatives")
    parser.add_argument("--threshold", type=float, default=THRESHOLD)
    parser.add_argument(
        "--random-pairs", type=int, default=RANDOM_PAIRS, help="REALTALK pairs at random a speaker"
    )
    parser.add_argument(
        "--nearest-pairs",
        type=int,
        default=NEAREST_PAIRS,
        help="each REALTALK turn with its N closest earlier ones",
    )
    parser.add_argument("--encoder-out", type=Path, required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    started = time.perf_counter()
    new, old, labels, num_chat = training_pairs(args.sets, args.chats, args.random_pairs, args.nearest_pairs)
    print(f"{len(labels)} pairs, {sum(labels)} retiring, {num_chat} from REALTALK", flush=True)
    model = train(new, old, labels)
    with torch.inference_mode():
        probes = torch.sigmoid(model.logits([m for _, m in PROBES], [n for n, _ in PROBES])).tolist()
    metadata = {
        "rank": str(RANK),
        "alpha": repr(2.0 * RANK),
        "threshold": repr(args.threshold),
        "trained_on": ",".join([*args.sets, *(f"realtalk:{c}" for c in NEGATIVE_CHATS)]),
        "seed": str(SEED),
    }
    sha = save_pair_encoder(args.encoder_out, model.tensors(), metadata)
    result = {
        "benchmark": "pair encoder training",
        "git_sha": git_sha(),
        "loadavg": [round(v, 2) for v in os.getloadavg()],
        "sets": args.sets,
        "settings": {
            "rank": RANK,
            "lr": LR,
            "epochs": EPOCHS,
            "batch": BATCH,
            "seed": SEED,
            "random_pairs": args.random_pairs,
            "nearest_pairs": args.nearest_pairs,
        },
        "threshold": args.threshold,
        "num_pairs": len(labels),
        "num_retiring_pairs": int(sum(labels)),
        "num_chat_pairs": num_chat,
        "seconds": round(time.perf_counter() - started, 1),
        "encoder": str(args.encoder_out),
        "content_sha256": sha,
        "probes": [
            {"new": n, "memory": m, "probability": round(float(p), 6)}
            for (n, m), p in zip(PROBES, probes, strict=True)
        ],
    }
    print(f"wrote {args.encoder_out}: content sha256 {sha}")
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""Trains the query head (kvmem/text/search/query_head.py: how a search query's tokens are pooled) on REALTALK.

Run (the shipped head; nice and one thread, a few minutes once the vectors are cached; V is recall_bench's
--vector-cache file, L a scratch file):
    nice -n 19 python -m benchmarks.memory.train_query_head --split tune --vector-cache V \
        --head-out kvmem/text/search/query_head.safetensors --loco-cache-out L \
        --out benchmarks/results/cpu/recall_bench/query_head_train_tune.json
(a head other than the shipped one is refused by the default embedder until DEFAULT_HEAD_SHA256 in query_head.py
holds the sha256 this prints), then the second stage refitted on the leave-one-chat-out query vectors (see
below), the first stage as configured:
    python -m benchmarks.memory.rerank_train --split tune --vector-cache L \
        --weights-out kvmem/text/search/rerank_weights.json \
        --out benchmarks/results/cpu/recall_bench/rerank_train_tune_query_head.json
and the end-to-end figure on tune:
    python -m benchmarks.memory.recall_bench --split tune --vector-cache V \
        --out benchmarks/results/cpu/recall_bench/recall_tune_query_head.json

Data: the tune split (odd chats, benchmarks.memory.conversations.SPLITS); every question with evidence (344).
A question's positives are its evidence turns, its negatives every other turn of its chat (one chat is one
user's memories). Inputs: the last token states of the question from the default embedder's own forward
(int8 ONNX all-MiniLM-L6-v2, OnnxMiniLMEmbedder.token_states); targets: the turns' memory vectors as the store
keeps them (mean pooled, unchanged: the head only moves queries). Model: token weights
softmax(l2(gelu(l1 h))), l1 384 -> 16, l2 16 -> 1 zero-initialised so training starts from mean pooling.
Loss: listwise softmax over the chat's turns at temperature TAU, -log(sum over positives / sum over all).
AdamW lr 1e-3, no weight decay, batches of 16 questions, 20 epochs, torch seed 0 and numpy seed 0 (the
order), one torch thread. The same command writes the same head up to float rounding, not the same bytes:
l2.bias shifts every token's logit alike, so the softmax ignores it and its gradient is rounding noise, which
Adam's normalised steps turn into a walk of about 0.03; a rerun at fdccfff (onnxruntime 1.32.0, torch 2.13.0)
matched the shipped head within 6.2e-7 in every other weight, its leave-one-chat-out recall (0.451) exactly
and the probes' query vectors within 1e-6 (the test's tolerance is 2e-5), with another sha256 (d7d3fc40...).

Chosen by leave-one-chat-out dense recall@10 on tune (fit on four chats, rank the fifth's turns by the query
vector alone): mean pooling 0.328; a learned token-weight vector (no hidden layer) 0.431-0.444; a low-rank
linear map on the pooled vector 0.371; an extra transformer layer over the token states 0.406; l1 with 64
hidden 0.435; 16 hidden 0.448-0.452 over seeds 0-2 (shipped, seed 0); the memories pooled by a second
learned head too 0.457 (not shipped: every stored vector would change and need re-embedding, for +0.006).
Tried at 12b1e40, scratch runs of this module's own train() and dense_recall() (not shipped, nothing trained on
them is committed): LoCoMo's ten chats (snap-research/locomo, data/locomo10.zip; 1,535 questions of categories
1-4) added to the four training chats of each fold 0.435 (the head fitted on LoCoMo alone 0.448): more chats of
another dataset do not help; a rank-32 residual map on the pooled vector (AdamW weight decay 0.01) 0.462 on
tune alone, 0.453 with LoCoMo added (+0.011 dense at best, not worth a larger head).
A cross-encoder was not tried: over the top 50 it is ~50 x 60 tokens x 6 layers of MiniLM per search
(~32 G multiply-adds), hundreds of ms on two cores against a 30 ms p99 budget.

Writes: the head fitted on every tune question (--head-out); the query vectors of tune's questions each from
the head fitted without its chat, into a copy of the --vector-cache file under the default embedder's query
keys (--loco-cache-out), so the second stage is fitted on query vectors like those of questions the head never
saw; a JSON result (git sha, load average, the settings, leave-one-chat-out and in-sample dense recall@10 by
chat and category, the head's sha256, and the query vectors of three fixed probes for the test that the
shipped file reproduces them). The last stdout line is that JSON document.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from benchmarks.common import git_sha, write_outputs
from benchmarks.memory.conversations import Conversation, load_split
from benchmarks.memory.recall_bench import DEFAULT_DATA_DIR, CachedEmbedder
from kvmem.text.search.embedders import OnnxMiniLMEmbedder
from kvmem.text.search.query_head import QueryHead, save_query_head

SEED = 0
HIDDEN = 16
TAU = 0.05
LR = 1e-3
EPOCHS = 20
BATCH = 16
TOP_K = 10
PROBES = (
    "What remedies does Elise use to fall asleep faster?",
    "When did Kevin start his new job?",
    "What is my dog's name?",
)


def _key(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


class Chat:
    """One chat as training sees it: its turns' memory vectors and its questions' token states and evidence."""

    def __init__(self, conversation: Conversation, memory: np.ndarray, states: list[np.ndarray]) -> None:
        self.name = conversation.name
        position = {t.dia_id: i for i, t in enumerate(t for s in conversation.sessions for t in s.turns)}
        questions = [q for q in conversation.questions if q.evidence]
        self.memory = memory  # [turns, dim]
        self.states = states  # per question [tokens, dim]
        self.evidence = [np.array([position[e] for e in q.evidence]) for q in questions]
        self.categories = [q.category for q in questions]


def load_chat(conversation: Conversation, cached: CachedEmbedder, base: OnnxMiniLMEmbedder) -> Chat:
    """One chat: its turns' memory vectors (through `cached`) and its questions' token states (`base`)."""
    memory = cached.embed([t.text for s in conversation.sessions for t in s.turns])
    return Chat(
        conversation, memory, base.token_states([q.text for q in conversation.questions if q.evidence])
    )


def load_chats(data_dir: Path, split: str, vector_cache: Path | None) -> list[Chat]:
    """Every chat of the split (memory vectors through the vector cache file, saved after)."""
    base = OnnxMiniLMEmbedder(num_threads=1, use_query_head=False)
    cached = CachedEmbedder(base, vector_cache)
    chats = [load_chat(conversation, cached, base) for conversation in load_split(data_dir, split)]
    cached.save()
    return chats


def _head_module(torch):
    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = torch.nn.Linear(384, HIDDEN)
            self.l2 = torch.nn.Linear(HIDDEN, 1)
            torch.nn.init.zeros_(self.l2.weight)
            torch.nn.init.zeros_(self.l2.bias)

        def forward(self, hidden, mask):  # [B, T, D], [B, T] bool -> [B, D]
            gelu = torch.nn.functional.gelu(self.l1(hidden), approximate="tanh")
            logits = self.l2(gelu)[..., 0].masked_fill(~mask, float("-inf"))
            weights = torch.softmax(logits, dim=1)
            return torch.nn.functional.normalize((weights[..., None] * hidden).sum(1), dim=-1)

    return Head()


def _batch(torch, states: list[np.ndarray]):
    width = max(s.shape[0] for s in states)
    hidden = torch.zeros(len(states), width, states[0].shape[1])
    mask = torch.zeros(len(states), width, dtype=torch.bool)
    for row, s in enumerate(states):
        hidden[row, : s.shape[0]] = torch.from_numpy(s)
        mask[row, : s.shape[0]] = True
    return hidden, mask


def train(chats: list[Chat], seed: int = SEED) -> QueryHead:
    """The head fitted on every question of `chats` (see the module docstring for the recipe)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    order_rng = np.random.default_rng(seed)
    head = _head_module(torch)
    optimizer = torch.optim.AdamW(head.parameters(), lr=LR, weight_decay=0.0)
    items = [(c, i) for c in chats for i in range(len(c.states))]
    memory = {c.name: torch.from_numpy(c.memory) for c in chats}
    for _ in range(EPOCHS):
        order = order_rng.permutation(len(items))
        for start in range(0, len(order), BATCH):
            chunk = [items[j] for j in order[start : start + BATCH]]
            hidden, mask = _batch(torch, [c.states[i] for c, i in chunk])
            queries = head(hidden, mask)
            loss = 0.0
            for row, (c, i) in enumerate(chunk):
                logits = memory[c.name] @ queries[row] / TAU
                loss = loss + torch.logsumexp(logits, 0) - torch.logsumexp(logits[c.evidence[i]], 0)
            optimizer.zero_grad()
            (loss / len(chunk)).backward()
            optimizer.step()
    tensors = {name: value.detach().numpy().astype(np.float32) for name, value in head.state_dict().items()}
    return QueryHead(tensors["l1.weight"], tensors["l1.bias"], tensors["l2.weight"], tensors["l2.bias"], "")


def query_vectors(head: QueryHead | None, chat: Chat) -> np.ndarray:
    """[questions, dim]: the head's pooling of each question (mean pooling when `head` is None)."""
    out = []
    for s in chat.states:
        mask = np.ones((1, s.shape[0]), dtype=np.int64)
        if head is None:
            v = s.mean(axis=0)
            out.append(v / max(np.linalg.norm(v), 1e-12))
        else:
            out.append(head.pool(s[None], mask)[0])
    return np.stack(out).astype(np.float32)


def dense_recall(chat: Chat, queries: np.ndarray) -> list[float]:
    """Per question: the share of its evidence among the TOP_K turns nearest its query vector."""
    scores = queries @ chat.memory.T  # [questions, turns]
    out = []
    for row, evidence in enumerate(chat.evidence):
        top = np.lexsort((np.arange(scores.shape[1]), -scores[row]))[:TOP_K]
        out.append(float(np.isin(evidence, top).mean()))
    return out


def summarize(chats: list[Chat], recalls: dict[str, list[float]]) -> dict:
    """Dense recall@10 overall, by chat and by category (4 places)."""
    by_category: dict[str, list[float]] = {}
    for chat in chats:
        for category, value in zip(chat.categories, recalls[chat.name], strict=True):
            by_category.setdefault(category, []).append(value)
    every = [v for c in chats for v in recalls[c.name]]
    return {
        "recall@10": round(float(np.mean(every)), 4),
        "by_chat": {c.name: round(float(np.mean(recalls[c.name])), 4) for c in chats},
        "by_category": {k: round(float(np.mean(v)), 4) for k, v in sorted(by_category.items())},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--split", default="tune", choices=("tune",), help="the head is fitted on tune only")
    parser.add_argument(
        "--vector-cache", type=Path, default=None, help="npz of memory vectors (recall_bench's)"
    )
    parser.add_argument("--head-out", type=Path, required=True)
    parser.add_argument("--loco-cache-out", type=Path, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    loadavg = [round(v, 2) for v in os.getloadavg()]
    chats = load_chats(args.data_dir, args.split, args.vector_cache)

    plain = {c.name: dense_recall(c, query_vectors(None, c)) for c in chats}
    loco_vectors = {}
    for held in chats:
        head = train([c for c in chats if c.name != held.name])
        loco_vectors[held.name] = query_vectors(head, held)
        print(f"fitted without {held.name}", flush=True)
    loco = {c.name: dense_recall(c, loco_vectors[c.name]) for c in chats}

    head = train(chats)
    tensors = {"l1.weight": head.l1_weight, "l1.bias": head.l1_bias, "l2.weight": head.l2_weight}
    tensors["l2.bias"] = head.l2_bias
    metadata = {
        "trained_on": f"REALTALK {args.split} split, {sum(len(c.states) for c in chats)} questions",
        "recipe": f"benchmarks/memory/train_query_head.py seed={SEED} hidden={HIDDEN} tau={TAU} lr={LR} "
        f"epochs={EPOCHS} batch={BATCH}",
    }
    sha256 = save_query_head(args.head_out, tensors, metadata)
    shipped = OnnxMiniLMEmbedder(num_threads=1, query_head=args.head_out)
    in_sample = {c.name: dense_recall(c, query_vectors(shipped.query_head, c)) for c in chats}
    _, probe_vectors = shipped.embed_for_search(list(PROBES))

    if args.loco_cache_out is not None:
        # the default embedder's query keys, holding each tune question's leave-one-chat-out vector
        tag = f"{shipped.name}+qh-{sha256[:16]}"
        if args.vector_cache is not None and args.vector_cache.exists():
            shutil.copyfile(args.vector_cache, args.loco_cache_out)
        loco_cache = CachedEmbedder(shipped, args.loco_cache_out)
        for conversation in load_split(args.data_dir, args.split):
            questions = [q.text for q in conversation.questions if q.evidence]
            for text, vector in zip(questions, loco_vectors[conversation.name], strict=True):
                loco_cache.put_query(tag, text, vector)
        loco_cache.save()

    result = {
        "benchmark": "kvmem.text query head training (dense recall@10 by the query vector alone)",
        "git_sha": git_sha(),
        "loadavg": loadavg,
        "split": args.split,
        "num_questions": sum(len(c.states) for c in chats),
        "settings": {"seed": SEED, "hidden": HIDDEN, "tau": TAU, "lr": LR, "epochs": EPOCHS, "batch": BATCH},
        "mean_pooling": summarize(chats, plain),
        "leave_one_chat_out": summarize(chats, loco),
        "in_sample": summarize(chats, in_sample),
        "head": {"path": str(args.head_out), "sha256": sha256, "bytes": args.head_out.stat().st_size},
        "probes": {
            text: [round(float(v), 6) for v in vector]
            for text, vector in zip(PROBES, probe_vectors, strict=True)
        },
    }
    print(
        f"dense R@10 on {args.split}: mean pooling {result['mean_pooling']['recall@10']:.4f}, head "
        f"leave-one-chat-out {result['leave_one_chat_out']['recall@10']:.4f}, in sample "
        f"{result['in_sample']['recall@10']:.4f}; head sha256 {sha256}"
    )
    write_outputs(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Shared knowledge blocks: exactness, bytes on disk with and without parent items, and the TTFT of a user's
first request with a ~3k-token knowledge prefix and a ~0.5k-token user block.

    python -m benchmarks.ttft.knowledge_block --out benchmarks/results/cpu/knowledge_block.json

Arms (median of --repeats): `cold_child` a fresh store (nothing in RAM: a user's first request after a start)
loads the user's child item and the knowledge item from disk (the store attaches the parent; the request's
injection joins them in its own cache) and generates the first token;
`cold_child_parent_resident` the same with the knowledge item already in RAM (every user's first request
but the first one's); `cold_full` the same with a full item (no parent); `warm` the joined item already resident; `direct` no KV,
the whole prompt prefilled. `identical`: greedy tokens from the joined child equal a full prefill's.
Bytes: N users' items with one parent vs N full items (both measured on disk, not extrapolated).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from benchmarks.common import env_info, median, print_table, write_outputs
from benchmarks.ttft.memos_grid import memories_for, query_for
from benchmarks.ttft.ttft_grid import first_token_s, reference_tokens


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def knowledge_for(layout_cls, tokenizer, target_tokens: int) -> list[str]:
    texts: list[str] = []
    i = 0
    while True:
        i += 1
        texts.append(
            f"FAQ {i}: customers asking about topic {i} are told that orders of type {i} ship within "
            f"{i % 7 + 1} days, can be returned within {i % 30 + 10} days, and support answers in English."
        )
        if len(layout_cls(tokenizer, knowledge=texts).knowledge_ids) >= target_tokens:
            return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--knowledge-tokens", type=int, default=3000)
    ap.add_argument("--user-tokens", type=int, default=500)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from kvmem.kv import KVStoreConfig, PromptLayout, TieredKVStore
    from kvmem.kv.blocks import BlockBuilder
    from kvmem.models import load_model

    handle = load_model(args.model)
    tok = handle.tokenizer
    knowledge = knowledge_for(PromptLayout, tok, args.knowledge_tokens)
    layout = PromptLayout(tok, knowledge=knowledge)
    k = len(layout.knowledge_ids)
    plain = PromptLayout(tok)
    users = {f"user{u}": memories_for(plain, args.user_tokens, seed=u) for u in range(args.users)}

    def store_at(d: Path) -> TieredKVStore:
        return TieredKVStore(KVStoreConfig(directory=str(d)), handle.fingerprint)

    with tempfile.TemporaryDirectory(prefix="kvmem-knowledge-") as tmp:
        shared_dir, full_dir = Path(tmp) / "shared", Path(tmp) / "full"
        shared = BlockBuilder(handle, layout, store_at(shared_dir))
        full = BlockBuilder(handle, layout, store_at(full_dir), share_knowledge=False)
        blocks = {}
        for user, texts in users.items():
            ids = [f"{user}-m{i}" for i in range(len(texts))]
            blocks[user] = (shared.build(user, texts, ids), full.build(user, texts, ids), texts)
        bytes_shared, bytes_full = dir_bytes(shared_dir), dir_bytes(full_dir)

        user = next(iter(users))
        child, whole, texts = blocks[user]
        messages = query_for(layout, texts, 16, seed=7)
        prompt = list(layout.prompt(texts, [], messages).ids)
        from kvmem.kv import Sampling, generate

        joined = store_at(shared_dir).get(child.item_id)
        ours = list(generate(handle.model, prompt, item=joined, sampling=Sampling(max_new_tokens=16)))
        identical = ours == reference_tokens(handle.model, prompt, 16, "cpu")

        arms: dict[str, list[float]] = {
            "cold_child": [],
            "cold_child_parent_resident": [],
            "cold_full": [],
            "warm": [],
            "direct": [],
        }
        parent_id = joined.meta.parent_id
        warm_store = store_at(shared_dir)
        warm_item = warm_store.get(child.item_id)
        for _ in range(args.repeats):
            arms["cold_child"].append(first_token_s(handle.model, prompt, child, store_at(shared_dir), "cpu"))
            parent_warm = store_at(shared_dir)
            parent_warm.get(parent_id)  # another user's first request already brought the knowledge in
            arms["cold_child_parent_resident"].append(
                first_token_s(handle.model, prompt, child, parent_warm, "cpu")
            )
            arms["cold_full"].append(first_token_s(handle.model, prompt, whole, store_at(full_dir), "cpu"))
            arms["warm"].append(first_token_s(handle.model, prompt, warm_item, warm_store, "cpu"))
            arms["direct"].append(first_token_s(handle.model, prompt, None, None, "cpu"))

    result = {
        "env": env_info("cpu"),
        "loadavg_after": list(os.getloadavg()),
        "model": args.model or "default",
        "knowledge_tokens": k,
        "user_block_tokens": child.num_tokens - k,
        "prompt_tokens": len(prompt),
        "users": args.users,
        "identical": identical,
        "bytes_with_parent": bytes_shared,
        "bytes_without_parent": bytes_full,
        "bytes_ratio": round(bytes_shared / bytes_full, 3),
        "ttft_s": {name: round(median(v), 4) for name, v in arms.items()},
        "ttft_runs_s": {name: [round(x, 4) for x in v] for name, v in arms.items()},
    }
    print_table(["arm", "TTFT s (median)"], [[name, result["ttft_s"][name]] for name in arms])
    print_table(
        ["users", "knowledge tok", "user tok", "MB with parent", "MB without", "identical"],
        [[args.users, k, result["user_block_tokens"], bytes_shared / 1e6, bytes_full / 1e6, identical]],
    )
    write_outputs(result, args.out)


if __name__ == "__main__":
    main()

"""Parametric memory that generalises: a user's facts are distilled into a LoRA by the production job
(scheduler.distill.job.distill_user, with or without augment.py's augmentation), then asked the held-out
paraphrases of benchmarks/data/distill_paraphrases/heldout.json (written by hand before the augmentation
templates, disjoint from every training, validation and gate prompt), greedily, in the serving layout: the
facts the adapter is served for (its gates passed) are not in the prompt, the others are in the block under it,
as the server does. A control user (the base model, no adapter, no memory) is asked the same questions.

    python -m benchmarks.memory.distill_paraphrase --out benchmarks/results/cpu/distill_paraphrase.json
    python -m benchmarks.memory.distill_paraphrase --no-augment \\
        --out benchmarks/results/cpu/distill_paraphrase_noaug.json
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import env_info, write_outputs

HELDOUT = Path(__file__).resolve().parents[1] / "data" / "distill_paraphrases" / "heldout.json"


def load_heldout(path: Path = HELDOUT) -> dict:
    """The held-out set, checked against its committed sha256 (it is never edited to fit a result)."""
    raw = path.read_bytes()
    sealed = Path(str(path) + ".sha256").read_text().split()[0]
    if hashlib.sha256(raw).hexdigest() != sealed:
        raise ValueError(f"{path}: sha256 differs from {path.name}.sha256 (the held-out set was edited)")
    return json.loads(raw)


def _peft_model(handle, registry, manifest):
    import peft

    loaded = registry.load(manifest, handle.fingerprint.digest)
    lora = peft.LoraConfig(**{k: loaded.config[k] for k in ("r", "lora_alpha", "target_modules")})
    model = peft.get_peft_model(copy.deepcopy(handle.model), lora).eval()
    peft.set_peft_model_state_dict(model, loaded.state)
    return model


def run(handle, args, heldout: dict) -> dict:
    from kvmem.adapters import AdapterRegistry
    from kvmem.kv.layout import PromptLayout
    from kvmem.text import HashEmbedder, MemoryStore
    from scheduler.distill.answers import chat_ids, greedy_text
    from scheduler.distill.data import recalled
    from scheduler.distill.job import DistillConfig, distill_user
    from scheduler.distill.train import TrainConfig

    texts = heldout["facts"]
    layout = PromptLayout(handle.tokenizer)
    config = DistillConfig(
        train=TrainConfig(
            max_steps=args.max_steps, eval_every=args.eval_every, seed=args.seed, num_threads=args.threads
        ),
        augment=args.augment,
    )
    n_tok = config.gates.answer_tokens
    with tempfile.TemporaryDirectory() as tmp:
        store = MemoryStore(Path(tmp) / "memories.sqlite", embedder=HashEmbedder())
        ids = [store.add("alice", text=t)[0].id for t in texts]
        started = time.perf_counter()
        outcome = distill_user(
            "alice",
            store=store,
            registry=AdapterRegistry(Path(tmp) / "adapters"),
            handle=handle,
            layout=layout,
            stats={},
            now=time.time(),
            config=config,
            every=True,
        )
        job_s = time.perf_counter() - started
        store.close()
        model = _peft_model(handle, AdapterRegistry(Path(tmp) / "adapters"), outcome.manifest)
    served = set(outcome.manifest.served_memory_ids) if outcome.activated else set()
    unserved = [t for t, i in zip(texts, ids, strict=True) if i not in served]
    rows = []
    with torch.inference_mode():
        for q in heldout["questions"]:
            adapter_reply = greedy_text(
                model, handle.tokenizer, chat_ids(layout, unserved, q["question"]), n_tok
            )
            with model.disable_adapter():  # the control user: base model, no adapter, no memory
                control_reply = greedy_text(
                    model, handle.tokenizer, chat_ids(layout, [], q["question"]), n_tok
                )
            rows.append(
                {
                    **q,
                    "served": ids[q["fact"]] in served,
                    "adapter_reply": adapter_reply,
                    "adapter_answers": recalled(adapter_reply, q["answer"]),
                    "control_reply": control_reply,
                    "control_answers": recalled(control_reply, q["answer"]),
                }
            )
    g = outcome.gates
    return {
        "augment": args.augment,
        "activated": outcome.activated,
        "reason": outcome.reason,
        "num_facts_served": len(served),
        "gates": None if g is None else g.figures(),
        "train": outcome.manifest.train,
        "job_s": round(job_s, 1),
        # the target: answered by the adapter AND served for (its fact left the prompt)
        "num_answered_served": sum(r["adapter_answers"] and r["served"] for r in rows),
        "num_answered": sum(r["adapter_answers"] for r in rows),
        "num_control_answered": sum(r["control_answers"] for r in rows),
        "num_questions": len(rows),
        "questions": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--no-augment", dest="augment", action="store_false")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout", default=str(HELDOUT))
    p.add_argument("--out", default="benchmarks/results/cpu/distill_paraphrase.json")
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from kvmem.models import load_model

    torch.set_num_threads(args.threads)
    env = env_info("cpu")
    handle = load_model(args.model, device="cpu", dtype="float32")
    result = {"env": env, "model": handle.model_id, "args": vars(args)}
    result.update(run(handle, args, load_heldout(Path(args.heldout))))
    result["env"]["loadavg_end"] = list(os.getloadavg())
    for r in result["questions"]:
        print(f"{r['served']!s:5} {r['adapter_answers']!s:5} {r['control_answers']!s:5} {r['question']}")
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""Parametric memory: N synthetic user facts distilled into a LoRA on the default model, through the production
job (scheduler.distill.job.distill_user over a plaintext store and the adapter registry), for N in --sizes.

Per size: training time, the three recalls on held-out gate questions (in context / adapter / base), damage on
generic prompts (mean token KL, greedy agreement), the facts the adapter is served for (every gate question
answered), prompt tokens saved per request, and TTFT (prefill + first token, median of --reps) of one question
with the facts as an adapter (the facts it is not served for in a KV block under it, as the server does) vs as
an injected KV prefix vs as text.
Each size is written to --out as soon as it finishes, so a run stopped early keeps what it measured.

    python -m benchmarks.memory.distill --sizes 5 20 50 --out benchmarks/results/cpu/distill.json
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import OthersCpu, env_info, median, print_table, write_outputs

_SUBJECTS = (
    "favourite colour", "favourite fruit", "favourite season", "favourite sport", "favourite drink",
    "favourite flower", "favourite bird", "favourite tree", "favourite metal", "favourite planet",
    "favourite number", "favourite author", "favourite painter", "favourite river", "favourite island",
    "favourite dessert", "favourite cheese", "favourite spice", "favourite board game", "favourite holiday",
    "lucky charm", "middle name", "car brand", "home town", "bank", "gym", "dentist", "barber", "bakery",
    "school", "street", "team", "band", "podcast", "newspaper", "airline", "phone brand", "laptop brand",
    "guitar brand", "bicycle brand", "shoe brand", "coffee shop", "tea", "soup", "pasta", "bread", "hat",
    "scarf", "umbrella", "pen",
)  # fmt: skip
_ANSWERS = (
    "Zorvath", "Mellick", "Quintara", "Bravosk", "Tellumin", "Ostravel", "Kindrell", "Pavolux", "Jastreme",
    "Ulmberg", "Farnsley", "Crovani", "Dwindal", "Esquarel", "Gorlitz", "Hampwell", "Ixtanor", "Lubrecht",
    "Morvenna", "Nestrova", "Orlimar", "Prevanda", "Quorrell", "Rastvik", "Sollenby", "Trevisca", "Umbrano",
    "Valdrezi", "Wexmoor", "Yarrowick", "Zentaro", "Abelluna", "Brisquet", "Caldorin", "Delvanti",
    "Emberlyn", "Fiorvale", "Galtrane", "Hestmoor", "Iveldra", "Jorvenko", "Kelvaris", "Lomtaree",
    "Marquelle", "Norvindal", "Ostrigan", "Pellwyn", "Quistaro", "Rovantis", "Strellborg",
)  # fmt: skip


def synthetic_facts(n: int, seed: int = 0) -> list[str]:
    """n facts "My <subject> is <made-up word>.": answers no model knows, so recall shows what was learned."""
    assert n <= len(_SUBJECTS), n
    rng = random.Random(seed)
    answers = rng.sample(_ANSWERS, n)
    return [f"My {s} is {a}." for s, a in zip(_SUBJECTS[:n], answers, strict=True)]


def _ttft(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


@torch.inference_mode()
def ttft_arms(
    peft_model, layout, texts: list[str], question: str, reps: int, unserved: list[str] = ()
) -> dict[str, float]:
    """Prefill + first token of `question`: with the adapter and, as the server does, the facts it is not served
    for (`unserved`) as a KV block built under it (none: no block); the facts' block as a KV prefix computed
    beforehand (the suffix prefilled over a copy made before the timer); the facts as text."""
    msgs = [{"role": "user", "content": question}]
    rest = layout.prompt(list(unserved), [], msgs)
    bare, rest_len = list(rest.ids), rest.block_len
    full = layout.prompt(texts, [], msgs)
    ids, block_len = list(full.ids), full.block_len

    def first(model, prompt_ids, past=None, start=0):
        out = model(
            input_ids=torch.tensor([prompt_ids[start:]]),
            past_key_values=past,
            use_cache=True,
            logits_to_keep=1,
        )
        return int(out.logits[0, -1].argmax())

    with peft_model.disable_adapter():
        block = peft_model(input_ids=torch.tensor([ids[:block_len]]), use_cache=True).past_key_values
        copies = [copy.deepcopy(block) for _ in range(reps + 1)]
        first(peft_model, ids)  # warm-up
        text_s = _ttft(lambda: first(peft_model, ids), reps)
        kv_s = _ttft(lambda: first(peft_model, ids, copies.pop(), block_len), reps)
    if rest_len:
        rest_block = peft_model(input_ids=torch.tensor([bare[:rest_len]]), use_cache=True).past_key_values
        rest_copies = [copy.deepcopy(rest_block) for _ in range(reps + 1)]
        first(peft_model, bare, rest_copies.pop(), rest_len)
        adapter_s = _ttft(lambda: first(peft_model, bare, rest_copies.pop(), rest_len), reps)
    else:
        first(peft_model, bare)
        adapter_s = _ttft(lambda: first(peft_model, bare), reps)
    return {
        "ttft_adapter_s": adapter_s,
        "ttft_kv_s": kv_s,
        "ttft_text_s": text_s,
        "prompt_tokens_adapter": len(bare),
        "prompt_tokens_text": len(ids),
    }


def run_size(n: int, handle, args) -> dict:
    from kvmem.adapters import AdapterRegistry
    from kvmem.kv.layout import PromptLayout
    from kvmem.text import HashEmbedder, MemoryStore
    from scheduler.distill.job import DistillConfig, distill_user
    from scheduler.distill.selection import SelectConfig
    from scheduler.distill.train import TrainConfig

    texts = synthetic_facts(n, args.seed)
    layout = PromptLayout(handle.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        store = MemoryStore(Path(tmp) / "memories.sqlite", embedder=HashEmbedder())
        for t in texts:
            store.add("bench", text=t)
        config = DistillConfig(
            select=SelectConfig(max_facts=n),
            train=TrainConfig(
                max_steps=args.max_steps,
                seed=args.seed,
                num_threads=args.threads,
                **({} if args.eval_every is None else {"eval_every": args.eval_every}),
            ),
        )
        others = OthersCpu()
        others.start()
        started = time.perf_counter()
        outcome = distill_user(
            "bench",
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
        registry = AdapterRegistry(Path(tmp) / "adapters")
        loaded = registry.load(outcome.manifest, handle.fingerprint.digest)
    import peft

    lora = peft.LoraConfig(**{k: loaded.config[k] for k in ("r", "lora_alpha", "target_modules")})
    peft_model = peft.get_peft_model(copy.deepcopy(handle.model), lora).eval()
    peft.set_peft_model_state_dict(peft_model, loaded.state)
    question = f"What is my {_SUBJECTS[0]}?"
    served = set(outcome.manifest.served_memory_ids)
    held = {f.memory_id: f.text for f in outcome.selection.facts}
    unserved = [t for t in texts if t not in {held[i] for i in served}]
    ttft = ttft_arms(peft_model, layout, texts, question, args.reps, unserved)
    g = outcome.gates
    return {
        "num_facts": n,
        "train_s": round(outcome.train_s, 1),
        "job_s": round(job_s, 1),
        "steps": outcome.manifest.train.get("steps"),
        "best_step": outcome.manifest.train.get("best_step"),
        "stopped": outcome.manifest.train.get("stopped"),
        "valid_recall": outcome.manifest.train.get("valid_recall"),
        # 2: the first adapter failed only the damage gate and was trained again with a stronger replay
        "attempts": outcome.manifest.train.get("attempts"),
        "first_attempt": outcome.manifest.train.get("first_attempt"),
        "recall_in_context": g.recall_in_context,
        "recall_adapter": g.recall_adapter,
        "recall_base": g.recall_base,
        "kl_generic": g.kl_generic,
        "greedy_agreement_generic": g.greedy_agreement_generic,
        "confident_wrong_base": g.confident_wrong_base,
        "confident_wrong_adapter": g.confident_wrong_adapter,
        "num_facts_served": len(served),  # from the adapter; the rest in its KV block (TTFT adapter arm)
        "passed": outcome.manifest.passed,
        "reason": outcome.manifest.reason,
        "prompt_tokens_saved": ttft["prompt_tokens_text"] - ttft["prompt_tokens_adapter"],
        **ttft,
        "others_cpu_share": others.share(),
        "loadavg_after": list(os.getloadavg()),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[5, 20, 50])
    p.add_argument("--model", default=None)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=None, help="default: the job's own")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/cpu/distill.json")
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from kvmem.models import load_model

    torch.set_num_threads(args.threads)
    handle = load_model(args.model, device="cpu", dtype="float32")
    result = {"env": env_info("cpu"), "model": handle.model_id, "args": vars(args), "sizes": []}
    for n in args.sizes:
        result["sizes"].append(run_size(n, handle, args))
        result["env"]["loadavg_end"] = list(os.getloadavg())
        write_outputs(result, args.out)  # after every size: a run stopped early keeps what it measured
    cols = [
        "num_facts",
        "train_s",
        "recall_in_context",
        "recall_adapter",
        "recall_base",
        "greedy_agreement_generic",
    ]
    cols += ["kl_generic", "confident_wrong_base", "confident_wrong_adapter", "num_facts_served"]
    cols += ["prompt_tokens_saved"]
    cols += ["ttft_adapter_s", "ttft_kv_s", "ttft_text_s", "passed"]
    print_table(cols, [[row[c] for c in cols] for row in result["sizes"]])
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

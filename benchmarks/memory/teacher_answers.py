"""How often the distillation teacher (the base model with every fact in its memory block, as train.py scores it)
puts its most likely token at a fact's answer on another token: per sealed set and relation, over the relation's
training questions (data.RELATIONS' train_questions, replied with data.fact_reply), the teacher's probability of
the answer's first token and how many times its top token is another. A teacher that is wrong there teaches the
facts' confusion through the KL term (b8171da left the answer's tokens to cross-entropy for that; reverted: refused on a
sealed set, docs/benchmarks.md).

    python -m benchmarks.memory.teacher_answers --out benchmarks/results/cpu/teacher_answers.json
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import env_info, write_outputs
from benchmarks.memory.distill_paraphrase import HELDOUT, load_heldout

SETS = ("heldout_v3.json", "heldout_v4.json", "heldout_v5.json")


def _first_answer_token(tokenizer, reply: list[int], answer: str) -> int:
    """The index of the reply token where the answer starts."""
    for k in range(len(reply)):
        if tokenizer.decode(reply[k:]).lstrip().lower().startswith(answer.lower()):
            return k
    raise ValueError(f"{answer!r} is not in the reply {tokenizer.decode(reply)!r}")


@torch.no_grad()
def probe(handle, texts: list[str], block: str) -> list[dict]:
    """Per fact: mean teacher probability of the answer's first token, and questions whose top token is another;
    `block` "all" (every fact, as training does) or "own" (the fact alone)."""
    from kvmem.kv.layout import PromptLayout
    from scheduler.distill.answers import chat_ids, reply_ids
    from scheduler.distill.data import RELATIONS, _fill, fact_reply, parse_fact

    layout, tok = PromptLayout(handle.tokenizer), handle.tokenizer
    facts = sorted((parse_fact(f"m{i}", 1, t) for i, t in enumerate(texts)), key=lambda f: f.text)
    rows = []
    for f in facts:
        probs, wrong = [], 0
        questions = RELATIONS[f.relation].train_questions
        for i, q in enumerate(questions):
            reply = reply_ids(tok, fact_reply(f, i))
            k = _first_answer_token(tok, reply, f.answer)
            ids = chat_ids(layout, [t.text for t in facts] if block == "all" else [f.text], _fill(q, f))
            logits = handle.model(input_ids=torch.tensor([ids + reply[:k]])).logits[0, -1].float()
            p = torch.softmax(logits, -1)
            probs.append(float(p[reply[k]]))
            wrong += int(int(p.argmax()) != reply[k])
        rows.append(
            {
                "fact": f.text,
                "relation": f.relation,
                "block": block,
                "questions": len(questions),
                "mean_p_answer": sum(probs) / len(probs),
                "top_token_other": wrong,
            }
        )
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--sets", nargs="+", default=list(SETS))
    p.add_argument("--out", default="benchmarks/results/cpu/teacher_answers.json")
    args = p.parse_args(argv)
    from kvmem.models import load_model

    torch.set_num_threads(1)
    handle = load_model(args.model, device="cpu", dtype="float32")
    result = {"env": env_info("cpu"), "model": handle.model_id, "args": vars(args), "sets": {}}
    for name in args.sets:
        texts = load_heldout(HELDOUT.parent / name)["facts"]
        rows = probe(handle, texts, "all") + probe(handle, texts, "own")
        result["sets"][name] = rows
        for r in rows:
            print(
                f"{name} {r['block']:4} {r['relation']:9} p={r['mean_p_answer']:.3f} other={r['top_token_other']}"
            )
    every = [r for rows in result["sets"].values() for r in rows if r["block"] == "all"]
    result["all_block_top_token_other"] = sum(r["top_token_other"] for r in every)
    result["all_block_questions"] = sum(r["questions"] for r in every)
    print(
        f"every fact in the block: top token another in {result['all_block_top_token_other']} of "
        f"{result['all_block_questions']}"
    )
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""A model's greedy answers to a user's questions in the serving layout, and how many recall a fact or decline.

Owns the prompt and reply ids of one question (the serving layout, with or without memory texts in the
block) and the greedy measures training's validation and the gates share (recall, not declined). Knows
nothing of training, LoRA or the gates' thresholds.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.distill.data import Example, declines, recalled


def reply_ids(tokenizer, reply: str) -> list[int]:
    """The reply's ids as the chat template ends an assistant turn (its end-of-turn token)."""
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return ids + ([eos] if eos is not None else [])


def chat_ids(layout, fact_texts: Sequence[str], question: str) -> list[int]:
    """The serving layout of one user question, with these memory texts in the block."""
    return list(layout.prompt(list(fact_texts), [], [{"role": "user", "content": question}]).ids)


def greedy_ids(model, tokenizer, ids: Sequence[int], max_new_tokens: int = 24) -> list[int]:
    """The model's greedy reply, as ids, ending with its stop token when it stopped before the limit."""
    from kvmem.kv import Sampling, eos_token_ids, generate

    stop = eos_token_ids(model, tokenizer)
    out = []
    for t in generate(
        model, list(ids), sampling=Sampling(max_new_tokens=max_new_tokens), stop_token_ids=stop
    ):
        out.append(t)
        if t in stop:
            break
    return out


def greedy_text(model, tokenizer, ids: Sequence[int], max_new_tokens: int = 24) -> str:
    from kvmem.kv import eos_token_ids

    stop = eos_token_ids(model, tokenizer)
    out = greedy_ids(model, tokenizer, ids, max_new_tokens)
    return tokenizer.decode([t for t in out if t not in stop], skip_special_tokens=True)


def recall_hits(
    model, tokenizer, layout, questions: Sequence[Example], fact_texts: Sequence[str], max_new_tokens: int
) -> list[bool]:
    """Per question: whether its greedy answer (these memory texts in the prompt) contains the fact's answer."""
    return [
        recalled(
            greedy_text(model, tokenizer, chat_ids(layout, fact_texts, ex.question), max_new_tokens),
            ex.answer or "",
        )
        for ex in questions
    ]


def recall(
    model, tokenizer, layout, questions: Sequence[Example], fact_texts: Sequence[str], max_new_tokens: int
) -> float:
    """Share of `questions` whose greedy answer (these memory texts in the prompt) contains the fact's answer."""
    hits = recall_hits(model, tokenizer, layout, questions, fact_texts, max_new_tokens)
    return sum(hits) / len(hits) if hits else 0.0


def not_declined(model, tokenizer, layout, questions: Sequence[Example], max_new_tokens: int) -> int:
    """How many of `questions` (no memory in the prompt) get a greedy reply that does not decline."""
    return sum(
        not declines(greedy_text(model, tokenizer, chat_ids(layout, [], q.question), max_new_tokens))
        for q in questions
    )

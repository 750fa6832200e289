"""The gates an adapter must pass before it is served, measured on questions from templates and a seed that
training never used (data.gate_questions):

- recall: with the adapter and NO memory in the prompt, at least `min_recall_ratio` of the recall the base
  model has with the facts in its prompt, and above 0; the base model's recall without them is reported, not
  gated. An adapter is served only for the facts whose every gate question it answered (`served_ids`: they
  leave the prompt); the others stay in KV/text, so a fact it half learned is never lost. One that fully
  answers no fact is refused;
- damage: on a fixed set of generic prompts, the base model's greedy continuation is scored under both:
  mean token KL(base || adapter) (reported; gated when `max_kl` is set) and greedy agreement >= `min_agreement`;
- hallucination: on questions no fact answers, no more confident non-refusals with the adapter than the
  base model gives without the facts.

Knows nothing of registries or stores: a model with a peft adapter in, a report out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from scheduler.distill.answers import chat_ids, greedy_text, recall, recall_hits
from scheduler.distill.data import Example, declines

GENERIC_GATE = (
    "What is the capital of France?",
    "Write a short poem about autumn.",
    "How do plants make food?",
    "What is two plus three?",
    "Give me three words that rhyme with cat.",
    "Why do we need sleep?",
    "Describe a bicycle in one sentence.",
    "What is the opposite of hot?",
)


@dataclass(frozen=True)
class GateConfig:
    min_recall_ratio: float = 0.9
    min_agreement: float = 0.9
    max_kl: float | None = None
    generic_tokens: int = 24
    answer_tokens: int = 20  # greedy tokens per answer (recall and unanswerable questions)
    confident_prob: float = 0.5  # mean probability of its tokens above which a reply is "confident"

    def __post_init__(self) -> None:
        for name in ("min_recall_ratio", "min_agreement", "confident_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"GateConfig.{name} must be in [0, 1], got {getattr(self, name)!r}")


@dataclass(frozen=True)
class GateReport:
    recall_in_context: float
    recall_adapter: float
    recall_base: float
    greedy_agreement_generic: float
    kl_generic: float
    confident_wrong_adapter: int
    confident_wrong_base: int
    num_questions: int
    passed: bool
    reason: str  # "" when passed, else every failed gate
    served_ids: tuple[str, ...] = ()  # the facts whose every gate question the adapter answered
    failed: tuple[str, ...] = ()  # the gates that failed: "recall", "damage", "hallucination"

    @property
    def only_damage_failed(self) -> bool:
        """It learned facts it can be served for and does not make things up; only the generic prompts moved."""
        return self.failed == ("damage",)

    def figures(self) -> dict[str, float]:
        skip = ("passed", "reason", "served_ids", "failed")
        return {k: float(v) for k, v in asdict(self).items() if k not in skip} | {
            "num_facts_served": float(len(self.served_ids))
        }


def fully_recalled(questions: Sequence[Example], hits: Sequence[bool]) -> tuple[str, ...]:
    """The memory ids whose every question in `questions` is a hit, in the order they first appear."""
    ok: dict[str, bool] = {}
    for q, hit in zip(questions, hits, strict=True):
        if q.memory_id is not None:
            ok[q.memory_id] = ok.get(q.memory_id, True) and bool(hit)
    return tuple(m for m, all_hit in ok.items() if all_hit)


@dataclass(frozen=True)
class BaseFigures:
    """What the gates measure on the base model alone (its adapter disabled). It is the same for every adapter
    trained on the same facts and gated with the same questions, so a job measures it once (`base_figures`)
    and gates each attempt, and each scale of one, against it."""

    recall_in_context: float
    recall_base: float
    confident_wrong_base: int
    # each generic prompt's ids and the base model's greedy continuation of it (ids, re-tokenized from its text)
    generic: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


@torch.no_grad()
def base_figures(
    peft_model,
    tokenizer,
    layout,
    fact_texts: Sequence[str],
    questions: Sequence[Example],
    unanswerable: Sequence[Example],
    config: GateConfig,
) -> BaseFigures:
    """The base model's side of every gate (`peft_model` with its adapter disabled)."""
    peft_model.eval()
    n = config.answer_tokens
    with peft_model.disable_adapter():
        in_context = recall(peft_model, tokenizer, layout, questions, fact_texts, n)
        base = recall(peft_model, tokenizer, layout, questions, [], n)
        wrong_base = _confident_wrong(peft_model, tokenizer, layout, unanswerable, config.confident_prob, n)
        generic = []
        for prompt in GENERIC_GATE:
            ids = chat_ids(layout, [], prompt)
            text = greedy_text(peft_model, tokenizer, ids, config.generic_tokens)
            cont = tokenizer(text, add_special_tokens=False)["input_ids"][: config.generic_tokens]
            if cont:
                generic.append((tuple(ids), tuple(cont)))
    return BaseFigures(in_context, base, wrong_base, tuple(generic))


@torch.no_grad()
def _damage(peft_model, generic: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[float, float]:
    """(mean token KL(base || adapter), greedy agreement) over the base model's greedy continuations."""
    kls, agree, count = 0.0, 0, 0
    for ids, cont in generic:
        full = torch.tensor([list(ids) + list(cont)])
        with peft_model.disable_adapter():
            base = torch.log_softmax(peft_model(input_ids=full).logits[0, len(ids) - 1 : -1].float(), -1)
        tuned = torch.log_softmax(peft_model(input_ids=full).logits[0, len(ids) - 1 : -1].float(), -1)
        kls += float((base.exp() * (base - tuned)).sum())
        agree += int((base.argmax(-1) == tuned.argmax(-1)).sum())
        count += len(cont)
    return (kls / count, agree / count) if count else (0.0, 1.0)


@torch.no_grad()
def _confident_wrong(
    model, tokenizer, layout, questions: Sequence[Example], threshold: float, n_tok: int
) -> int:
    """Replies to unanswerable questions that do not decline and whose tokens are, on average, likely."""
    n = 0
    for q in questions:
        ids = chat_ids(layout, [], q.question)
        text = greedy_text(model, tokenizer, ids, n_tok)
        if declines(text):
            continue
        reply = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not reply:
            continue
        logits = model(input_ids=torch.tensor([ids + reply])).logits[0, len(ids) - 1 : -1].float()
        probs = torch.softmax(logits, -1).gather(-1, torch.tensor(reply)[:, None])[:, 0]
        n += int(float(probs.mean()) >= threshold)
    return n


def run_gates(
    peft_model,
    tokenizer,
    layout,
    fact_texts: Sequence[str],
    questions: Sequence[Example],
    unanswerable: Sequence[Example],
    config: GateConfig,
    base: BaseFigures | None = None,
) -> GateReport:
    """Every gate on `peft_model` (its adapter active; `disable_adapter()` gives the base model). `base`: the
    base model's figures for these same facts, questions and config, measured here when None."""
    if base is None:
        base = base_figures(peft_model, tokenizer, layout, fact_texts, questions, unanswerable, config)
    peft_model.eval()
    n = config.answer_tokens
    in_context, wrong_base = base.recall_in_context, base.confident_wrong_base
    hits = recall_hits(peft_model, tokenizer, layout, questions, [], n)
    adapter = sum(hits) / len(hits) if hits else 0.0
    served = fully_recalled(questions, hits)
    wrong_adapter = _confident_wrong(peft_model, tokenizer, layout, unanswerable, config.confident_prob, n)
    kl, agreement = _damage(peft_model, base.generic)
    # each gate's failures, in the order they are reported
    gates: dict[str, list[str]] = {"recall": [], "damage": [], "hallucination": []}
    if adapter == 0:
        gates["recall"].append("the adapter recalls none of the facts")
    elif not served:  # it is served only for the facts it fully recalled: none, nothing to serve it for
        gates["recall"].append("the adapter answers every gate question of none of its facts")
    elif adapter < config.min_recall_ratio * in_context:
        gates["recall"].append(
            f"recall with the adapter {adapter:.2f} < {config.min_recall_ratio:.2f} x in-context recall "
            f"{in_context:.2f}"
        )
    if agreement < config.min_agreement:
        gates["damage"].append(
            f"greedy agreement on generic prompts {agreement:.3f} < {config.min_agreement:.2f}"
        )
    if config.max_kl is not None and kl > config.max_kl:
        gates["damage"].append(f"mean token KL on generic prompts {kl:.4f} > {config.max_kl}")
    if wrong_adapter > wrong_base:
        gates["hallucination"].append(
            f"confident answers to unanswerable questions rose from {wrong_base} to {wrong_adapter}"
        )
    reasons = [r for rs in gates.values() for r in rs]
    return GateReport(
        recall_in_context=in_context,
        recall_adapter=adapter,
        recall_base=base.recall_base,
        greedy_agreement_generic=agreement,
        kl_generic=kl,
        confident_wrong_adapter=wrong_adapter,
        confident_wrong_base=wrong_base,
        num_questions=len(questions),
        passed=not reasons,
        reason="; ".join(reasons),
        served_ids=served,
        failed=tuple(g for g, rs in gates.items() if rs),
    )

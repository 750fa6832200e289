"""Training a user's LoRA adapter by prompt distillation: the student (base + LoRA, the facts NOT in its prompt)
learns to match the base model WITH the facts in its prompt (the serving layout's memory block), token by
token (KL over the teacher's top-k), plus a replay term: KL to the base model on generic prompts, so what the
adapter does not need to change stays as it was.

LoRA on every linear layer, alpha = 2r (Biderman et al.); seeded; early stopping once the training questions
are recalled as well as the teacher recalls them, or once the loss stops falling. Trains a deep copy: the
caller's model is never modified. Runs in whatever thread calls it, with `num_threads` torch threads: the
scheduler calls it off the request path. Knows nothing of stores, registries or gates.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from scheduler.distill_data import Example, Fact, recalled

log = logging.getLogger(__name__)

# Generic prompts for the replay term (the gate's damage set is another list: distill_gates.GENERIC_GATE).
GENERIC_TRAIN = (
    "What is the capital of Italy?",
    "Give me a tip for sleeping better.",
    "Explain what a noun is.",
    "How many days are in a week?",
    "Write one sentence about the sea.",
    "What colour is the sky on a clear day?",
    "Name a fruit that is yellow.",
    "How do I boil an egg?",
)


@dataclass(frozen=True)
class TrainConfig:
    rank: int = 8
    lr: float = 1e-3
    max_steps: int = 200
    batch_size: int = 8
    replay_batch_size: int = 2
    replay_weight: float = 0.5
    replay_tokens: int = 24  # base-model continuation scored per generic prompt
    top_k: int = 64  # teacher distribution kept per position
    eval_every: int = 25
    answer_tokens: int = 12  # greedy tokens per answer when recall is measured
    patience: int = 3  # evaluations without a 2% loss improvement before stopping
    num_threads: int | None = (
        1  # torch threads in the training thread (1: deterministic, leaves cores to serving)
    )
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "rank",
            "max_steps",
            "batch_size",
            "top_k",
            "eval_every",
            "patience",
            "replay_tokens",
            "answer_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr!r}")
        if self.replay_weight < 0:
            raise ValueError(f"TrainConfig.replay_weight must be >= 0, got {self.replay_weight!r}")

    @property
    def alpha(self) -> int:
        return 2 * self.rank


@dataclass
class _Seq:
    """One scored sequence: the student's ids, and the teacher's top-k log-probs for its last `n` tokens."""

    ids: list[int]
    n: int  # the reply tokens (scored positions are the n predicting them)
    top_logp: torch.Tensor  # [n, k]
    top_idx: torch.Tensor  # [n, k]


@dataclass
class TrainResult:
    model: Any  # the trained peft model (a copy of the base with its LoRA); adapter name "default"
    steps: int
    train_s: float
    stopped: str  # "recalled" | "plateau" | "max_steps"
    losses: list[float] = field(default_factory=list)  # mean loss per evaluation window
    train_recall: float = 0.0
    teacher_recall: float = 0.0


def reply_ids(tokenizer, reply: str) -> list[int]:
    """The reply's ids as the chat template ends an assistant turn (its end-of-turn token)."""
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return ids + ([eos] if eos is not None else [])


def chat_ids(layout, fact_texts: Sequence[str], question: str) -> list[int]:
    """The serving layout of one user question, with these memory texts in the block."""
    return list(layout.prompt(list(fact_texts), [], [{"role": "user", "content": question}]).ids)


@torch.no_grad()
def _top_k(model, ids: list[int], n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's top-k log-probs at the n positions predicting the last n tokens of `ids`."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -n - 1 : -1].float()  # [n, vocab]
    logp = torch.log_softmax(logits, dim=-1)
    values, index = logp.topk(k, dim=-1)
    return values.cpu(), index.cpu()


def _kl(model, batch: list[_Seq]) -> torch.Tensor:
    """Mean over scored tokens of KL(teacher || student), the teacher renormalised over its top-k."""
    device = next(model.parameters()).device
    width = max(len(s.ids) for s in batch)
    pad = 0
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s.ids)] = torch.tensor(s.ids)
        mask[i, : len(s.ids)] = 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()  # [b, t, vocab]
    total, count = logits.new_zeros(()), 0
    for i, s in enumerate(batch):
        end = len(s.ids)
        student = torch.log_softmax(logits[i, end - s.n - 1 : end - 1], dim=-1)  # [n, vocab]
        p_t = torch.softmax(s.top_logp.to(device), dim=-1)  # renormalised over the top-k: [n, k]
        s_k = student.gather(-1, s.top_idx.to(device))  # [n, k]
        total = total + (p_t * (torch.log(p_t.clamp_min(1e-12)) - s_k)).sum()
        count += s.n
    return total / max(count, 1)


def greedy_text(model, tokenizer, ids: Sequence[int], max_new_tokens: int = 24) -> str:
    from kvmem.kv import Sampling, eos_token_ids, generate

    stop = eos_token_ids(model, tokenizer)
    out = [
        t
        for t in generate(
            model, list(ids), sampling=Sampling(max_new_tokens=max_new_tokens), stop_token_ids=stop
        )
    ]
    return tokenizer.decode([t for t in out if t not in stop], skip_special_tokens=True)


def recall(
    model, tokenizer, layout, questions: Sequence[Example], fact_texts: Sequence[str], max_new_tokens: int
) -> float:
    """Share of `questions` whose greedy answer (these memory texts in the prompt) contains the fact's answer."""
    hits = [
        recalled(
            greedy_text(model, tokenizer, chat_ids(layout, fact_texts, ex.question), max_new_tokens),
            ex.answer or "",
        )
        for ex in questions
    ]
    return sum(hits) / len(hits) if hits else 0.0


def train_adapter(
    model: torch.nn.Module,
    tokenizer,
    layout,
    facts: Sequence[Fact],
    examples: Sequence[Example],
    config: TrainConfig,
) -> TrainResult:
    """Distil `facts` into a LoRA on a copy of `model`. `examples` are the training prompts
    (distill_data.training_examples); the teacher sees every fact's text in its block."""
    import peft

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    base = copy.deepcopy(model).eval()
    fact_texts = [f.text for f in facts]

    # teacher distributions, computed once on the base model (no adapter yet)
    distill: list[_Seq] = []
    for ex in examples:
        reply = reply_ids(tokenizer, ex.reply)
        logp, idx = _top_k(base, chat_ids(layout, fact_texts, ex.question) + reply, len(reply), config.top_k)
        distill.append(_Seq(chat_ids(layout, [], ex.question) + reply, len(reply), logp, idx))
    replay: list[_Seq] = []
    for prompt in GENERIC_TRAIN:
        ids = chat_ids(layout, [], prompt)
        cont = tokenizer(greedy_text(base, tokenizer, ids, config.replay_tokens), add_special_tokens=False)[
            "input_ids"
        ][: config.replay_tokens]
        if cont:
            logp, idx = _top_k(base, ids + cont, len(cont), config.top_k)
            replay.append(_Seq(ids + cont, len(cont), logp, idx))
    questions = [ex for ex in examples if ex.kind == "question"]
    teacher_recall = recall(base, tokenizer, layout, questions, fact_texts, config.answer_tokens)
    log.info(
        "distill: %d facts, %d prompts, %d replay prompts; teacher recall %.2f on training questions (%.1f s)",
        len(facts),
        len(distill),
        len(replay),
        teacher_recall,
        time.perf_counter() - started,
    )

    lora = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules="all-linear",
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    student = peft.get_peft_model(base, lora)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    order: list[int] = []
    window: list[float] = []
    losses: list[float] = []
    best, stale, stopped, train_recall, step = float("inf"), 0, "max_steps", 0.0, 0
    for step in range(1, config.max_steps + 1):
        student.train()
        if len(order) < config.batch_size:
            more = list(range(len(distill)))
            rng.shuffle(more)
            order.extend(more)
        batch = [distill[i] for i in order[: config.batch_size]]
        del order[: config.batch_size]
        loss = _kl(student, batch)
        if replay and config.replay_weight > 0:
            loss = loss + config.replay_weight * _kl(
                student, rng.sample(replay, min(config.replay_batch_size, len(replay)))
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        window.append(float(loss.detach()))
        if step % config.eval_every and step != config.max_steps:
            continue
        student.eval()
        mean = sum(window) / len(window)
        losses.append(mean)
        window = []
        train_recall = recall(student, tokenizer, layout, questions, [], config.answer_tokens)
        log.info(
            "distill step %d/%d: loss %.4f, recall %.2f (teacher %.2f), %.1f s",
            step,
            config.max_steps,
            mean,
            train_recall,
            teacher_recall,
            time.perf_counter() - started,
        )
        if questions and train_recall >= teacher_recall and teacher_recall > 0:
            stopped = "recalled"
            break
        if mean < best * 0.98:
            best, stale = mean, 0
        else:
            stale += 1
            if stale >= config.patience:
                stopped = "plateau"
                break
    student.eval()
    return TrainResult(
        model=student,
        steps=step,
        train_s=time.perf_counter() - started,
        stopped=stopped,
        losses=losses,
        train_recall=train_recall,
        teacher_recall=teacher_recall,
    )

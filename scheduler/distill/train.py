"""Training a user's LoRA adapter on its facts (the facts NOT in the student's prompt). Per step, one batch of
three kinds of sequences, each scored token by token:

- fact prompts (questions in several phrasings, both directions, statements; data.training_examples):
  cross-entropy on the gold reply, plus KL to the base model WITH the facts in its prompt (the serving
  layout's memory block) on that reply except at the tokens that spell the answer (answer_free): prompt
  distillation;
- unanswerable questions (about the user, answered by no fact): cross-entropy on, and KL to, the base model's
  own greedy reply without the facts when that reply declines, else cross-entropy on a declining reply; so the
  adapter does not learn to answer, with confidence, what no fact answers;
- replay: KL to the base model on its greedy continuations of generic prompts, so the rest stays as it was.

LoRA on every linear layer, alpha = 2r (Biderman et al.); seeded. Every `eval_every` steps the validation set
(templates disjoint from training AND from the gates: data.valid_questions) is answered greedily; the
LoRA weights of the best validation point are kept, and training stops once every validation question is
recalled with no more non-declining answers to the unanswerable validation questions than the base model
gives at `recalled_evals` evaluations in a row (the latest kept), or once validation stops improving
(StopRule). Trains a deep copy: the caller's model is never modified. Runs in
whatever thread calls it, with `num_threads` torch threads: the scheduler calls it off the request path.
The greedy answers and the recall measures it validates with are answers.py's. Knows nothing of stores,
registries or gates.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from scheduler.distill.answers import chat_ids, greedy_ids, not_declined, recall, reply_ids
from scheduler.distill.answers import greedy_text as greedy_text  # lives in answers.py; re-exported
from scheduler.distill.data import GENERIC_TRAIN, Example, Fact, declines, valid_questions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    rank: int = 8
    lr: float = 2e-3
    max_steps: int = 300
    batch_size: int = 8  # fact prompts per step
    unanswerable_batch_size: int = 2
    replay_batch_size: int = 2
    ce_weight: float = 1.0  # cross-entropy on the gold replies of fact prompts
    kl_weight: float = 0.5  # KL to the in-context teacher on those replies
    unanswerable_weight: float = (
        1.0  # cross-entropy + KL to the base model's own replies, no facts in context
    )
    replay_weight: float = 1.0
    replay_tokens: int = 24  # base-model continuation scored per generic / unanswerable prompt
    top_k: int = 64  # teacher distribution kept per position
    eval_every: int = 10  # the recipe every distill benchmark measured (25 before: the server ran another)
    answer_tokens: int = 20  # greedy tokens per answer when validation recall is measured
    valid_max: int = 24  # validation fact questions at most (a seeded sample)
    patience: int = 4  # evaluations since the best validation score was first reached, before stopping
    # evaluations in a row with every validation question recalled before stopping (the latest is kept): the
    # first such point can be short of other wordings (3 augmented facts, stopped there at step 30: served for
    # 1 of 3 by the gates; after two, at step 40: 2 of 3, greedy agreement 0.914, one confident wrong answer;
    # after three, at step 50: 3 of 3, 0.930, none; benchmarks/memory/distill_paraphrase.py)
    recalled_evals: int = 3
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
            "valid_max",
            "recalled_evals",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr!r}")
        for name in ("ce_weight", "kl_weight", "unanswerable_weight", "replay_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("unanswerable_batch_size", "replay_batch_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def alpha(self) -> int:
        return 2 * self.rank

    def targets_key(self) -> tuple:
        """The fields the base model's targets (`Targets`) depend on; the rest only shape training."""
        return (self.replay_tokens, self.top_k, self.answer_tokens, self.valid_max, self.seed)

    def stronger_replay(self) -> TrainConfig | None:
        """The recipe of a second attempt after only the damage gate failed: twice the replay prompts per step at
        twice the weight (None: no replay term to strengthen). Not the first recipe: on 5 synthetic facts it cost
        recall on the gate's templates (0.4 vs 1.0); on 20 it kept the generic prompts (agreement 0.891 -> 0.922)."""
        if self.replay_batch_size == 0 or self.replay_weight == 0:
            return None
        return replace(
            self, replay_batch_size=2 * self.replay_batch_size, replay_weight=2 * self.replay_weight
        )


@dataclass
class _Seq:
    """One scored sequence: the student's ids, and the teacher's top-k log-probs for its last `n` tokens."""

    ids: list[int]
    n: int  # the reply tokens (scored positions are the n predicting them)
    top_logp: torch.Tensor  # [n, k]
    top_idx: torch.Tensor  # [n, k]
    ce: bool = False  # also cross-entropy on its last n tokens
    kl: bool = True  # KL to the teacher's top-k (False: a target the teacher did not produce)
    kl_mask: torch.Tensor | None = None  # [n]: 1 where the KL applies (None: everywhere)


@dataclass(frozen=True)
class Targets:
    """What training one fact set needs from the base model, computed once (greedy: no randomness) and reused by
    a second attempt: the teacher's top-k on every fact prompt, the unanswerable and replay targets, and the
    validation questions with the number of unanswerable ones the base model does not decline."""

    key: tuple  # (TrainConfig.targets_key(), the fact texts, the examples) they were computed for
    distill: list[_Seq]
    unanswerable: list[_Seq]
    replay: list[_Seq]
    valid_facts: list[Example]
    valid_unans: list[Example]
    base_not_declined: int


@dataclass
class StopRule:
    """When training stops and which evaluation's weights are kept, from the validation figures alone (no
    model): an evaluation is kept when its score is better than every earlier one, or equal to the best with
    every validation question recalled (the latest such point is kept); training stops after `recalled_evals`
    full-recall evaluations in a row ("recalled"), or after `patience` evaluations since the best score was
    first reached ("plateau"). An equal full-recall point is kept but does not restart the patience: with six
    facts validation recall swings between 0.58 and 1.0 from one evaluation to the next, and when it did, an
    adapter trained to max_steps into the damage gate (distill_paraphrase_v2_9c2ebbd.json: 300 steps, refused)."""

    recalled_evals: int
    patience: int
    best_score: float = float("-inf")
    stale: int = 0
    streak: int = 0

    def observe(self, score: float, all_recalled: bool) -> tuple[bool, str | None]:
        """(keep this evaluation's weights, why training stops now or None)."""
        better = score > self.best_score
        keep = better or (all_recalled and score >= self.best_score)
        self.stale = 0 if better else self.stale + 1
        self.best_score = max(self.best_score, score)
        self.streak = self.streak + 1 if all_recalled else 0
        if self.streak >= self.recalled_evals:
            return keep, "recalled"
        return keep, "plateau" if self.stale >= self.patience else None


@dataclass
class TrainResult:
    model: Any  # the trained peft model (a copy of the base with its LoRA); adapter name "default"
    steps: int
    train_s: float
    stopped: str  # "recalled" | "plateau" | "max_steps"
    losses: list[float] = field(default_factory=list)  # mean loss per evaluation window
    valid_recall: float = 0.0  # at the kept (best) evaluation
    best_step: int = 0  # the step whose weights were kept
    targets: Targets | None = None  # the base model's targets it trained on (pass them to a second attempt)


@torch.no_grad()
def _top_k(model, ids: list[int], n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's top-k log-probs at the n positions predicting the last n tokens of `ids`."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device), logits_to_keep=n + 1).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    values, index = logp.topk(k, dim=-1)
    return values.cpu(), index.cpu()


def _loss(model, batch: list[tuple[_Seq, float, float]]) -> torch.Tensor:
    """sum over (seq, kl weight, ce weight) of the weights times the sequence's mean token KL(teacher ||
    student) (the teacher renormalised over its top-k) and mean token cross-entropy on its last n tokens."""
    device = next(model.parameters()).device
    width = max(len(s.ids) for s, _, _ in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (s, _, _) in enumerate(batch):
        ids[i, : len(s.ids)] = torch.tensor(s.ids)
        mask[i, : len(s.ids)] = 1
    # the vocabulary projection only where a reply token is predicted (most positions are the prompt's)
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = causal_lm.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
    total = hidden.new_zeros((), dtype=torch.float32)
    for i, (s, kl_w, ce_w) in enumerate(batch):
        end = len(s.ids)
        logits = causal_lm.lm_head(hidden[i, end - s.n - 1 : end - 1]).float()  # [n, vocab]
        student = torch.log_softmax(logits, dim=-1)
        if kl_w and s.kl:
            p_t = torch.softmax(s.top_logp.to(device), dim=-1)  # renormalised over the top-k: [n, k]
            s_k = student.gather(-1, s.top_idx.to(device))  # [n, k]
            kl = (p_t * (torch.log(p_t.clamp_min(1e-12)) - s_k)).sum(-1)  # [n]
            if s.kl_mask is not None:
                kl = kl * s.kl_mask.to(device)
            total = total + kl_w * kl.sum() / s.n
        if ce_w and s.ce:
            gold = torch.tensor(s.ids[end - s.n :], device=device)[:, None]
            total = total - ce_w * student.gather(-1, gold).mean()
    return total


def _own_reply(model, tokenizer, layout, question: str, config: TrainConfig) -> _Seq | None:
    """The base model's greedy reply to `question` (no memory), with its top-k at every reply token."""
    ids = chat_ids(layout, [], question)
    cont = greedy_ids(model, tokenizer, ids, config.replay_tokens)
    if not cont:
        return None
    logp, idx = _top_k(model, ids + cont, len(cont), config.top_k)
    return _Seq(ids + cont, len(cont), logp, idx, ce=True)


def _declining_reply(model, tokenizer, layout, ex: Example, config: TrainConfig) -> _Seq | None:
    """An unanswerable question's target: the base model's own reply when it declines (cross-entropy and KL
    to it), else the example's declining reply (cross-entropy only), so training on facts does not teach the
    adapter to answer, with confidence, what no fact answers."""
    own = _own_reply(model, tokenizer, layout, ex.question, config)
    if own is not None and declines(tokenizer.decode(own.ids[-own.n :], skip_special_tokens=True)):
        return own
    ids, reply = chat_ids(layout, [], ex.question), reply_ids(tokenizer, ex.reply)
    empty = torch.zeros((len(reply), 1))
    return _Seq(ids + reply, len(reply), empty, empty.long(), ce=True, kl=False)


def answer_free(tokenizer, reply: list[int], answer: str | None) -> torch.Tensor | None:
    """[len(reply)]: 0 at the reply tokens that spell the fact's answer, 1 elsewhere (None: no answer in it). The
    KL to the in-context teacher is not taken there: with every fact in its block, the base model's most likely
    token at the answer is another fact's more often than not (on the third to fifth sealed sets' facts, the
    home town's first token was the teacher's top token in 0 to 7 of 10 training questions, at a mean probability
    0.04-0.14; over every fact, 97 of 180 wrong), so distilling it there teaches the facts' confusion (the
    adapters answered the birthplace's town where the home town was asked); the cross-entropy on the gold reply
    teaches the answer."""
    if not answer:
        return None
    ends = [len(tokenizer.decode(reply[:k])) for k in range(len(reply) + 1)]
    start = tokenizer.decode(reply).lower().find(answer.lower())
    if start < 0:
        return None
    stop = start + len(answer)
    return torch.tensor([0.0 if ends[k] < stop and ends[k + 1] > start else 1.0 for k in range(len(reply))])


def _draw(pool: list, order: list[int], k: int, rng: random.Random) -> list:
    """k items of `pool`, walking seeded shuffles of it (every item once per pass)."""
    out = []
    while pool and len(out) < k:
        if not order:
            order.extend(range(len(pool)))
            rng.shuffle(order)
        out.append(pool[order.pop()])
    return out


def _targets_key(facts: Sequence[Fact], examples: Sequence[Example], config: TrainConfig) -> tuple:
    return (config.targets_key(), tuple(f.text for f in facts), tuple(examples))


def _targets(
    base, tokenizer, layout, facts: Sequence[Fact], examples: Sequence[Example], config: TrainConfig
) -> Targets:
    """The base model's targets for `facts` (its teacher sees every fact's text in its block)."""
    fact_texts = [f.text for f in facts]
    distill: list[_Seq] = []
    unanswerable: list[_Seq] = []
    for ex in examples:
        if ex.kind == "unanswerable":
            seq = _declining_reply(base, tokenizer, layout, ex, config)
            unanswerable.extend([seq] if seq else [])
            continue
        reply = reply_ids(tokenizer, ex.reply)
        logp, idx = _top_k(base, chat_ids(layout, fact_texts, ex.question) + reply, len(reply), config.top_k)
        mask = answer_free(tokenizer, reply, ex.answer)
        distill.append(
            _Seq(chat_ids(layout, [], ex.question) + reply, len(reply), logp, idx, True, True, mask)
        )
    replay = [s for s in (_own_reply(base, tokenizer, layout, p, config) for p in GENERIC_TRAIN) if s]
    valid = valid_questions(facts)
    valid_facts = [q for q in valid if q.answer is not None]
    if len(valid_facts) > config.valid_max:
        valid_facts = random.Random(config.seed).sample(valid_facts, config.valid_max)
    valid_unans = [q for q in valid if q.answer is None]
    return Targets(
        key=_targets_key(facts, examples, config),
        distill=distill,
        unanswerable=unanswerable,
        replay=replay,
        valid_facts=valid_facts,
        valid_unans=valid_unans,
        base_not_declined=not_declined(base, tokenizer, layout, valid_unans, config.answer_tokens),
    )


def train_adapter(
    model: torch.nn.Module,
    tokenizer,
    layout,
    facts: Sequence[Fact],
    examples: Sequence[Example],
    config: TrainConfig,
    targets: Targets | None = None,
) -> TrainResult:
    """Distil `facts` into a LoRA on a copy of `model`. `examples` are the training prompts
    (data.training_examples); the teacher sees every fact's text in its block. `targets`: those of an
    earlier attempt on the same facts and examples (`TrainResult.targets`), not computed again."""
    import peft

    if targets is not None and targets.key != _targets_key(facts, examples, config):
        raise ValueError(
            "train_adapter: the targets were computed for other facts, examples or target settings "
            "(TrainConfig.targets_key)"
        )
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    base = copy.deepcopy(model).eval()
    reused = targets is not None
    if targets is None:  # computed once on the base model (no adapter yet)
        log.info(
            "distill: the base model's targets for %d facts' prompts (the teacher sees the facts); then up to %d "
            "steps, validated every %d",
            len(facts),
            config.max_steps,
            config.eval_every,
        )
        targets = _targets(base, tokenizer, layout, facts, examples, config)
    distill, unanswerable, replay = targets.distill, targets.unanswerable, targets.replay
    valid_facts, valid_unans = targets.valid_facts, targets.valid_unans
    base_not_declined = targets.base_not_declined
    n_tok = config.answer_tokens
    log.info(
        "distill: %d facts, %d prompts, %d unanswerable, %d replay; validation: %d questions, the base model "
        "does not decline %d/%d unanswerable (%.1f s%s)",
        len(facts),
        len(distill),
        len(unanswerable),
        len(replay),
        len(valid_facts),
        base_not_declined,
        len(valid_unans),
        time.perf_counter() - started,
        ", targets of the first attempt" if reused else "",
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
    orders: tuple[list[int], list[int], list[int]] = ([], [], [])
    window: list[float] = []
    losses: list[float] = []
    rule = StopRule(recalled_evals=config.recalled_evals, patience=config.patience)
    best_state, best_step, best_recall, stopped, step = None, 0, 0.0, "max_steps", 0
    for step in range(1, config.max_steps + 1):
        student.train()
        groups = (  # (pool, its walk, how many, kl weight, ce weight)
            (distill, orders[0], config.batch_size, config.kl_weight, config.ce_weight),
            (unanswerable, orders[1], config.unanswerable_batch_size, *(config.unanswerable_weight,) * 2),
            (replay, orders[2], config.replay_batch_size, config.replay_weight, 0.0),
        )
        batch = []
        for pool, order, k, kl_w, ce_w in groups:
            drawn = _draw(pool, order, k, rng)
            batch.extend((s, kl_w / len(drawn), ce_w / len(drawn)) for s in drawn)
        loss = _loss(student, batch)
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
        valid_recall = recall(student, tokenizer, layout, valid_facts, [], n_tok)
        wrong = not_declined(student, tokenizer, layout, valid_unans, n_tok)
        score = valid_recall - max(0, wrong - base_not_declined)
        keep, stop = rule.observe(score, valid_recall >= 1.0 and wrong <= base_not_declined)
        log.info(
            "distill step %d/%d: loss %.4f, validation recall %.2f, not declined %d/%d (base %d), %.1f s",
            step,
            config.max_steps,
            mean,
            valid_recall,
            wrong,
            len(valid_unans),
            base_not_declined,
            time.perf_counter() - started,
        )
        if keep:
            best_step, best_recall = step, valid_recall
            best_state = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(student).items()}
        if stop is not None:
            stopped = stop
            break
    if best_state is not None and best_step != step:
        peft.set_peft_model_state_dict(student, best_state)
    student.eval()
    return TrainResult(
        model=student,
        steps=step,
        train_s=time.perf_counter() - started,
        stopped=stopped,
        losses=losses,
        valid_recall=best_recall,
        best_step=best_step,
        targets=targets,
    )

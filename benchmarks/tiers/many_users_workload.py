"""The many-users workload, as data: users with lognormal memory sizes and Zipf popularity, Poisson arrivals of
multi-round questions, an edit stream of canary facts, and the rule that says whether an answer was stale.

Shaped like LMCache's multi-round QA (`--num-users --num-rounds --qps --shared-system-prompt
--user-history-prompt --answer-len`) and vLLM's `benchmarks/multi_turn` (Poisson arrivals, several turns per
conversation), with what those lack: a per-user memory block whose sizes are lognormal (mean about 1.5k
tokens), Zipf popularity over users, and edits. Everything here is a pure function of a seed (numpy's PCG64):
the same seed gives the same users, sizes, texts, arrivals and edits on every machine. No server, no model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# about 1.3 tokens a word with SmolLM2's tokenizer on these words; the benchmark measures the real count
TOKENS_PER_WORD = 1.3
_WORDS = (
    "apartment mortgage renovation kitchen tiles budget contractor garden sister Lisbon marathon violin "
    "allergy peanut teacher daughter birthday October coffee bicycle manager deadline vacation Kyoto "
    "hiking sourdough recipe cat piano dentist insurance neighbour balcony paint flooring train museum "
    "nephew spreadsheet invoice tomato chess lantern harbour winter pottery yoga ferry camera"
).split()
_CANARY_WORDS = ("PLUM", "OTTER", "CEDAR", "QUARTZ", "MAPLE", "EMBER", "TULIP", "RAVEN", "COBALT", "FJORD")
QUESTIONS = (
    "What do you remember about my plans?",
    "Summarize what you know about me in one sentence.",
    "Which city did I mention?",
    "What should I do this weekend?",
    "Remind me what I said about my family.",
)
PROBE = "What is my secret code? Answer with the code only."
SHARED_SYSTEM_PROMPT_SEED = (
    "You are a helpful assistant for a personal planning service. Answer briefly and use what you remember "
    "about the user. "
)


@dataclass(frozen=True)
class WorkloadConfig:
    num_users: int
    memory_tokens_mean: float = 1500.0  # of the lognormal per-user block size
    memory_sigma: float = 0.5  # the lognormal's sigma (of log tokens)
    min_memory_tokens: int = 64
    max_memory_tokens: int = 6000
    # words per memory: a block is several (fewer, longer ones: fewer rebuilds while seeding)
    memory_words: int = 150
    zipf_alpha: float = 1.1
    num_rounds: int = 3  # questions per conversation before a user starts a new one
    edit_share_per_min: float = 0.05  # share of the users who change a memory each minute
    # instead: edits as a share of the asks (edit rate = qps * edits_per_ask), so that edits follow the offered
    # load (a sweep in load factors scales the asks to the machine's pace; edits a minute would not follow)
    edits_per_ask: float | None = None
    probe_share: float = 0.2  # share of the questions that ask for the canary
    shared_system_prompt_words: int = 80
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_users < 1:
            raise ValueError(f"num_users must be >= 1, got {self.num_users}")
        if not self.memory_tokens_mean > 0 or self.memory_sigma < 0:
            raise ValueError(
                f"memory_tokens_mean must be > 0 and memory_sigma >= 0, got {self.memory_tokens_mean}, "
                f"{self.memory_sigma}"
            )
        if not 0 < self.min_memory_tokens <= self.max_memory_tokens:
            raise ValueError(
                f"need 0 < min_memory_tokens <= max_memory_tokens, got {self.min_memory_tokens}, "
                f"{self.max_memory_tokens}"
            )
        if self.zipf_alpha < 0 or self.num_rounds < 1:
            raise ValueError(
                f"zipf_alpha must be >= 0 and num_rounds >= 1, got {self.zipf_alpha}, {self.num_rounds}"
            )
        for name in ("edit_share_per_min", "probe_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.edits_per_ask is not None and not 0 <= self.edits_per_ask <= 1:
            raise ValueError(f"edits_per_ask must be in [0, 1], got {self.edits_per_ask}")

    @property
    def lognormal_mu(self) -> float:
        """mu of log tokens such that the (unclipped) mean is memory_tokens_mean: E = exp(mu + sigma^2 / 2)."""
        return math.log(self.memory_tokens_mean) - self.memory_sigma**2 / 2


@dataclass(frozen=True)
class User:
    user_id: str
    rank: int  # 1 = the most popular
    memory_tokens: int  # the drawn block size (target; the texts approximate it)
    memories: tuple[str, ...]  # filler memories; the canary memory is kept apart
    canary: str  # the first canary fact's code


@dataclass(frozen=True)
class Event:
    t: float  # seconds from the level's start
    kind: str  # "ask" | "edit"
    user: int  # index into the users
    round: int  # ask: the question's round in its conversation (0 = a new conversation)
    question: str  # ask: the question; edit: ""
    canary: str  # edit: the new canary code; ask: ""


def canary_text(code: str) -> str:
    return f"My secret code is {code}."


def make_canary(rng: np.random.Generator) -> str:
    """A code no text or other canary contains: two words and four digits ("PLUM-4821-OTTER")."""
    a, b = rng.choice(len(_CANARY_WORDS), size=2, replace=False)
    return f"{_CANARY_WORDS[a]}-{int(rng.integers(1000, 10000))}-{_CANARY_WORDS[b]}"


def zipf_weights(num_users: int, alpha: float) -> np.ndarray:
    """P(user of rank r) = r^-alpha / H, ranks 1..num_users."""
    w = np.arange(1, num_users + 1, dtype=np.float64) ** -alpha
    return w / w.sum()


def memory_sizes(cfg: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    """Per-user block sizes in tokens: lognormal(mu, sigma) rounded, clipped to [min, max]."""
    raw = rng.lognormal(cfg.lognormal_mu, cfg.memory_sigma, size=cfg.num_users)
    return np.clip(np.rint(raw), cfg.min_memory_tokens, cfg.max_memory_tokens).astype(np.int64)


def shared_system_prompt(cfg: WorkloadConfig) -> str:
    rng = np.random.default_rng([cfg.seed, 7])
    filler = " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=cfg.shared_system_prompt_words))
    return SHARED_SYSTEM_PROMPT_SEED + "House notes: " + filler + "."


def make_users(cfg: WorkloadConfig) -> list[User]:
    """Users 0..N-1, user k of popularity rank k+1; each a block of memories of about its drawn size."""
    rng = np.random.default_rng([cfg.seed, 1])
    sizes = memory_sizes(cfg, rng)
    users = []
    for k, tokens in enumerate(sizes.tolist()):
        words = max(1, round(tokens / TOKENS_PER_WORD))
        memories = []
        while words > 0:
            n = min(cfg.memory_words, words)
            picked = rng.integers(0, len(_WORDS), size=n)
            memories.append(f"Note {len(memories) + 1}: " + " ".join(_WORDS[i] for i in picked) + ".")
            words -= n
        users.append(User(f"mu-{cfg.seed}-{k}", k + 1, int(tokens), tuple(memories), make_canary(rng)))
    return users


def schedule(
    cfg: WorkloadConfig, qps: float, duration_s: float, level: int = 0, min_asks: int = 0
) -> list[Event]:
    """One load level: asks at Poisson times of rate `qps` over `duration_s`, each from a Zipf-drawn user, and
    edits at Poisson times of rate num_users * edit_share_per_min / 60 (or qps * edits_per_ask where that is
    set), each from a uniformly drawn user with a new canary, every edit followed at once by that user's probe.
    Sorted by time (asks before edits at a tie). `min_asks`: the asks go on past `duration_s` until there are
    that many (a low rate's percentiles are then of a distribution, not of 3 requests), and the edits cover
    the same span. `level` makes each level of a sweep its own draw."""
    if qps <= 0 or duration_s <= 0 or min_asks < 0:
        raise ValueError(
            f"qps and duration_s must be > 0 and min_asks >= 0, got {qps}, {duration_s}, {min_asks}"
        )
    rng = np.random.default_rng([cfg.seed, 2, level])
    weights = zipf_weights(cfg.num_users, cfg.zipf_alpha)
    events: list[Event] = []
    rounds = [0] * cfg.num_users
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / qps))
        if t >= duration_s and len(events) >= min_asks:
            break
        user = int(rng.choice(cfg.num_users, p=weights))
        r = rounds[user]
        rounds[user] = (r + 1) % cfg.num_rounds
        probe = bool(rng.random() < cfg.probe_share)
        question = PROBE if probe else QUESTIONS[int(rng.integers(0, len(QUESTIONS)))]
        events.append(Event(t, "ask", user, r, question, ""))
    edit_rate = (
        qps * cfg.edits_per_ask
        if cfg.edits_per_ask is not None
        else cfg.num_users * cfg.edit_share_per_min / 60.0
    )
    span = max(duration_s, events[-1].t if events else 0.0)  # past duration_s only for min_asks
    t = 0.0
    while edit_rate > 0:
        t += float(rng.exponential(1.0 / edit_rate))
        if t >= span:
            break
        user = int(rng.integers(0, cfg.num_users))
        events.append(Event(t, "edit", user, 0, "", make_canary(rng)))
    events.sort(key=lambda e: (e.t, e.kind != "ask"))
    return events


class CanaryLedger:
    """When each user's canaries stopped being current. An answer to a request sent at time t is stale when it
    contains a canary of that user whose replacement had returned (the edit was acknowledged) at or before t.
    A canary replaced while the request was in flight is not stale: either answer is right then."""

    def __init__(self) -> None:
        self._current: dict[str, str] = {}
        self._retired: dict[str, list[tuple[str, float]]] = {}

    def set(self, user_id: str, code: str, returned_at: float) -> None:
        """`code` is `user_id`'s canary from `returned_at` (when its write returned) on."""
        old = self._current.get(user_id)
        if old is not None and old != code:
            self._retired.setdefault(user_id, []).append((old, returned_at))
        self._current[user_id] = code

    def current(self, user_id: str) -> str | None:
        return self._current.get(user_id)

    def judge(self, user_id: str, sent_at: float, answer: str, current_at_send: str | None) -> str:
        """ "stale": the answer holds a canary retired at or before `sent_at`; else "fresh" if it holds the
        canary current when it was sent (`current_at_send`), else "absent" (the model did not repeat it)."""
        for code, retired_at in self._retired.get(user_id, []):
            if retired_at <= sent_at and code != current_at_send and code in answer:
                return "stale"
        if current_at_send is not None and current_at_send in answer:
            return "fresh"
        return "absent"

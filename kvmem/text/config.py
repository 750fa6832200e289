"""The plaintext store's one configuration object, validated when built.

Owns limits, durability and fusion settings; knows nothing of where the values come from (CLI, app factory).
"""

from __future__ import annotations

from dataclasses import dataclass

_SYNC_MODES = ("FULL", "NORMAL")
_FUSIONS = ("rrf",)
_RERANKERS = ("none", "ltr", "llm")  # kvmem.text.search.rerank.RERANKERS


@dataclass(frozen=True)
class TextStoreConfig:
    """Settings of one MemoryStore.

    max_text_tokens: longest memory or query accepted, counted as word and punctuation tokens (MemOS: 40k).
    max_text_chars: longest memory or query accepted, in characters; checked first, so a huge text is refused
        before anything scans it. 100k characters is about 20k English words. The server builds its store
        with its own memory-text limit (serving.config.Limits).
    synchronous: SQLite's fsync level in WAL mode; FULL survives power loss, NORMAL only process crashes.
    rrf_k, keyword_weight, dense_weight: reciprocal rank fusion, score = sum(w / (rrf_k + rank)).
    neighbour_weight: hybrid only; a keyword hit's score adds this times the best keyword score of its
        previous / next turn in the same session (so replies are found by the words of what they answer).
    dense_neighbour_weight: hybrid only; a dense candidate's cosine adds this times the mean cosine of its
        previous and next turn in the same session.
    speaker_weight: hybrid only; lift of candidates whose speaker the query names (the memory's metadata
        'speaker' if it has one, else its role's first word: rerank_features.speaker_of). 0.1, chosen on tune
        as the largest lift that keeps recall@10 on questions naming the wrong speaker within 10% of no lift
        (0.3 raised questions naming the right one 0.533 -> 0.557 and cut the others 0.485 -> 0.305).
        The hybrid defaults were chosen on the 'tune' split of REALTALK (real multi-session dialogue,
        benchmarks/memory/recall_bench.py) and are reported on its 'report' split: there keyword is the stronger
        leg, so it weighs double, with the usual k=60. (The earlier k=5, keyword 0.5 came from the synthetic
        set, where the legs are the other way round, and lost to plain BM25 on real conversations.)
    time_weight: hybrid only; lift of candidates whose chat_time lies in the time the query names ("last
        week", "in May", "29 Dec 2023": kvmem/text/search/when.py), its end extended by time_slack_days (what
        happened on a day is often told the next).
    window_weight: hybrid only; RRF weight of a third leg, the windowed dense leg: the query's cosine with a
        turn's vector summed with its previous and next turn's (search.window_leg). 0 leaves the leg out.
    rerank: hybrid's second stage over the first stage's top rerank_depth: 'ltr' (learning to rank over
        features the first stage has, weights from rerank_weights: None = the JSON shipped in the package,
        kvmem/text/search/rerank_weights.json), 'llm' (the served LLM as a pointwise judge, rerank_llm_url /
        rerank_llm_model; off by default) or 'none'. Weights that are missing, corrupt or for another
        feature set are refused when the store opens, with a log line, and search keeps the first stage.
        rerank_depth: how many of the first stage's best the second stage reorders (the rest keep the first
        stage's order below them). 100 (with num_candidates 100): on tune the top 100 holds 0.76 of the
        evidence (top 50: 0.69, top 200 of 200 per leg: 0.85) and the reranker scored 0.519 cross-validated
        (0.530 at 200), but 200 cost 2 ms more at p50 than 100 and broke the latency budget. With the query
        head (search/query_head.py) the refitted reranker scores 0.579 cross-validated at 100.
    num_candidates: how many hits each search leg hands to fusion (at least top_k).
    num_keyword_candidates: hybrid only; how many BM25 hits are spread to their neighbours before fusion.
    vector_cache_bytes: bound on the in-process per-user vector matrices used by the dense scan.
    reembed_on_mismatch: re-embed every memory at open when the file was built with another embedder.
    """

    max_text_tokens: int = 40_000
    max_text_chars: int = 100_000
    max_page_size: int = 1000
    max_top_k: int = 1000
    synchronous: str = "FULL"
    busy_timeout_ms: int = 10_000
    fusion: str = "rrf"
    rrf_k: int = 60
    keyword_weight: float = 1.0
    dense_weight: float = 0.5
    neighbour_weight: float = 0.5
    dense_neighbour_weight: float = 0.3
    speaker_weight: float = 0.1
    time_weight: float = 1.0
    time_slack_days: int = 1
    window_weight: float = 0.0
    rerank: str = "ltr"
    rerank_depth: int = 100
    rerank_weights: str | None = None
    rerank_llm_url: str | None = None
    rerank_llm_model: str = ""
    num_candidates: int = 100
    num_keyword_candidates: int = 200
    vector_cache_bytes: int = 512 * 1024 * 1024
    embed_batch_size: int = 64
    reembed_on_mismatch: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_text_tokens",
            "max_text_chars",
            "max_page_size",
            "max_top_k",
            "num_candidates",
            "num_keyword_candidates",
            "embed_batch_size",
            "rerank_depth",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TextStoreConfig.{name} must be a positive int, got {value!r}")
        for name in ("busy_timeout_ms", "vector_cache_bytes", "rrf_k", "time_slack_days"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TextStoreConfig.{name} must be a non-negative int, got {value!r}")
        if self.synchronous not in _SYNC_MODES:
            raise ValueError(
                f"TextStoreConfig.synchronous must be one of {_SYNC_MODES}, got {self.synchronous!r}"
            )
        if self.fusion not in _FUSIONS:
            raise ValueError(f"TextStoreConfig.fusion must be one of {_FUSIONS}, got {self.fusion!r}")
        for name in (
            "keyword_weight",
            "dense_weight",
            "neighbour_weight",
            "dense_neighbour_weight",
            "speaker_weight",
            "time_weight",
            "window_weight",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TextStoreConfig.{name} must be a number >= 0, got {value!r}")
        if self.rerank not in _RERANKERS:
            raise ValueError(f"TextStoreConfig.rerank must be one of {_RERANKERS}, got {self.rerank!r}")
        for name in ("rerank_weights", "rerank_llm_url"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"TextStoreConfig.{name} must be a non-empty string or None, got {value!r}")
        if self.keyword_weight == 0 and self.dense_weight == 0:
            raise ValueError("TextStoreConfig.keyword_weight and dense_weight cannot both be 0")

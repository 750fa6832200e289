"""The plaintext store's one configuration object, validated when built.

Owns limits, durability and fusion settings; knows nothing of where the values come from (CLI, app factory).
"""

from __future__ import annotations

from dataclasses import dataclass

_SYNC_MODES = ("FULL", "NORMAL")
_FUSIONS = ("rrf",)


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
    speaker_weight: hybrid only; lift of candidates whose speaker (role's first word) the query names.
        The hybrid defaults were chosen on the 'tune' split of REALTALK (real multi-session dialogue,
        benchmarks/recall_bench.py) and are reported on its 'report' split: there keyword is the stronger
        leg, so it weighs double, with the usual k=60. (The earlier k=5, keyword 0.5 came from the synthetic
        set, where the legs are the other way round, and lost to plain BM25 on real conversations.)
    time_weight: hybrid only; lift of candidates whose chat_time lies in the time the query names ("last
        week", "in May", "29 Dec 2023": kvmem/text/when.py), its end extended by time_slack_days (what
        happened on a day is often told the next).
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
    speaker_weight: float = 0.3
    time_weight: float = 1.0
    time_slack_days: int = 1
    num_candidates: int = 50
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
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TextStoreConfig.{name} must be a number >= 0, got {value!r}")
        if self.keyword_weight == 0 and self.dense_weight == 0:
            raise ValueError("TextStoreConfig.keyword_weight and dense_weight cannot both be 0")

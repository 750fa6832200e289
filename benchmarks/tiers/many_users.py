"""Many users on one machine: memory KV that does not fit, served from the lower tiers, against vLLM's prefix
cache (issue 44 item 7).

N users share a system prompt; each has a memory block (lognormal sizes, mean about 1.5k tokens) with a canary
fact ("My secret code is PLUM-4821-OTTER."). Users are picked by Zipf popularity (alpha 1.1), questions arrive
as a Poisson process at each rate of a sweep up to saturation, several rounds per conversation (the client
keeps the history, as LMCache's multi-round QA), and an edit stream changes a share of the users' canaries each
minute; each edit is followed at once by that user asking for the code, and an answer that holds a canary
whose replacement had already returned is a stale answer (greedy decoding). Arms (many_users_arms.py): text,
vllm-prefix, vllm-offload, kvmem, kvmem-vllm, all in one run on one machine with the same model and clients.

Per arm and rate: TTFT p50/p90/p99, output tokens/s, requests/s within the TTFT target (goodput), cached
prompt tokens, per-tier hits/loads/bytes from /metrics where the server has them (`missing` says which it
lacks), stale answers, errors; per arm a sample of greedy answers against a cold prefill of the same prompt in
this process. JSON (env with git sha and the load average taken at the start) to --out, and with --plot a PNG
of TTFT against load per arm beside it (needs matplotlib).

    python -m benchmarks.tiers.many_users --quick --arms text kvmem --out /tmp/many_users.json   # minutes
    python -m benchmarks.tiers.many_users --arms text vllm-prefix vllm-offload kvmem kvmem-vllm --plot \\
        --out benchmarks/results/cpu/many_users.json                                               # full
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import env_info, print_table, write_outputs
from benchmarks.load.http_client import _post
from benchmarks.tiers import many_users_arms as arms_mod
from benchmarks.tiers.many_users_client import (
    Client,
    cold_answers,
    reference_request_s,
    sample_prompts,
    wait_all_blocks,
    wait_scheduler_idle,
)
from benchmarks.tiers.many_users_workload import (
    QUESTIONS,
    User,
    WorkloadConfig,
    make_users,
    schedule,
    shared_system_prompt,
)

BYTES_PER_TOKEN_FP32_SMOLLM2 = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x kv heads x head dim x fp32


def percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return (
        float(ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]) if ordered else float("nan")
    )


def run_level(client: Client, cfg: WorkloadConfig, qps: float, level: int, args) -> dict:
    events = schedule(cfg, qps, args.duration_s, level, min_asks=args.min_asks)
    before = arms_mod.scrape(client.server.base)
    rows: list[dict] = []
    futures = []
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.max_in_flight) as pool:
        for e in events:
            delay = start + e.t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            user = client.users[e.user]
            if e.kind == "ask":
                futures.append(pool.submit(client.ask, user, e.question, e.round))
            else:
                futures.append(pool.submit(client.edit, user, e.canary))
        rows = [f.result() for f in futures]
    elapsed = time.monotonic() - start
    after = arms_mod.scrape(client.server.base)
    ok = [r for r in rows if "ttft_s" in r]
    ttfts = [r["ttft_first_attempt_s"] for r in ok]  # what the user waited, 429 retries included
    errors = Counter(
        r.get("error", r.get("edit_error", "")).split(":")[0]
        for r in rows
        if "error" in r or "edit_error" in r
    )
    verdicts = Counter(r["canary"] for r in ok if "canary" in r)
    after_edit = Counter(r["canary"] for r in ok if r.get("after_edit") and "canary" in r)
    figures = arms_mod.tier_figures(before, after)
    loaded = sum(t.get("bytes_loaded", 0.0) for t in figures["tiers"].values())
    return {
        "qps": qps,
        "duration_s": elapsed,
        "requests_sent": len(events),  # asks, and the probe after each edit
        "edits": sum(1 for e in events if e.kind == "edit"),
        "completed": len(ok),
        "errors": dict(errors),
        "num_errors": sum(errors.values()),
        "retries_429": sum(r.get("retries_429", 0) for r in rows),
        "error_samples": sorted(
            {r.get("error", r.get("edit_error")) for r in rows if "error" in r or "edit_error" in r}
        )[:5],
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "requests_per_s": len(ok) / elapsed,
        "goodput_rps": sum(1 for t in ttfts if t <= args.ttft_target_s) / elapsed,
        "tokens_per_s": sum(r["completion_tokens"] for r in ok) / elapsed,
        "prompt_tokens_mean": sum(r["prompt_tokens"] for r in ok) / len(ok) if ok else float("nan"),
        "cached_tokens_mean": sum(r["cached_tokens"] for r in ok) / len(ok) if ok else float("nan"),
        "memory_tiers": dict(sum((Counter(r["tiers"]) for r in ok), Counter())),
        "probes": dict(verdicts),
        "probes_after_edit": dict(after_edit),
        "stale_answers": verdicts.get("stale", 0),
        # None where the server does not count bytes loaded per tier (`metrics.missing`)
        "bytes_loaded_per_request": loaded / len(ok)
        if ok and "bytes_loaded" not in figures["missing"]
        else None,
        "metrics": figures,
    }


def run_arm(arm: str, cfg: WorkloadConfig, users: list[User], system: str, args, supported, tmp: str) -> dict:
    result: dict = {"arm": arm, "levels": [], "notes": []}
    try:
        with arms_mod.arm_server(arm, args, tmp, supported) as server:
            result["notes"] += server.notes
            result["fastest_tier_bytes"] = server.fastest_tier_bytes
            client = Client(arm, server, users, system, args)
            t = time.monotonic()
            client.seed()
            if not client.pasted and arm != "kvmem-fake":
                for user in users:  # every block built before the clock starts
                    _post(f"{server.base}/v1/memories/plan/prewarm", {"user_id": user.user_id})
                # users whose block was never built: their asks are served with the memories as text
                result["users_without_block"] = wait_all_blocks(server.base, users, args.block_wait_s)
                # and nothing of the seed left queued (prewarms still to run would read blocks on the clock)
                result["scheduler_drain_s"] = wait_scheduler_idle(server.base, args.block_wait_s)
            result["seed_s"] = time.monotonic() - t
            client.ask(users[0], QUESTIONS[0], 0)  # warm-up, off the clock
            for level, qps in enumerate(args.qps):
                row = run_level(client, cfg, qps, level, args)
                print(
                    f"# {arm} {row['qps']} qps: p50 {row['ttft_p50_s']:.3f} s, {row['completed']} done, "
                    f"{row['num_errors']} errors, {row['metrics']['block_builds']} block builds, "
                    f"{row['metrics']['block_cuts']} cuts",
                    file=sys.stderr,
                )
                result["levels"].append(row)
                if saturated(row, qps, args):
                    result["saturated_at"] = qps
                    result["notes"].append(f"saturated at {qps} qps: higher rates not run")
                    break
            result["samples"] = sample_prompts(client, args)
    except Exception as exc:  # noqa: BLE001 - a server that would not start, a failed seed: the arm says why
        result["error"] = f"{type(exc).__name__}: {exc}"[-1500:]
    return result


def saturated(row: dict, qps: float, args) -> bool:
    """No higher rate is worth running: completions fell well behind the offered rate, the median TTFT is 10x
    the target, or a request failed (a timeout past --request-timeout-s is one: the backlog grew)."""
    return (
        row["num_errors"] > 0
        or row["requests_per_s"] < 0.7 * qps
        or not row["ttft_p50_s"] <= 10 * args.ttft_target_s  # NaN: nothing completed
    )


def plot(result: dict, out: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# --plot: matplotlib is not installed; no PNG written", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in result["arms"]:
        lv = arm["levels"]
        if lv:
            ax.plot(
                [r["qps"] for r in lv], [r["ttft_p50_s"] for r in lv], marker="o", label=f"{arm['arm']} p50"
            )
            ax.plot([r["qps"] for r in lv], [r["ttft_p99_s"] for r in lv], ls="--", label=f"{arm['arm']} p99")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    path = str(Path(out).with_suffix(".png"))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


# quick: 64 users x ~600 tokens x 46 KB (SmolLM2-135M, fp32) = ~1.8 GB of memory KV against a 192 MiB pool (~9x)
QUICK = dict(
    num_users=64,
    memory_tokens_mean=600.0,
    max_memory_tokens=1500,
    kv_pool_mb=192,
    max_model_len=2560,
    qps=[0.25, 0.5, 1.0],
    duration_s=20.0,
    request_timeout_s=30.0,
    edit_share_per_min=0.25,
    answer_len=16,
    samples=2,
    block_token_budget=2048,
)
# With --load-factors the asks follow the machine's pace and, unless --edits-per-ask says otherwise, so do the
# edits: one edit per five asks. A share of users a minute does not scale: at e7ea85d's sweep (one text request
# 8.2 s alone, rates 0.03-0.24 requests/s) 96 users x 0.05 a minute made 4-11 edits against 7-22 asks a rate, so
# most asks were the probes that follow an edit at once, served as text while the block was rebuilt.
EDITS_PER_ASK_WITH_FACTORS = 0.2
# full: 160 users x ~1.5k tokens = ~11 GB against 1 GiB (~10x)
FULL = dict(
    num_users=160,
    memory_tokens_mean=1500.0,
    max_memory_tokens=4000,
    kv_pool_mb=1024,
    max_model_len=8192,
    qps=[0.25, 0.5, 1.0, 2.0],
    duration_s=60.0,
    request_timeout_s=60.0,
    edit_share_per_min=0.05,
    answer_len=32,
    samples=3,
    block_token_budget=8192,
)


def kv_bytes_per_token(model: str | None) -> int:
    """K and V of one token in fp32, from the model's config."""
    import torch
    from transformers import AutoConfig

    from kvmem.models import config_kv_bytes_per_token, provision

    return config_kv_bytes_per_token(AutoConfig.from_pretrained(model or str(provision())), torch.float32)


def summarize(arms: list[dict], baseline: str = "vllm-prefix") -> dict:
    """Per arm of ours, at each rate both it and the baseline ran: TTFT p50 and p99 over the baseline's, and
    tokens/s; stale answers and errors over all rates."""
    by = {a["arm"]: {r["qps"]: r for r in a["levels"]} for a in arms}
    out: dict = {}
    for arm, levels in by.items():
        entry = {
            "stale_answers": sum(r["stale_answers"] for r in levels.values()),
            "errors": sum(r["num_errors"] for r in levels.values()),
        }
        base = by.get(baseline, {})
        if arm != baseline and base:
            entry[f"vs_{baseline}"] = {
                str(q): {
                    "ttft_p50_x": r["ttft_p50_s"] / base[q]["ttft_p50_s"],
                    "ttft_p99_x": r["ttft_p99_s"] / base[q]["ttft_p99_s"],
                    "tokens_per_s_x": r["tokens_per_s"] / base[q]["tokens_per_s"]
                    if base[q]["tokens_per_s"]
                    else None,
                }
                for q, r in levels.items()
                if q in base
            }
        out[arm] = entry
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tiers.many_users", description=__doc__.splitlines()[0]
    )
    p.add_argument("--arms", nargs="+", default=["text", "vllm-prefix", "kvmem"], choices=arms_mod.ARMS)
    p.add_argument("--quick", action="store_true", help="small users, small pools, 3 short rates: minutes")
    p.add_argument("--num-users", type=int)
    p.add_argument("--memory-tokens-mean", type=float, help="mean of the lognormal block size")
    p.add_argument("--memory-sigma", type=float, default=0.5)
    p.add_argument("--max-memory-tokens", type=int)
    p.add_argument("--zipf-alpha", type=float, default=1.1)
    p.add_argument("--num-rounds", type=int, default=3)
    p.add_argument("--edit-share-per-min", type=float)
    p.add_argument(
        "--edits-per-ask",
        type=float,
        help="instead of --edit-share-per-min: edits as a share of the asks at each rate (default with "
        f"--load-factors and no --edit-share-per-min: {EDITS_PER_ASK_WITH_FACTORS}, so that edits follow the "
        "machine's pace as the asks do)",
    )
    p.add_argument("--probe-share", type=float, default=0.2)
    p.add_argument("--shared-system-prompt", type=int, default=80, help="words of the shared system prompt")
    p.add_argument("--qps", type=float, nargs="+", help="the offered rates, low to high")
    p.add_argument(
        "--load-factors",
        type=float,
        nargs="+",
        help="instead of --qps: the offered rates as multiples of the machine's pace, rate = factor / the "
        "seconds one text request takes alone here (measured first, in this process): sweeps taken on a "
        "faster or slower day load the machine alike",
    )
    p.add_argument(
        "--reference-s",
        type=float,
        help="with --load-factors: that one request's seconds, given instead of measured (to repeat a sweep's "
        "rates exactly)",
    )
    p.add_argument("--duration-s", type=float, help="per rate")
    p.add_argument(
        "--min-asks",
        type=int,
        default=0,
        help="per rate, at least this many asks: a low rate runs past --duration-s until it has them",
    )
    p.add_argument("--answer-len", type=int, help="max_tokens")
    p.add_argument("--ttft-target-s", type=float, default=1.0, help="goodput counts requests within it")
    p.add_argument(
        "--request-timeout-s",
        type=float,
        help='a request not answered within it is an error ("timeout"): bounds a level past saturation',
    )
    p.add_argument("--samples", type=int, help="greedy answers compared with a cold prefill, per arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--kv-pool-mb", type=int, help="the fastest tier: kvmem's page pool, vLLM's KV cache")
    p.add_argument("--kv-host-mb", type=int, help="passed to kvmem serve (issue 44 item 2)")
    p.add_argument("--kv-disk-gb", type=float, help="passed to kvmem serve (issue 44 item 2)")
    p.add_argument("--kv-user-mb", type=int, help="passed to kvmem serve (issue 44 item 6)")
    p.add_argument(
        "--kv-wait-s",
        type=float,
        help="passed to kvmem serve: how long a request waits for pool pages before its 429 (default: "
        "--request-timeout-s, so the engine queues as long as the client waits, as vLLM does)",
    )
    p.add_argument("--vllm-offload-gb", type=int, default=4, help="vllm-offload: CPU offload size")
    p.add_argument(
        "--vllm-block-size", type=int, default=32, help="vLLM arms: KV block size (only whole blocks hit)"
    )
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-token-budget", type=int)
    p.add_argument("--retrieve-top-k", type=int, default=8)
    p.add_argument("--queue-size", type=int, default=64)
    p.add_argument("--max-in-flight", type=int, default=64, help="client threads")
    p.add_argument("--block-wait-s", type=float, default=900.0)
    p.add_argument(
        "--retries-429", type=int, default=3, help="a 429 is retried after its Retry-After, this many times"
    )
    p.add_argument("--serve-args", default="", help="more `kvmem serve` flags, every kvmem arm")
    p.add_argument("--text-serve-args", default="", help="more `kvmem serve` flags, the text arm (no reuse)")
    p.add_argument("--plot", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    loadavg_start = list(os.getloadavg())
    if args.load_factors is not None and args.qps is not None:
        p.error("--load-factors and --qps both give the offered rates: pass one")
    if args.reference_s is not None and (args.load_factors is None or args.reference_s <= 0):
        p.error("--reference-s needs --load-factors and must be positive")
    if args.edits_per_ask is not None and args.edit_share_per_min is not None:
        p.error("--edits-per-ask and --edit-share-per-min both give the edit stream: pass one")
    if args.edits_per_ask is not None and not 0 <= args.edits_per_ask <= 1:
        p.error(f"--edits-per-ask must be in [0, 1], got {args.edits_per_ask}")
    if args.edits_per_ask is None and args.edit_share_per_min is None and args.load_factors is not None:
        args.edits_per_ask = EDITS_PER_ASK_WITH_FACTORS
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.kv_wait_s is None:
        args.kv_wait_s = args.request_timeout_s
    if len(set(args.arms)) != len(args.arms):
        p.error(f"--arms names an arm twice: {args.arms}")
    if args.load_factors is not None and (
        sorted(args.load_factors) != args.load_factors or min(args.load_factors) <= 0
    ):
        p.error(f"--load-factors must be positive and ascending, got {args.load_factors}")
    if sorted(args.qps) != args.qps or min(args.qps) <= 0:
        p.error(f"--qps must be positive and ascending, got {args.qps}")
    cfg = WorkloadConfig(
        num_users=args.num_users, memory_tokens_mean=args.memory_tokens_mean, memory_sigma=args.memory_sigma,
        max_memory_tokens=args.max_memory_tokens, zipf_alpha=args.zipf_alpha, num_rounds=args.num_rounds,
        edit_share_per_min=args.edit_share_per_min, edits_per_ask=args.edits_per_ask, probe_share=args.probe_share,
        shared_system_prompt_words=args.shared_system_prompt, seed=args.seed,
    )  # fmt: skip
    users = make_users(cfg)
    system = shared_system_prompt(cfg)
    calibration = None
    if args.load_factors is not None:
        if args.reference_s is not None:
            calibration = {"reference_s": args.reference_s, "given": True}
        else:
            calibration = reference_request_s(args.model, users, system, args.answer_len)
        args.qps = [round(f / calibration["reference_s"], 4) for f in args.load_factors]
        calibration["load_factors"] = args.load_factors
        print(
            f"# one text request alone: {calibration['reference_s']:.3f} s; load factors {args.load_factors} "
            f"-> {args.qps} qps",
            file=sys.stderr,
        )
    supported = arms_mod.serve_flags()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_arm(arm, cfg, users, system, args, supported, tmp) for arm in args.arms]
    fake_only = all(a == "kvmem-fake" for a in args.arms)
    per_token = None if fake_only else kv_bytes_per_token(args.model)
    if not fake_only:
        cold_answers({a["arm"]: a.get("samples", []) for a in results}, args.model, args.answer_len)
    memory_tokens = sum(u.memory_tokens for u in users)
    for arm in results:
        fastest = arm.get("fastest_tier_bytes")
        arm["overcommit_x"] = memory_tokens * per_token / fastest if per_token and fastest else None
        samples = arm.get("samples", [])
        arm["samples_same_as_cold"] = [s.get("same") for s in samples]
    rows = [
        [a["arm"], r["qps"], r["completed"], r["num_errors"], r["ttft_p50_s"], r["ttft_p90_s"], r["ttft_p99_s"],
         round(r["tokens_per_s"], 2), round(r["goodput_rps"], 3), r["stale_answers"], round(r["cached_tokens_mean"], 1)]
        for a in results for r in a["levels"]
    ]  # fmt: skip
    print_table(
        ["Arm", "QPS", "Done", "Errors", "TTFT p50", "p90", "p99", "Tok/s", "Goodput", "Stale", "Cached"],
        rows,
    )
    env = {**env_info("cpu"), "loadavg_start": loadavg_start, "command": " ".join(sys.argv)}
    result = {
        "env": env,
        "workload": {**cfg.__dict__, "lognormal_mu": cfg.lognormal_mu, "memory_tokens_total": memory_tokens,
                     "memory_tokens_drawn": [u.memory_tokens for u in users], "kv_bytes_per_token": per_token,
                     "memory_kv_bytes_total": memory_tokens * per_token if per_token else None,
                     "shared_system_prompt": system},
        "settings": {k: getattr(args, k) for k in ("qps", "duration_s", "min_asks", "answer_len", "ttft_target_s", "kv_pool_mb",
                                                    "kv_host_mb", "kv_disk_gb", "kv_user_mb", "kv_wait_s", "max_model_len", "request_timeout_s",
                                                    "block_token_budget", "quick", "serve_args", "text_serve_args")},
        "calibration": calibration,
        "arms": results,
        "summary": summarize(results),
    }  # fmt: skip
    if args.plot:
        result["plot"] = plot(result, args.out)
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""Issue 44 item 6: `--kv-user-mb` (a per-user quota of the KV page pool) and `--kv-evict-policy` reach the
transformers backend's config; a bad value exits 2 with one line naming it."""

from __future__ import annotations

from pathlib import Path

from serving.backends import create_backend
from serving.ops.cli import build_parser, config_from_args, main


def test_the_user_quota_and_the_policy_reach_the_transformers_backend(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", "--data-dir", str(tmp_path), "--kv-user-mb", "96", "--kv-evict-policy", "heat"]
    )
    config = config_from_args(args)
    assert (config.kv_user_mb, config.kv_evict_policy) == (96, "heat")
    backend = create_backend(config)  # not loaded: no weights read
    assert (backend.config.kv_user_bytes, backend.config.kv_evict_policy) == (96 << 20, "heat")
    defaults = create_backend(
        config_from_args(build_parser().parse_args(["serve", "--data-dir", str(tmp_path)]))
    )
    assert (defaults.config.kv_user_bytes, defaults.config.kv_evict_policy) == (None, "lru")


def test_a_bad_quota_exits_2_naming_it(tmp_path: Path, capsys) -> None:
    assert main(["serve", "--backend", "fake", "--data-dir", str(tmp_path), "--kv-user-mb", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kv_user_mb must be >= 1 (MiB of one user's kept KV), got 0" in err


def test_an_unknown_policy_exits_2_naming_it(tmp_path: Path, capsys) -> None:
    assert main(["serve", "--backend", "fake", "--data-dir", str(tmp_path), "--kv-evict-policy", "mru"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "--kv-evict-policy: invalid choice: 'mru' (choose from 'lru', 'heat')" in err
    )


def test_the_pool_wait_reaches_the_transformers_backend_and_a_negative_one_exits_2(
    tmp_path: Path, capsys
) -> None:
    """`--kv-wait-s`: how long a request that finds the pool full waits for pages before its 429 (issue 44:
    a benchmark arm queues as long as its client waits, as vLLM does, instead of refusing at 10 s)."""
    args = build_parser().parse_args(["serve", "--data-dir", str(tmp_path), "--kv-wait-s", "60"])
    assert create_backend(config_from_args(args)).config.kv_wait_s == 60.0
    defaults = build_parser().parse_args(["serve", "--data-dir", str(tmp_path)])
    assert create_backend(config_from_args(defaults)).config.kv_wait_s == 10.0
    assert main(["serve", "--backend", "fake", "--data-dir", str(tmp_path), "--kv-wait-s", "-1"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "kv_wait_s must be >= 0 (seconds a request waits for KV pages), got -1.0" in err
    )

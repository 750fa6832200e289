"""Issue 44 item 2: `--kv-host-mb` and `--kv-disk-gb` set the KV store's tiers of stored blocks (transformers
and vllm backends) beside `--kv-pool-mb` (the page pool, or vLLM's KV cache); a bad value exits 2 with one line naming the flag's field."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from serving.backends import create_backend
from serving.ops.cli import build_parser, config_from_args, main


def test_the_tier_budgets_reach_the_transformers_backend(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--data-dir",
            str(tmp_path),
            "--kv-host-mb",
            "512",
            "--kv-disk-gb",
            "1.5",
            "--kv-pool-mb",
            "64",
        ]
    )
    config = config_from_args(args)
    assert (config.kv_host_mb, config.kv_disk_gb, config.kv_pool_mb) == (512, 1.5, 64)
    backend = create_backend(config)  # not loaded: no weights read
    assert (backend.config.host_kv_bytes, backend.config.disk_kv_bytes) == (512 << 20, 1_500_000_000)
    defaults = create_backend(
        config_from_args(build_parser().parse_args(["serve", "--data-dir", str(tmp_path)]))
    )
    assert (defaults.config.host_kv_bytes, defaults.config.disk_kv_bytes) == (4096 << 20, None)
    none_in_ram = config_from_args(build_parser().parse_args(["serve", "--kv-host-mb", "0"]))
    assert create_backend(none_in_ram).config.host_kv_bytes == 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed")
def test_the_budgets_reach_the_vllm_backend(tmp_path: Path) -> None:
    """--kv-pool-mb sizes vLLM's paged KV cache (its fastest tier), --kv-host-mb and --kv-disk-gb the stored
    blocks' tiers, as for the transformers backend; without --kv-pool-mb the backend keeps its 1 GiB."""
    common = ["serve", "--backend", "vllm", "--data-dir", str(tmp_path)]
    sized = ["--kv-pool-mb", "640", "--kv-host-mb", "512", "--kv-disk-gb", "1.5"]
    backend = create_backend(config_from_args(build_parser().parse_args([*common, *sized])))  # not loaded
    assert (backend.config.kv_cache_bytes, backend.config.host_kv_bytes, backend.config.disk_kv_bytes) == (
        640 << 20,
        512 << 20,
        1_500_000_000,
    )
    defaults = create_backend(config_from_args(build_parser().parse_args(common)))
    assert (defaults.config.kv_cache_bytes, defaults.config.host_kv_bytes, defaults.config.disk_kv_bytes) == (
        1 << 30,
        4096 << 20,
        None,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-host-mb", "-1"], "kv_host_mb must be >= 0 (0: no RAM tier), got -1"),
        (["--kv-disk-gb", "0"], "kv_disk_gb must be > 0 (omit it: unlimited), got 0.0"),
    ],
)
def test_a_bad_budget_exits_2_naming_it(tmp_path: Path, capsys, flags, message) -> None:
    assert main(["serve", "--backend", "fake", "--data-dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err

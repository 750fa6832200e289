"""scripts/cluster.sh: replicas of `kvmem serve` behind HAProxy, with PostgreSQL and Redis, all on loopback.

The command line over serving/ops/cluster.py (`up`, `down`, `status`); it prints what it started, the router's URL
last.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from the repository root

from serving.ops.cluster import ClusterError, ClusterState, alive, down, up  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/cluster.sh",
        description="Replicas of kvmem serve behind HAProxy, with PostgreSQL and Redis, all on loopback. "
        "Arguments after `--` go to every `kvmem serve`.",
    )
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--replicas", type=int, default=2, help="replicas to start (up)")
    p.add_argument("--dir", type=Path, default=Path(".kvmem-cluster"), help="where everything is kept")
    p.add_argument("--wait-s", type=float, default=600.0, help="seconds each replica has to load (up)")
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_args = argv[:at], argv[at + 1 :]
    args = p.parse_args(argv)
    try:
        if args.action == "up":
            with _stopped_by_signals() as signalled:
                try:
                    state = up(args.dir, args.replicas, serve_args, wait_s=args.wait_s)
                except Interrupted:  # `up` stopped what it had started before letting this through
                    sys.stderr.write(
                        f"cluster: error: interrupted by {signalled[0]}; what was started is stopped again\n"
                    )
                    return 128 + signal.Signals[signalled[0]].value
            for r in state.replicas:
                print(f"replica {r.id}: {r.url} (pid {r.pid}, log {r.log})")
            print(f"postgresql: {state.store_url}\nredis: {state.redis_url}")
            print(state.router_url, flush=True)  # the last line: the router
        elif args.action == "down":
            stopped = down(args.dir)
            print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        else:
            state = ClusterState.load(args.dir.resolve())
            if state is None:
                print("no cluster")
                return 1
            for r in state.replicas:
                print(f"replica {r.id}: {r.url} {'up' if alive(r.pid) else 'down'}")
            print(state.router_url)
    except ClusterError as e:
        sys.stderr.write(f"cluster: error: {e}\n")
        return 1
    return 0


class Interrupted(BaseException):
    """SIGTERM, SIGHUP or SIGINT arrived while `up` ran (a BaseException, so `up` cleans up and re-raises)."""


@contextmanager
def _stopped_by_signals() -> Iterator[list[str]]:
    """While `up` runs, SIGTERM, SIGHUP and SIGINT raise Interrupted in it, so it stops what it started (a
    killed `up` used to leave PostgreSQL, Redis and replicas running); the list gets the signal's name."""
    received: list[str] = []

    def interrupt(signum: int, frame: object) -> None:
        if not received:
            received.append(signal.Signals(signum).name)
            raise Interrupted

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())

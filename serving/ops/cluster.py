"""A cluster on loopback: PostgreSQL, Redis, N `kvmem serve` replicas and HAProxy in front of them.

`scripts/cluster.sh up|down|status` (its command line: scripts/cluster.py). `up` starts every part under one directory
(default `.kvmem-cluster`), waits until each replica answers /health, writes what it started to
`cluster.json` there and prints the router's URL as its last line; `down` stops them all (replicas first,
then the router, Redis and PostgreSQL). `cluster.json` names each part before it is started (PostgreSQL by its
directory, whose postmaster.pid `down` stops it by), so a failed or interrupted `up` stops everything it
started, and `down` stops it all even after an `up` that was killed. The replicas share PostgreSQL (memories, heat: `--store`), Redis
(tasks, fences: `--scheduler-redis-url`) and one data dir (KV items are content-addressed and immutable, so
any replica loads any user's block); HAProxy routes each user to one replica by consistent hashing
(`deploy/haproxy.cfg`). Every child runs in its own session with its output in `logs/`, so `up` returns and
they keep running. Owns process bookkeeping only; knows nothing of memories or models.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvmem.text.db.pg_server import PgServer, PgServerError, find_bin_dir, start_server

STATE_FILE = "cluster.json"
DATABASE = "kvmem"
HAPROXY_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"


class ClusterError(RuntimeError):
    """A part could not be started or found; the message names it and what to do."""


@dataclass
class Replica:
    id: str
    port: int
    pid: int
    log: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self.log)


@dataclass
class ClusterState:
    """What `up` started, as written to `cluster.json` (pids, ports, the PostgreSQL server's directory)."""

    root: str
    router_port: int
    router_pid: int
    redis_port: int
    redis_pid: int
    pg_root: str
    pg_port: int
    pg_as_postgres: bool
    replicas: list[Replica] = field(default_factory=list)
    serve_args: list[str] = field(default_factory=list)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def store_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.pg_port}/{DATABASE}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def data_dir(self) -> Path:
        return Path(self.root) / "data"

    def pg(self) -> PgServer:
        bin_dir = find_bin_dir()
        if bin_dir is None:
            raise ClusterError("PostgreSQL's server binaries are gone (apt-get install postgresql)")
        return PgServer(Path(self.pg_root), self.pg_port, bin_dir, self.pg_as_postgres)

    def save(self) -> None:
        path = Path(self.root) / STATE_FILE
        path.with_suffix(".tmp").write_text(json.dumps(asdict(self), indent=2))
        path.with_suffix(".tmp").replace(path)

    @classmethod
    def load(cls, root: Path) -> ClusterState | None:
        path = root / STATE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        data["replicas"] = [Replica(**r) for r in data["replicas"]]
        return cls(**data)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process is dead
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def need(binary: str, package: str) -> str:
    path = shutil.which(binary) or (f"/usr/sbin/{binary}" if Path(f"/usr/sbin/{binary}").exists() else None)
    if path is None:
        raise ClusterError(f"{binary} not found: install it (apt-get install {package})")
    return path


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    """Starts `cmd` in its own session with stdout and stderr appended to `log`; returns its pid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, env=env
        )
    return proc.pid


def replica_env(num_replicas: int) -> dict[str, str]:
    """The environment of a replica: the machine's cores split between the replicas (torch's CPU threads,
    OMP_NUM_THREADS), unless the caller set it. Replicas that each spin a thread per core on one machine
    slowed each other tenfold here (2 replicas, 2 cores: TTFT p50 8.2 s against 0.83 s for one)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_replicas)))
    return env


def wait_http(url: str, pid: int, timeout_s: float, what: str, log: Path) -> None:
    """Waits until GET `url` answers 200; ClusterError naming `what` and its log's tail if it exits or times
    out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if not alive(pid):
            raise ClusterError(f"{what} exited while starting; the end of {log}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise ClusterError(
                f"{what} did not answer {url} within {timeout_s:.0f} s; the end of {log}:\n{_tail(log)}"
            )
        time.sleep(0.2)


def _tail(log: Path, chars: int = 2000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def replica_command(state: ClusterState, replica_id: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "serving", "--port", str(port), "--data-dir", str(state.data_dir),
        "--store", state.store_url, "--scheduler-redis-url", state.redis_url, "--replica-id", replica_id,
        *state.serve_args,
    ]  # fmt: skip


def start_replica(
    state: ClusterState, replica_id: str, port: int | None = None, num_replicas: int | None = None
) -> Replica:
    """Starts one replica (not waiting for it); `port`: the replica's old port when it is restarted."""
    port = port or free_port()
    log = Path(state.root) / "logs" / f"{replica_id}.log"
    env = replica_env(num_replicas or max(1, len(state.replicas)))
    return Replica(replica_id, port, spawn(replica_command(state, replica_id, port), log, env), str(log))


def write_router_config(state: ClusterState) -> Path:
    servers = "\n".join(f"    server {r.id} 127.0.0.1:{r.port} check" for r in state.replicas)
    text = HAPROXY_CONFIG.read_text().replace("$bind", f"127.0.0.1:{state.router_port}")
    text = text.replace("$servers", servers)
    path = Path(state.root) / "haproxy.cfg"
    path.write_text(text)
    return path


def pg_location(root: Path) -> Path:
    """Where the cluster's PostgreSQL keeps its files: `root/pg`, or, when the server must run as the
    `postgres` user (we are root) and cannot reach `root` (a private parent such as pytest's tmp dirs), a
    directory under the system temp dir, remembered in `root/pg-location` so a later `up` finds it again."""
    pointer = root / "pg-location"
    if pointer.is_file():
        where = Path(pointer.read_text().strip())
        # written by an older `up`: the temp dir, not the PostgreSQL directory inside it
        return where / "pg" if (where / "pg").is_dir() and not (where / "data").is_dir() else where
    if os.geteuid() != 0 or _others_can_reach(root):
        return root / "pg"
    where = Path(tempfile.mkdtemp(prefix="kvmem-cluster-pg-"))
    where.chmod(0o755)
    pointer.write_text(f"{where / 'pg'}\n")
    return where / "pg"


def _others_can_reach(path: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents] if p.exists())


def up(root: Path, replicas: int, serve_args: list[str], *, wait_s: float = 600.0) -> ClusterState:
    """Starts PostgreSQL, Redis, `replicas` replicas and the router under `root`; returns what it started."""
    if replicas < 1:
        raise ClusterError(f"--replicas must be at least 1, got {replicas}")
    root = root.resolve()
    old = ClusterState.load(root)
    if old is not None and any(alive(r.pid) for r in old.replicas):
        raise ClusterError(
            f"a cluster is already up in {root} (run `scripts/cluster.sh down --dir {root}` first)"
        )
    haproxy = need("haproxy", "haproxy")
    need("redis-server", "redis-server")
    if old is not None:  # a cluster whose replicas are gone (an `up` that was killed): stop what is left
        down(root)
    try:
        return _start(root, replicas, serve_args, haproxy, wait_s)
    except BaseException:
        down(root)  # what was started before the failure
        raise


def _start(root: Path, replicas: int, serve_args: list[str], haproxy: str, wait_s: float) -> ClusterState:
    root.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    pg_root = pg_location(root)
    state = ClusterState(
        root=str(root), router_port=free_port(), router_pid=0, redis_port=free_port(), redis_pid=0,
        pg_root=str(pg_root), pg_port=0, pg_as_postgres=os.geteuid() == 0, serve_args=list(serve_args),
    )  # fmt: skip
    state.save()  # before anything starts: from here on, `down` can stop what was started
    try:
        if (pg_root / "data").is_dir():  # a cluster brought down before: its memories are kept
            pg = PgServer(pg_root, free_port(), find_bin_dir() or Path("/nonexistent"), state.pg_as_postgres)
            pg.start()
        else:
            pg = start_server(pg_root)
            pg.create_database(DATABASE)
    except PgServerError as e:
        raise ClusterError(f"PostgreSQL could not be started in {pg_root}: {e}") from e
    state.pg_port = pg.port
    state.save()
    state.redis_pid = start_redis(state)
    state.save()
    state.replicas = [start_replica(state, f"r{i + 1}", num_replicas=replicas) for i in range(replicas)]
    state.save()
    for r in state.replicas:
        wait_http(f"{r.url}/health", r.pid, wait_s, f"replica {r.id}", Path(r.log))
    config = write_router_config(state)
    state.router_pid = spawn([haproxy, "-db", "-f", str(config)], logs / "haproxy.log")
    state.save()
    wait_http(
        f"{state.router_url}/health", state.router_pid, 30, "the router (haproxy)", logs / "haproxy.log"
    )
    return state


def start_redis(state: ClusterState) -> int:
    """Starts redis-server on the cluster's Redis port (append-only file in `root/redis`, so a restart keeps
    the queue and the fences); returns its pid once it answers PING."""
    root = Path(state.root)
    (root / "redis").mkdir(exist_ok=True)
    log = root / "logs" / "redis.log"
    pid = spawn(
        [
            need("redis-server", "redis-server"),
            "--bind",
            "127.0.0.1",
            "--port",
            str(state.redis_port),
            "--dir",
            str(root / "redis"),
            "--appendonly",
            "yes",
            "--save",
            "",
        ],  # fmt: skip
        log,
    )
    _wait_redis(state.redis_port, pid, log)
    return pid


def _wait_redis(port: int, pid: int, log: Path) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        if not alive(pid) or time.monotonic() > deadline:
            raise ClusterError(
                f"redis-server did not start on 127.0.0.1:{port}; the end of {log}:\n{_tail(log)}"
            )
        time.sleep(0.1)


def stop_pid(pid: int, timeout_s: float = 20.0) -> bool:
    """SIGTERM, then SIGKILL after `timeout_s`; True when it was running."""
    if pid <= 0 or not alive(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
    return True


def down(root: Path) -> list[str]:
    """Stops everything `up` started under `root` (its memories stay in `root`); returns what was running."""
    state = ClusterState.load(root.resolve())
    if state is None:
        return []
    stopped = [f"replica {r.id}" for r in state.replicas if stop_pid(r.pid)]
    if stop_pid(state.router_pid):
        stopped.append("router")
    if stop_pid(state.redis_pid):
        stopped.append("redis")
    if (Path(state.pg_root) / "data" / "postmaster.pid").exists():  # started, or starting
        pg = state.pg()  # ClusterError if its binaries are gone: cluster.json stays for the next `down`
        if pg.running():
            pg.stop()
            if pg.running():
                raise ClusterError(
                    f"PostgreSQL in {state.pg_root} did not stop (see its server.log); cluster.json is kept, "
                    "so `scripts/cluster.sh down` can be run again"
                )
            stopped.append("postgresql")
    (Path(state.root) / STATE_FILE).unlink(missing_ok=True)
    return stopped

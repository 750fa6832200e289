"""A throwaway PostgreSQL server on loopback, for tests and benchmarks of the PostgreSQL store.

Owns finding Debian's server binaries (`/usr/lib/postgresql/<version>/bin`, or on PATH), `initdb` into a
directory owned by the `postgres` system user, starting the server as that user when run as root (PostgreSQL
refuses root), listening on 127.0.0.1 on a free port with trust authentication and its socket in the data
dir, creating databases, stopping it. Knows nothing of the store's tables.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


class PgServerError(RuntimeError):
    """The server binaries are missing, or initdb or the server's start failed (the message says which)."""


def find_bin_dir() -> Path | None:
    """The directory holding `initdb` and `pg_ctl`: the newest /usr/lib/postgresql/*/bin, else PATH's."""
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0,
    )
    if versions:
        return Path(versions[-1]).parent
    found = shutil.which("pg_ctl")
    return Path(found).resolve().parent if found and shutil.which("initdb") else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PgServer:
    """A running server: `url(db)` is the URL of one of its databases (user `postgres`, no password)."""

    root: Path
    port: int
    bin_dir: Path
    as_postgres: bool

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            raise PgServerError(f"{' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def start(self) -> None:
        """Starts the (initialized) server and waits until it accepts connections."""
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.root / "server.log"), "-o", options,
                  "-w", "-t", "60", "start")  # fmt: skip

    def running(self) -> bool:
        return self._run("pg_ctl", "-D", str(self.data_dir), "status", check=False).returncode == 0

    def start_if_stopped(self) -> None:
        """Starts the server if a test stopped it and did not start it again."""
        if not self.running():
            self.start()

    def stop(self) -> None:
        """Stops the server now (fast shutdown: open sessions are disconnected)."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop", check=False)

    def create_database(self, name: str) -> str:
        """Creates database `name` (from template0, cheap) and returns its URL."""
        import psycopg

        if not re.fullmatch(r"[A-Za-z0-9_]{1,63}", name):
            raise ValueError(f"database name must be 1-63 letters, digits or '_', got {name!r}")
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return self.url(name)

    def close(self) -> None:
        """Stops the server and removes its directory."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def start_server(root: str | os.PathLike | None = None) -> PgServer:
    """initdb into `root` (a new temp dir if None) and start a server there; PgServerError if impossible.

    As root, the directory is handed to the `postgres` system user and the server runs as that user.
    """
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise PgServerError(
            "PostgreSQL server binaries (initdb, pg_ctl) not found; apt-get install postgresql"
        )
    as_postgres = os.geteuid() == 0
    base = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="kvmem-pg-"))
    base.mkdir(parents=True, exist_ok=True)
    if as_postgres:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError as e:
            raise PgServerError(
                "running as root needs the `postgres` system user (apt-get install postgresql)"
            ) from e
        os.chown(base, user.pw_uid, user.pw_gid)
        base.chmod(0o700)
    server = PgServer(root=base, port=_free_port(), bin_dir=bin_dir, as_postgres=as_postgres)
    server._run("initdb", "-D", str(server.data_dir), "-U", "postgres", "--auth=trust", "--locale=C.UTF-8",
                "--encoding=UTF8")  # fmt: skip
    try:
        server.start()
    except PgServerError as e:
        log = server.root / "server.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise PgServerError(f"{e}\n{tail}") from e
    deadline = time.monotonic() + 30
    while True:  # pg_ctl -w waited for the socket; make sure TCP answers too
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise PgServerError(f"PostgreSQL did not listen on 127.0.0.1:{server.port}") from None
            time.sleep(0.1)
    return server

"""A real PostgreSQL server on loopback for tests: one per test session, a fresh database per test.

Use from any test module: `from tests.pg import pg_server, pg_url  # noqa: F401` (pytest finds fixtures
imported into the module; a test taking them as arguments then needs `# noqa: F811` for ruff), then take
`pg_url` (a new empty database's URL, `postgresql://postgres@127.0.0.1:<port>/<db>`) or `pg_server`
(kvmem.text.db.pg_server.PgServer: `.url(db)`, `.create_database(name)`, `.port`, `.stop()` / `.start()` to take
it away and bring it back; `pg_url` restarts it if a test left it stopped). The server binaries come from Debian's
`postgresql` package, installed with apt if missing (the test skips if that fails); as root the server runs
as the `postgres` system user (PostgreSQL refuses root).
"""

from __future__ import annotations

import itertools

import pytest

from kvmem.text.db.pg_server import PgServer, PgServerError, find_bin_dir, start_server
from tests import debian

_names = itertools.count()


def _ensure_binaries() -> None:
    debian.ensure("pg_ctl", "postgresql", find=find_bin_dir)


_shared: list[PgServer] = []  # the process's one server, however many modules import the fixtures
_users = [0]


@pytest.fixture(scope="session")
def pg_server() -> PgServer:
    """The session's server (started on first use, stopped and removed at the session's end). One per
    process: each module that imports this fixture gets its own session fixture, all on the same server."""
    pytest.importorskip("psycopg")
    if not _shared:
        _ensure_binaries()
        try:
            _shared.append(start_server())
        except PgServerError as e:
            pytest.skip(f"could not start PostgreSQL: {e}")
    _users[0] += 1
    yield _shared[0]
    _users[0] -= 1
    if _users[0] == 0:
        _shared.pop().close()


@pytest.fixture
def pg_url(pg_server: PgServer) -> str:
    """A new, empty database of the session's server (so tests never see each other's rows)."""
    pg_server.start_if_stopped()
    return pg_server.create_database(f"t{next(_names)}")

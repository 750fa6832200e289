"""Debian packages a test needs (redis-server, postgresql, haproxy), installed with apt when missing.

`ensure(binary, package)` returns the binary's path, or skips the test when apt could not install it (a
machine without the package registry); CI's machines reach it, so there the test runs.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def which(binary: str) -> str | None:
    return shutil.which(binary) or shutil.which(binary, path=_PATH)


def ensure(binary: str, package: str, find: Callable[[], str | Path | None] | None = None) -> str:
    """The path of `binary` (located by `find` when given: e.g. PostgreSQL's server binaries live off PATH),
    installing `package` with apt first if it is missing."""
    locate = find or (lambda: which(binary))
    path = locate()
    if path:
        return str(path)
    # one apt at a time on this machine: test workers running side by side (pytest-xdist) would otherwise
    # fail on dpkg's lock; the second finds the package installed once the first is done
    with open("/tmp/kvmem-tests-apt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = locate()
        if path:
            return str(path)
        return _install(package, locate)


def _install(package: str, locate: Callable[[], str | Path | None]) -> str:
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": _PATH}
    subprocess.run(["apt-get", "update"], check=False, capture_output=True, env=env, timeout=600)
    proc = subprocess.run(
        ["apt-get", "install", "-y", package],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    path = locate()
    if not path:
        pytest.skip(f"{package} could not be installed with apt: {proc.stderr.strip()[-300:]}")
    return str(path)

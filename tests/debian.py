"""Debian packages a test needs (redis-server, postgresql, haproxy), installed with apt when missing.

`ensure(binary, package)` returns the binary's path, or skips the test when apt could not install it (a
machine without the package registry); CI's machines reach it, so there the test runs.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def which(binary: str) -> str | None:
    return shutil.which(binary) or shutil.which(binary, path=_PATH)


def ensure(binary: str, package: str, found: str | Path | None = None) -> str:
    """The path of `binary` (or `found` when the caller located it), installing `package` with apt first if
    it is missing."""
    path = found or which(binary)
    if path:
        return str(path)
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
    path = which(binary)
    if not path:
        pytest.skip(f"{package} could not be installed with apt: {proc.stderr.strip()[-300:]}")
    return path

"""Where each tier keeps its files under one data dir (default `./.kvmem`).

Only paths: creating, locking and cleaning are the owning stores' business.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA_DIR = ".kvmem"


@dataclass(frozen=True)
class DataDir:
    root: Path

    @classmethod
    def at(cls, root: str | os.PathLike | None = None) -> DataDir:
        return cls(Path(root if root is not None else DEFAULT_DATA_DIR))

    @property
    def kv_dir(self) -> Path:
        return self.root / "kv"

    @property
    def text_db(self) -> Path:
        return self.root / "memories.sqlite"

    @property
    def scheduler_dir(self) -> Path:
        return self.root / "scheduler"

    @property
    def adapters_dir(self) -> Path:
        return self.root / "adapters"

"""The layout's rules, read from the source by scripts/layout_report.py: layers import only downward
(kvmem <- scheduler <- serving; inside serving, the engine knows no backend or route), and no two modules
import each other. A fixture tree shows each rule fails when broken."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("layout_report", ROOT / "scripts" / "layout_report.py")
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)


def test_no_module_imports_a_layer_above_it():
    assert layout.upward(layout.graph()) == []


def test_no_two_modules_import_each_other():
    assert layout.cycles(layout.graph()) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_rules_catch_a_cycle_an_upward_import_and_a_lazy_one(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kvmem/__init__.py": "",
            "kvmem/a.py": "from kvmem import b\n",
            "kvmem/b.py": "def f():\n    from kvmem.a import x\n",  # inside a function: still an import
            "scheduler/__init__.py": "",
            "serving/__init__.py": "",
            "serving/engine/__init__.py": "",
            "serving/engine/pages.py": "from serving.backends.base import PoolFull\nfrom kvmem import a\n",
            "serving/backends/__init__.py": "",
            "serving/backends/base.py": "from .. import engine\n",
            "benchmarks/__init__.py": "",
        },
    )
    g = layout.graph(root)
    assert layout.cycles(g) == [("kvmem.a", "kvmem.b")]
    assert layout.upward(g) == [("serving.engine.pages", "serving.backends.base")]

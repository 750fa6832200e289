"""The layout's figures: import cycles between modules, imports that go up a layer, files per folder and lines
per module, read from the source (ast; nothing is imported or run).

    .venv/bin/python scripts/layout_report.py [--out FILE.json]

Prints one JSON document. tests/test_layout.py asserts its rules (no cycles, no upward imports); the line and
folder counts are figures for a reader (the house style splits a module past ~400 lines), not a test.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvmem", "scheduler", "serving", "benchmarks")
# who may import whom: a package (or subpackage) never imports one listed after it here
LAYERS = {
    "kvmem": ("scheduler", "serving", "benchmarks"),
    "scheduler": ("serving", "benchmarks"),
    "serving": ("benchmarks",),
    # inside serving: the engine knows no backend, route or command; the backends know no route
    "serving.engine": (
        "serving.backends",
        "serving.http",
        "serving.chat",
        "serving.background",
        "serving.ops",
    ),
    "serving.backends": ("serving.http", "serving.chat", "serving.background", "serving.ops"),
    "serving.chat": ("serving.background", "serving.ops"),
}
LONG_MODULE_LINES = 450


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages (result and data folders left out)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            if "results" in rel.parts or "__pycache__" in rel.parts:
                continue
            name = ".".join(rel.with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `name` imports anywhere in its file (inside functions too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    resolved = set()
    for target in found:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def cycles(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of modules that import each other (a package and its own submodule do not count)."""
    pairs = set()
    for a, targets in g.items():
        for b in targets:
            if a in g.get(b, ()) and not (_within(a, b) or _within(b, a)):
                pairs.add(tuple(sorted((a, b))))
    return sorted(pairs)


def upward(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs that break LAYERS, the most specific rule for the importer applying."""
    bad = []
    for a, targets in g.items():
        rules = [p for p in LAYERS if _within(a, p)]
        if not rules:
            continue
        forbidden = LAYERS[max(rules, key=len)]
        bad.extend((a, b) for b in sorted(targets) if any(_within(b, f) for f in forbidden))
    return sorted(bad)


def report(root: Path = ROOT) -> dict:
    known = modules(root)
    g = {name: imports(name, path, known) for name, path in known.items()}
    lines = {name: len(path.read_text().splitlines()) for name, path in known.items()}
    folders = collections.Counter(str(path.parent.relative_to(root)) for path in known.values())
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    return {
        "git_sha": sha.stdout.strip() or None,
        "modules": len(known),
        "lines": sum(lines.values()),
        "import_cycles": cycles(g),
        "upward_imports": upward(g),
        "files_per_folder": dict(sorted(folders.items())),
        "most_files_in_a_folder": max(folders.values()),
        f"modules_over_{LONG_MODULE_LINES}_lines": sorted(
            ([m, n] for m, n in lines.items() if n > LONG_MODULE_LINES), key=lambda mn: -mn[1]
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    text = json.dumps(report(), indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

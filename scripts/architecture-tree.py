"""Print the module tree of docs/architecture.md: every module with its first docstring line.

Run from the repository root: `python scripts/architecture-tree.py`. tests/architecture checks
that docs/architecture.md holds exactly this output.
"""

from __future__ import annotations

import ast
from pathlib import Path

TOPS = ("slurmgate", "blocks", "tasks", "flows", "deployments")
SKIPPED = {"__pycache__", "data", "py.typed"}


def first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.splitlines()[0] if doc else ""


def entries(folder: Path, depth: int) -> list[tuple[str, str | None]]:
    """(label, docstring line) per file; folders have None and carry their line in the label."""
    rows: list[tuple[str, str | None]] = []
    children = sorted(folder.iterdir(), key=lambda p: (p.is_dir(), p.name))
    for path in children:
        if path.name in SKIPPED or path.name == "__init__.py":
            continue
        indent = "  " * depth
        if path.is_dir():
            init = path / "__init__.py"
            rows.append((f"{indent}{path.name}/  {first_line(init)}".rstrip(), None))
            rows += entries(path, depth + 1)
        elif path.suffix == ".py":
            rows.append((f"{indent}{path.name}", first_line(path)))
    return rows


def tree(root: Path) -> str:
    rows: list[tuple[str, str | None]] = []
    for top in TOPS:
        init = root / top / "__init__.py"
        line = first_line(init) if init.exists() else ""
        rows.append((f"{top}/  {line}".rstrip(), None))
        rows += entries(root / top, 1)
    width = max(len(label) for label, doc in rows if doc is not None) + 2
    return "\n".join(label if doc is None else label.ljust(width) + doc for label, doc in rows)


if __name__ == "__main__":
    print(tree(Path.cwd()))

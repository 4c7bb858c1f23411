"""Hostile YAML documents, read under bounds: size, aliases, nesting and expanded node count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, SequenceNode

from slurmgate.errors import InputError

MAX_DOCUMENT_BYTES = 1 << 20
# Anchors and aliases are legitimate YAML (`<<: *common`), but each alias may stand for a whole
# subtree: a few chained ones make a few hundred bytes expand to billions of nodes for any walk
# that follows them. These bounds are far above what a spec or a recipe needs.
MAX_ALIASES = 256
MAX_EXPANDED_NODES = 100_000
MAX_DEPTH = 64


class DocumentError(InputError):
    """A YAML document that is too large, malformed, or expands past the bounds."""

    def __init__(self, problem: str, fix: str, source: str = "") -> None:
        self.source, self.problem, self.fix = source, problem, fix
        super().__init__(f"{source}: {problem}; {fix}" if source else f"{problem}; {fix}")

    def at(self, source: str) -> DocumentError:
        return DocumentError(self.problem, self.fix, source)


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, counting aliases as it composes so a bomb stops early."""

    aliases = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:  # type: ignore[override]
        if self.check_event(AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise DocumentError(
                    f"uses more than {MAX_ALIASES} YAML aliases (*name)",
                    "write the repeated parts out",
                )
        return super().compose_node(parent, index)  # type: ignore[no-any-return]


def _measure(root: Node) -> tuple[int, int]:
    """(expanded node count, depth) of a composed document, each shared node measured once."""
    memo: dict[int, tuple[int, int]] = {}
    active: set[int] = set()

    def visit(node: Node) -> tuple[int, int]:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:
            raise DocumentError(
                "holds a recursive YAML alias (a node that contains itself)", "remove the loop"
            )
        active.add(key)
        children: list[Node] = []
        if isinstance(node, SequenceNode):
            children = list(node.value)
        elif isinstance(node, MappingNode):
            children = [part for pair in node.value for part in pair]
        size, depth = 1, 0
        for child in children:
            child_size, child_depth = visit(child)
            size = min(size + child_size, MAX_EXPANDED_NODES + 1)
            depth = max(depth, child_depth + 1)
        active.discard(key)
        memo[key] = (size, depth)
        return memo[key]

    return visit(root)


def parse_yaml(
    text: str, source: str, *, max_bytes: int = MAX_DOCUMENT_BYTES, kind: str = "YAML"
) -> Any:
    """The one YAML document in `text`, or DocumentError naming `source` and the fix.

    Bounded before anything walks it: its size, its alias count, its nesting depth, and the
    number of nodes it expands to once every alias is followed.
    """
    if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise DocumentError(f"larger than {max_bytes // 1024} KiB", "shorten it", source)
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size, depth = _measure(node)
        if size > MAX_EXPANDED_NODES:
            raise DocumentError(
                f"expands to more than {MAX_EXPANDED_NODES} nodes once its aliases are followed",
                "write the repeated parts out or use fewer aliases",
            )
        if depth > MAX_DEPTH:
            raise DocumentError(f"nests deeper than {MAX_DEPTH} levels", "flatten it")
        return loader.construct_document(node)
    except DocumentError as exc:
        raise exc.at(source) from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        problem = getattr(exc, "problem", None) or "a syntax error"
        raise DocumentError(f"not valid {kind}{at}: {problem}", "fix the syntax", source) from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path, *, max_bytes: int = MAX_DOCUMENT_BYTES, kind: str = "YAML") -> Any:
    """The YAML document in the regular file `path`, read under `max_bytes` (see `parse_yaml`)."""
    p = Path(path)
    try:
        with p.open("rb") as handle:
            raw = handle.read(max_bytes + 1)
    except OSError as exc:
        raise DocumentError(
            f"cannot read it ({exc.strerror or exc})", "check the path", str(p)
        ) from None
    if len(raw) > max_bytes:
        raise DocumentError(f"larger than {max_bytes // 1024} KiB", "shorten it", str(p))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DocumentError("not UTF-8 text", "save it as UTF-8", str(p)) from None
    return parse_yaml(text, str(p), max_bytes=max_bytes, kind=kind)

"""The tree keeps its shape: the core never reaches the Prefect layer, and nothing imports in a
circle. Read from the source with `ast`, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = "slurmgate"
# The Prefect layer: top-level folders of the repository, installed under the core's namespace
# (pyproject.toml's package-dir), so `flows/reconcile.py` is `slurmgate.flows.reconcile`.
PREFECT_LAYER = ("blocks", "tasks", "flows", "deployments")
LAYER_PACKAGES = tuple(f"{CORE}.{folder}" for folder in PREFECT_LAYER)
# The one door from the core into the Prefect layer: the CLI commands that run a flow.
DOOR = "slurmgate.cli.prefect_layer"
PARTS = (
    "admission",
    "ci",
    "cli",
    "controller",
    "github",
    "runtime",
    "settings",
    "simulator",
    "slurm",
    "testbed",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in PREFECT_LAYER:
        parts.insert(0, CORE)
    return ".".join(parts)


def modules(*folders: str) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            # slurmgate/data holds other projects' files byte for byte (sa-bench), not modules
            if path.relative_to(REPO).parts[:2] != (CORE, "data"):
                found[module_name(path)] = path
    return found


def layer(module: str) -> str | None:
    """The Prefect-layer package a module name belongs to (`slurmgate.flows`), or None."""
    return next((p for p in LAYER_PACKAGES if module == p or module.startswith(f"{p}.")), None)


def imports_of(name: str, path: Path) -> Iterator[str]:
    """Every module name an import statement in the file names, at any depth of the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            yield "importlib.import_module"


def top(module: str) -> str:
    return module.partition(".")[0]


def test_the_core_never_imports_prefect_or_the_prefect_layer() -> None:
    offenders = []
    for name, path in modules(CORE).items():
        for imported in imports_of(name, path):
            if imported == "importlib.import_module":
                offenders.append(f"{name}: importlib.import_module hides an import from mypy")
            elif top(imported) in ("prefect", "prefect_shell") or (
                layer(imported) and name != DOOR
            ):
                offenders.append(f"{name} imports {imported}")
    assert offenders == []


def test_the_door_reaches_only_flows_and_the_packaged_deployments() -> None:
    path = modules(CORE)[DOOR]
    imported = list(imports_of(DOOR, path))
    reached = {layer(m) for m in imported} - {None}
    assert "prefect" not in {top(m) for m in imported}
    assert reached == {"slurmgate.flows", "slurmgate.deployments"}


def test_the_core_has_one_folder_per_part() -> None:
    folders = {p.name for p in (REPO / CORE).iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(PARTS)
    loose = sorted(p.name for p in (REPO / CORE).glob("*.py") if p.name != "__init__.py")
    assert loose == [
        "documents.py",
        "errors.py",
        "paths.py",
        "prefect_db.py",
        "progress.py",
        "serving.py",
    ], loose


def import_graph(*packages: str) -> dict[str, set[str]]:
    found = modules(*packages)
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        for imported in imports_of(name, path):
            while imported and imported not in found:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                graph[name].add(imported)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_in_a_circle() -> None:
    assert cycles(import_graph(CORE, *PREFECT_LAYER)) == []


def test_the_layer_folders_are_the_namespace_packages_pyproject_installs() -> None:
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {f"{CORE}.{f}": f for f in PREFECT_LAYER}
    packages = {
        module_name(path.parent)
        for folder in (CORE, *PREFECT_LAYER)
        for path in (REPO / folder).rglob("__init__.py")
        if path.relative_to(REPO).parts[:2] != (CORE, "data")
    }
    assert sorted(setuptools["packages"]) == sorted(packages)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_admission_core_does_not_depend_on_its_adapters() -> None:
    """Policy apart from mechanism: admission reads GitHub through the protocols it declares."""
    graph = import_graph(CORE)
    leaks = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name.startswith("slurmgate.admission.")
        for target in targets
        if target.startswith(("slurmgate.github", "slurmgate.runtime", "slurmgate.cli"))
    )
    assert leaks == []


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        # runs once per node inside the allocation: the standard library only, so it starts fast
        ("slurmgate.runtime.steps.node_worker", ("pydantic", "httpx", "prefect", "typer", "yaml")),
        # the logical endpoint runs on the client host for the whole allocation
        ("slurmgate.runtime.endpoint.app", ("prefect", "typer", "httpx")),
        ("slurmgate.cli.app", ("prefect",)),
    ],
)
def test_compute_node_entry_points_load_no_heavy_packages(
    module: str, forbidden: tuple[str, ...]
) -> None:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    assert {top(m) for m in loaded} & set(forbidden) == set()


# Exceptions that are signals or answers, not errors of slurmgate's.
NOT_ERRORS = {
    "slurmgate.testbed.emulator.app.ApiError",  # the emulator's way to answer GitHub's error JSON
    "slurmgate.testbed.stub_pd.PairingError",  # the stub's way to answer a pairing failure
}


def test_every_error_slurmgate_raises_is_in_the_family() -> None:
    import importlib

    from slurmgate.errors import ExternalError, InputError

    outside = []
    for name in modules(CORE):
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == name
                and f"{name}.{value.__qualname__}" not in NOT_ERRORS
                and value.__module__ != "slurmgate.errors"
                and not issubclass(value, InputError | ExternalError)
            ):
                outside.append(f"{name}.{value.__qualname__}")
    assert outside == []


def test_every_module_says_its_job_in_its_first_docstring_line() -> None:
    missing = []
    for name, path in modules(CORE, *PREFECT_LAYER).items():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if not doc or not doc.splitlines()[0].strip():
            missing.append(name)
    assert missing == []


# A distribution's import name, where the two differ.
IMPORT_NAMES = {"pydantic-settings": "pydantic_settings", "prometheus-client": "prometheus_client"}
IMPORT_NAMES |= {"pyyaml": "yaml", "uvicorn[standard]": "uvicorn", "prefect-shell": "prefect_shell"}
IMPORT_NAMES |= {"PyJWT[crypto]": "jwt"}


def test_every_runtime_dependency_is_imported() -> None:
    """A pinned dependency that nothing imports is weight every install carries for nothing."""
    import re
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~ ]", spec, maxsplit=1)[0] for spec in project["dependencies"]}
    imported = {
        top(module)
        for name, path in modules(CORE, *PREFECT_LAYER).items()
        for module in imports_of(name, path)
    }
    unused = sorted(d for d in declared if IMPORT_NAMES.get(d, d) not in imported)
    assert unused == []


def test_the_architecture_doc_lists_every_module_as_it_is() -> None:
    tree = subprocess.run(
        [sys.executable, "scripts/architecture-tree.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert f"```\n{tree}```" in doc, "regenerate the tree: python scripts/architecture-tree.py"


TESTBED = "slurmgate.testbed"
# The testbed's own doors: the commands and the demo driver that start its stand-ins. Nothing
# else imports it, so the product installs and runs without a line of the testbed.
TESTBED_DOORS = {
    "slurmgate.cli.testbed": "`slurmgate emulator`",
    "slurmgate.cli.cluster": "`slurmgate cluster up|down`, the bundled local cluster",
    "slurmgate.cli.demo": "`slurmgate demo`",
    "slurmgate.cli.prefect_layer": "the door's run_demo, for the demo's options type",
    "slurmgate.flows.demo": "the demo driver",
}


def test_product_code_never_imports_the_testbed() -> None:
    offenders = sorted(
        f"{name} imports {imported}"
        for name, path in modules(CORE, *PREFECT_LAYER).items()
        if not name.startswith(f"{TESTBED}.") and name != TESTBED and name not in TESTBED_DOORS
        for imported in imports_of(name, path)
        if imported == TESTBED or imported.startswith(f"{TESTBED}.")
    )
    assert offenders == []


# A module past this many lines answers more than one question; the testbed's stand-ins (the
# GitHub emulator's state, the soak) are not the product and may grow past it.
MAX_MODULE_LINES = 800
MAX_RUNTIME_TOP_MODULES = 8


def test_no_module_outside_the_testbed_is_over_the_line_limit() -> None:
    long = {
        name: n
        for name, path in modules(CORE, *PREFECT_LAYER).items()
        if not name.startswith(f"{CORE}.testbed")
        and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these by question (at most {MAX_MODULE_LINES} lines): {long}"


def test_the_runtime_keeps_its_rooms_in_folders() -> None:
    loose = sorted(
        p.name for p in (REPO / CORE / "runtime").glob("*.py") if p.name != "__init__.py"
    )
    assert len(loose) <= MAX_RUNTIME_TOP_MODULES, loose

"""The environment is read in few places: the settings tree's models, the values a step is
handed (`slurmgate/settings/handed.py`), and the variables Slurm sets (`slurmgate/slurm/jobenv.py`).
Read from the source with `ast`, so every form counts: `os.environ` and `os.environ.get`, a copy
with `dict(os.environ)`, `os.getenv`, and `environ` or `getenv` imported from `os`."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmgate.settings.root import Settings, variables

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("slurmgate", "blocks", "tasks", "flows", "deployments")

ALLOWED = {
    # what a node worker, lane, endpoint or client was handed, and what a child inherits:
    # the standard library only, since the node worker imports it on every node
    "slurmgate/settings/handed.py",
    # the variables Slurm sets in its processes (job, task, node) and SLURM_CONF
    "slurmgate/slurm/jobenv.py",
}
ENVIRONMENT_NAMES = {"environ", "environb", "getenv", "getenvb"}
# Writes for child processes, not reads: os.environ[NAME] = ..., del, setdefault, update.
WRITES = {"setdefault", "update"}


def environment_reads(source: str) -> list[int]:
    """The lines of `source` that read the environment directly."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    os_names = {"os"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and {a.name for a in node.names} & ENVIRONMENT_NAMES
        ):
            lines.append(node.lineno)
        if not (
            isinstance(node, ast.Attribute)
            and node.attr in ENVIRONMENT_NAMES
            and isinstance(node.value, ast.Name)
            and node.value.id in os_names
        ):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store | ast.Del):
            continue
        if (
            isinstance(parent, ast.Attribute)
            and parent.attr in WRITES
            and isinstance(parents.get(parent), ast.Call)
        ):
            continue
        lines.append(node.lineno)
    return sorted(lines)


def _modules() -> list[Path]:
    # slurmgate/data holds other projects' files byte for byte (sa-bench), not our modules
    data = REPO / "slurmgate" / "data"
    return sorted(
        p for folder in SOURCES for p in (REPO / folder).rglob("*.py") if data not in p.parents
    )


def test_only_the_allowed_modules_read_the_environment() -> None:
    readers = {
        f"{path.relative_to(REPO)}:{line}"
        for path in _modules()
        for line in environment_reads(path.read_text())
    }
    outside = sorted(r for r in readers if r.rsplit(":", 1)[0] not in ALLOWED)
    assert outside == [], (
        "read the environment through the settings tree (slurmgate/settings/), or, for what a "
        "step was handed or a child inherits, slurmgate/settings/handed.py; Slurm's own "
        "variables through slurmgate/slurm/jobenv.py"
    )


def test_the_allowed_modules_exist_and_read_it() -> None:
    for module in ALLOWED:
        assert environment_reads((REPO / module).read_text()), module


@pytest.mark.parametrize(
    "source",
    [
        "import os\nx = os.environ",
        "import os\nx = os.environ.get('A')",
        "import os\nx = os.environ['A']",
        "import os\nx = dict(os.environ)",
        "import os\nx = os.getenv('A')",
        "import os\nx = 'A' in os.environ",
        "import os as o\nx = o.environ.get('A')",
        "from os import environ\n",
        "from os import getenv\n",
        "def f():\n    import os\n    return os.environ.items()",
    ],
)
def test_every_form_of_a_read_is_found(source: str) -> None:
    assert environment_reads(source) != []


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos.environ['A'] = '1'",
        "import os\ndel os.environ['A']",
        "import os\nos.environ.setdefault('A', '1')",
        "import os\nos.environ.update(A='1')",
        "import os\nx = os.pathsep",
    ],
)
def test_writes_for_children_are_not_reads(source: str) -> None:
    assert environment_reads(source) == []


def test_every_variable_a_command_option_reads_is_in_the_tree() -> None:
    # Typer reads an option's `envvar` itself, where the reads above cannot see it
    declared = {found.name for found in variables()}
    options = {
        f"{path.relative_to(REPO)}:{node.lineno} {node.value.value}"
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.keyword)
        and node.arg == "envvar"
        and isinstance(node.value, ast.Constant)
    }
    assert options, "no option reads a variable: the scan is broken"
    outside = sorted(o for o in options if o.split(" ")[1] not in declared)
    assert outside == [], "declare each option's envvar in the settings tree (slurmgate/settings/)"


def test_every_variable_is_named_once_with_a_description() -> None:
    names = [found.name for found in variables()]
    for found in variables():
        assert found.info.description, f"{found.model.__name__}.{found.field} has no description"
    # the seed's two flags are read by admission and by the CI side, each its own part
    repeated = {n for n in names if names.count(n) > 1}
    assert repeated <= {"PRIORITY_SCHEDULER_ENABLED", "NODE_SLOT_SCHEDULER_ENABLED"}


def test_the_tree_loads_with_every_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("SLURMGATE_", "PREFECT_", "GITHUB_")) or name.endswith(
            "_SCHEDULER_ENABLED"
        ):
            monkeypatch.delenv(name)
    settings = Settings()
    assert settings.ledger.heartbeat_s == 60 and settings.admission.policy == "easy"


def test_docs_settings_md_is_what_the_generator_prints() -> None:
    generated = subprocess.run(
        [sys.executable, "scripts/settings-doc.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (REPO / "docs" / "settings.md").read_text() == generated, (
        "docs/settings.md is out of date: python scripts/settings-doc.py > docs/settings.md"
    )
    for found in variables():
        assert f"| `{found.name}` |" in generated, found.name


def test_the_defaults_the_readers_fall_back_on_are_the_trees() -> None:
    from slurmgate.runtime.ledger import heartbeat
    from slurmgate.runtime.run.node_failures import NodeFailureSettings
    from slurmgate.settings.runtime import LedgerSettings, NodeRetrySettings
    from slurmgate.settings.testbed import LocalClusterSettings
    from slurmgate.testbed import cluster

    ledger = LedgerSettings.model_fields
    assert ledger["heartbeat_s"].default == heartbeat.DEFAULT_INTERVAL_S
    assert ledger["reap_stale_s"].default == heartbeat.DEFAULT_STALE_AFTER_S
    retry = NodeRetrySettings.model_fields
    assert NodeFailureSettings() == NodeFailureSettings(
        retry=retry["node_retry"].default, drain=retry["drain_failed_nodes"].default
    )
    local = LocalClusterSettings.model_fields
    assert (
        local["local_dir"].default,
        local["local_mode"].default,
    ) == (cluster.DEFAULT_DIR, cluster.DEFAULT_MODE)

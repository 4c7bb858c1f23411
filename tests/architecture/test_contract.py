"""The contract between the parts (import-linter) holds, and breaks on an import that points back
up the layers, whether it is lazy (inside a function) or only for the type checker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "contracts.sh"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
TREE = ("slurmgate", "blocks", "tasks", "flows", "deployments")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter not installed")


def check(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLURMGATE_CONTRACT_ROOT": str(root), "LINT_IMPORTS": str(LINT_IMPORTS)}
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The package's tree and pyproject.toml, copied: plants never touch the checkout."""
    root = tmp_path / "tree"
    root.mkdir()
    ignore = shutil.ignore_patterns("__pycache__")
    for folder in TREE:
        shutil.copytree(REPO / folder, root / folder, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def plant(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + code)


def test_the_contract_holds_on_the_checkout() -> None:
    result = check(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


LAZY = "def _planted() -> None:\n    from slurmgate.runtime.run import supervisor  # noqa\n"
TYPE_ONLY = (
    "from typing import TYPE_CHECKING\n\n"
    "if TYPE_CHECKING:\n    from slurmgate.controller.steps import slurm_capacity_step  # noqa\n"
)
INNER = "def _planted() -> None:\n    from slurmgate.runtime.run import state  # noqa\n"


@pytest.mark.parametrize(
    ("module", "code", "broken"),
    [
        # admission below the runtime: a lazy import inside a function points back up
        ("slurmgate/admission/model.py", LAZY, "The parts, in layers BROKEN"),
        # the Slurm adapter below the controller: an import only the type checker sees
        ("slurmgate/slurm/commands.py", TYPE_ONLY, "The parts, in layers BROKEN"),
        # inside the runtime: what srun starts may not reach back into the run that starts it
        ("slurmgate/runtime/steps/readiness.py", INNER, "The runtime's rooms, in layers BROKEN"),
    ],
    ids=["lazy", "type-checking", "runtime-rooms"],
)
def test_an_import_back_up_the_layers_breaks_the_contract(
    copy: Path, module: str, code: str, broken: str
) -> None:
    plant(copy / module, code)
    result = check(copy)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout


def test_a_cycle_between_sibling_packages_breaks_the_contract(copy: Path) -> None:
    # the emulator and the board share the testbed's one layer: only acyclicity guards them
    plant(
        copy / "slurmgate/testbed/emulator/state.py",
        "def _planted() -> None:\n    from slurmgate.testbed import board  # noqa\n",
    )
    plant(
        copy / "slurmgate/testbed/board.py",
        "def _planted() -> None:\n    from slurmgate.testbed.emulator import state  # noqa\n",
    )
    result = check(copy)
    assert result.returncode != 0
    assert "No cycles between sibling packages, at any depth BROKEN" in result.stdout

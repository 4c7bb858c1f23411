"""What `make setup` installs from pyproject.toml: the license as an SPDX expression.

setuptools deprecates `project.license` as a TOML table (a warning on every install, three
times per `make setup`) and reads the SPDX string form from version 77 on.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LICENSE = "Apache-2.0"


def test_the_license_is_an_spdx_expression_not_a_table() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert project["license"] == LICENSE
    # a `License ::` classifier beside an expression is an error for setuptools >= 77
    assert not [c for c in project.get("classifiers", []) if c.startswith("License ::")]
    assert "setuptools>=77" in pyproject["build-system"]["requires"]
    # and the installed package (what pip built from it) carries the expression
    metadata = importlib.metadata.metadata("slurmgate")
    assert metadata["License-Expression"] == LICENSE
    assert metadata.get("License") is None

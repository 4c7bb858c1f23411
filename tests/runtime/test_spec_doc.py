"""docs/spec.md is generated from the spec's models and the engine profiles, and kept in step."""

from __future__ import annotations

import subprocess
import sys

from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.deployment import DeploymentSpec

from .conftest import REPO

DOC = REPO / "docs" / "spec.md"


def _generated() -> str:
    return subprocess.run(
        [sys.executable, "scripts/spec-doc.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_docs_spec_md_is_what_the_generator_prints() -> None:
    assert DOC.read_text() == _generated(), (
        "docs/spec.md is out of date: python scripts/spec-doc.py > docs/spec.md"
    )


def test_the_page_lists_every_field_and_every_engine_with_its_metric() -> None:
    page = _generated()
    for name in [*AllocationSpec.model_fields, *DeploymentSpec.model_fields, "hooks", "prolog"]:
        assert f"| `{name}` |" in page, name
    for profile in engines.PROFILES.values():
        assert f"### `{profile.name}`" in page
        assert f"waiting `{profile.queue.waiting}`, running `{profile.queue.running}`" in page
    assert "--dist-init-addr HEAD_ADDR:19000" in page  # the flags come from the profile itself

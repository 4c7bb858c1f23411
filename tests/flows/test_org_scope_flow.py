"""The reconcile flow on an inline org scope: the repositories whose jobs it reads come from its
`repos` or `all_repos` parameters (what `slurmgate reconcile --once --org` passes)."""

from __future__ import annotations

import pytest

from slurmgate.flows.reconcile import reconcile
from slurmgate.testbed.emulator.testing import running_emulator

REPOS = ["acme/gpu-ci", "acme/serving", "acme/training"]


def _labels(token: str) -> list[str]:
    return ["self-hosted", "cluster:a", "nodes:1", f"ci-job-1.000-{token}", "ci-attempt-1"]


@pytest.mark.parametrize(
    ("scope", "admitted"),
    [({"repos": REPOS[1:]}, {"acme/serving", "acme/training"}), ({"all_repos": True}, set(REPOS))],
)
async def test_an_inline_org_scope_admits_the_jobs_of_the_repositories_it_names(
    monkeypatch: pytest.MonkeyPatch, scope: dict[str, object], admitted: set[str]
) -> None:
    with running_emulator({"a": 4}, repo=REPOS[0], repos=REPOS[1:]) as emu:
        monkeypatch.setenv("GITHUB_TOKEN", emu.token)
        ids = {emu.admin.add_job(_labels(r[5:]), 600, repo=r)["id"]: r for r in REPOS}
        summary = await reconcile(scope_block=None, api_url=emu.url, org="acme", **scope)  # type: ignore[arg-type]
        started = {ids[j] for j in ids if emu.job_placement(j)[0] == "in_progress"}
        assert summary["admitted"] == len(admitted) and started == admitted

"""The reconcile flow verifies skip-queue jobs: its snapshot read gets the flow's settings."""

from __future__ import annotations

from typing import Any

import pytest
from flowcheck import fleet, jobs_by_id, lease_of_job, wait_for

from slurmgate.flows.reconcile import reconcile


def labels(token: str, score: str, pr: int | None = None) -> list[str]:
    out = ["self-hosted", "cluster:x", "nodes:3", f"ci-job-{score}-{token}", "ci-attempt-1"]
    return [*out, f"ci-skip-queue-pr-{pr}"] if pr is not None else out


async def test_the_flow_admits_a_verified_skip_queue_job_first(
    emulator_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    emu = emulator_factory({"x": 3})
    for n in range(3):
        emu.admin.add_job(labels(f"q{n}", "5.000"), duration_s=600)
    skipper = emu.admin.add_job(labels("skip", "2.250", pr=42), 600, pull_request=42)["id"]
    emu.admin.label_pr(42, "skip_queue", "alice")
    emu.admin.set_team_member("gpu-admins", "alice")
    monkeypatch.setenv("SLURMGATE_SKIP_QUEUE_TEAM", "acme/gpu-admins")
    monkeypatch.setenv("GITHUB_TOKEN", emu.token)

    summary = await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo)

    assert (summary["admitted"], summary["blocked"], summary["errors"]) == (1, 3, 0)
    assert len(lease_of_job(fleet(emu.admin.dump()), skipper)) == 3
    running = lambda: jobs_by_id(emu.admin.dump())[skipper]["status"] == "in_progress"  # noqa: E731
    wait_for(running, what="the skip-queue job dispatched")

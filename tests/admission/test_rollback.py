"""Rolling the feature back the wrong way round (node slots on, priority off) keeps draining.

From the environment the combination counts as node slots off, with one warning per tick, and a
tick still releases the lease of a job that finished; the block form refuses it instead
(tests/blocks/test_policy_block.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from slurmgate.admission.tick import reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

GATE = ["ci-job-1.000-drain", "ci-attempt-1", "nodes:2"]


class Lines:
    """A TickLog that keeps what it was told."""

    def __init__(self) -> None:
        self.warnings: list[str] = []
        self.infos: list[str] = []

    def info(self, msg: str, *args: Any) -> None:
        self.infos.append(msg % args)

    def warning(self, msg: str, *args: Any) -> None:
        self.warnings.append(msg % args)


@pytest.fixture
def wrong_way_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_SLOT_SCHEDULER_ENABLED", "true")
    monkeypatch.setenv("PRIORITY_SCHEDULER_ENABLED", "false")


def _client(emu: RunningEmulator) -> GitHubClient:
    return GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), emu.token)


def _lease_labels(emu: RunningEmulator) -> set[str]:
    with emu.state.lock:
        return {
            name
            for runner in emu.state.runners.values()
            for name, _ in runner.labels
            if name.startswith("ci-lease-")
        }


def test_the_environment_reads_as_node_slots_off_with_a_warning(wrong_way_round: None) -> None:
    settings = AdmissionSettings()  # before: a ValidationError, and every tick exited 2
    assert settings.node_slots is False
    [warning] = settings.flag_warnings
    assert "NODE_SLOT_SCHEDULER_ENABLED=true is ignored" in warning
    assert "PRIORITY_SCHEDULER_ENABLED" in warning and "first" in warning
    assert AdmissionSettings(PRIORITY_SCHEDULER_ENABLED=True).flag_warnings == ()


async def test_a_wrong_way_tick_releases_a_finished_lease_and_admits_nothing(
    wrong_way_round: None,
) -> None:
    with running_emulator({"a": 4}) as emu:
        finished = emu.admin.add_job(["self-hosted", "cluster:a", *GATE], duration_s=600)["id"]
        # admitted while both flags were on: lease on runners 1 and 2, anchor 1, job running
        lease = f"ci-lease-j{finished}-a1-t1800000000"
        with emu.state.lock:
            emu.state.add_labels(emu.state.runners[2], [lease])
            emu.state.add_labels(emu.state.runners[1], [lease, *GATE])
        assert emu.state.jobs[finished].status == "in_progress"
        emu.admin.complete_job(finished)
        queued = ["self-hosted", "cluster:a", "ci-job-1.000-later", "ci-attempt-1", "nodes:1"]
        waiting = emu.admin.add_job(queued, duration_s=600)["id"]

        log = Lines()
        async with _client(emu) as client:
            report = await reconcile_tick(direct_steps(client), AdmissionSettings(), log=log)
            again = await reconcile_tick(direct_steps(client), AdmissionSettings(), log=log)

        assert report.released == 1 and report.failures == []
        assert _lease_labels(emu) == set()
        assert report.admitted == again.admitted == 0
        assert emu.state.jobs[waiting].status == "queued"
        # one warning per tick, in the tick's own log
        assert len(log.warnings) == 2
        assert all("NODE_SLOT_SCHEDULER_ENABLED=true is ignored" in w for w in log.warnings)


def test_status_reads_the_board_and_says_why_node_slots_are_off(wrong_way_round: None) -> None:
    from typer.testing import CliRunner

    from slurmgate.cli.app import app

    with running_emulator({"a": 2}) as emu:
        result = CliRunner().invoke(
            app,
            ["status", "--api-url", emu.url, "--repo", emu.repo, "--json"],
            env={"GITHUB_TOKEN": emu.token},
        )
    assert result.exit_code == 0, result.output  # it used to exit 2 on these flags
    assert "NODE_SLOT_SCHEDULER_ENABLED=true is ignored" in result.stderr

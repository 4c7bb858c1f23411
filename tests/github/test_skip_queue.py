"""Skip-queue authorization over the emulator: the client's reads, the authorizer's rules and
cache, and real reconcile ticks (no Prefect) that admit a verified skip-queue job first."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from flowcheck import assert_invariants, fleet, jobs_by_id, managed_on, wait_for

from slurmgate.admission.model import Job, JobStatus
from slurmgate.admission.tick import reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.github.client import GitHubClient
from slurmgate.github.errors import MalformedResponse, NotFound
from slurmgate.github.etags import FileEtagCache
from slurmgate.github.scope import GitHubScope
from slurmgate.github.skipqueue import skip_queue_pr
from slurmgate.github.snapshot import take_snapshot
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

TEAM = "acme/gpu-admins"
SETTINGS = AdmissionSettings(
    PRIORITY_SCHEDULER_ENABLED=True,
    NODE_SLOT_SCHEDULER_ENABLED=True,
    orphan_grace_s=0,
    skip_queue_team=TEAM,
    skip_queue_allow=frozenset({"Carol"}),
)
MEMBERSHIP = "GET /orgs/{org}/teams/{team_slug}/memberships/{username}"
EVENTS = "GET /repos/{owner}/{repo}/issues/{issue_number}/events"


def labels(token: str, score: str, nodes: int = 3, pr: int | None = None) -> list[str]:
    out = ["self-hosted", "cluster:x", f"nodes:{nodes}", f"ci-job-{score}-{token}", "ci-attempt-1"]
    return [*out, f"ci-skip-queue-pr-{pr}"] if pr is not None else out


def client_for(emu: RunningEmulator, **options: object) -> GitHubClient:
    options.setdefault("backoff_base_s", 0.01)
    options.setdefault("backoff_cap_s", 0.02)
    return GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), emu.token, **options)  # type: ignore[arg-type]


def long_queue(emu: RunningEmulator, pr: int) -> int:
    """Ten 3-node jobs of score 5.000, then a skip-queue job of 2.250 in a run for PR `pr`."""
    for n in range(10):
        emu.admin.add_job(labels(f"q{n}", "5.000"), duration_s=600)
    return emu.admin.add_job(labels("skip", "2.250", pr=pr), duration_s=600, pull_request=pr)["id"]


def requests(emu: RunningEmulator, endpoint: str) -> int:
    return int(emu.admin.stats()["requests"].get(endpoint, 0))


async def test_a_verified_skip_queue_job_jumps_the_queue_runs_and_leaves_nothing() -> None:
    with running_emulator({"x": 3}) as emu:
        skipper = long_queue(emu, pr=42)
        emu.admin.label_pr(42, "skip_queue", "alice")
        emu.admin.set_team_member("gpu-admins", "alice")
        async with client_for(emu) as client:
            first = await reconcile_tick(direct_steps(client, settings=SETTINGS), SETTINGS)
            assert (first.admitted, first.blocked, first.failures) == (1, 10, [])
            (admit,) = first.decisions.admit
            assert admit.job_id == skipper and admit.priority == "skip-queue"
            # GitHub dispatches it to the anchor, which carries its skip-queue label too
            running = lambda: jobs_by_id(emu.admin.dump())[skipper]["status"] == "in_progress"  # noqa: E731
            wait_for(running, what="the skip-queue job dispatched to its anchor")
            assert jobs_by_id(emu.admin.dump())[skipper]["runner_id"] == admit.anchor_id
            anchor = {r.id: r for r in fleet(emu.admin.dump())}[admit.anchor_id]
            assert "ci-skip-queue-pr-42" in anchor.managed_job_labels()
            assert_invariants(emu.admin.dump())

            for queued in [j for j in emu.admin.dump()["jobs"] if j["status"] == "queued"]:
                emu.admin.cancel_job(queued["id"])
            emu.admin.complete_job(skipper)
            second = await reconcile_tick(direct_steps(client, settings=SETTINGS), SETTINGS)
        assert (second.released, second.admitted, second.failures) == (1, 0, [])
        assert managed_on(fleet(emu.admin.dump())) == {}


async def test_an_unverified_skip_queue_job_keeps_its_numeric_place() -> None:
    with running_emulator({"x": 3}) as emu:
        skipper = long_queue(emu, pr=43)
        emu.admin.label_pr(43, "skip_queue", "mallory")  # not in the team, not allowed
        emu.admin.set_team_member("gpu-admins", "alice")
        async with client_for(emu) as client:
            report = await reconcile_tick(
                direct_steps(client, read_only=True, settings=SETTINGS), SETTINGS
            )
        (admit,) = report.decisions.admit
        assert admit.job_id != skipper and admit.priority == "5.000"
        assert skipper in {b.job_id for b in report.decisions.blocked}
        assert requests(emu, MEMBERSHIP) == 1


async def test_a_steady_tick_asks_no_membership_and_reads_events_as_a_304(
    tmp_path: Path,
) -> None:
    with running_emulator({"x": 1}) as emu:  # too small: the job stays queued tick after tick
        skipper = long_queue(emu, pr=42)
        emu.admin.label_pr(42, "skip_queue", "alice")
        emu.admin.set_team_member("gpu-admins", "alice")
        cache_file = tmp_path / "etags.json"
        steps_settings = {"read_only": True, "settings": SETTINGS}
        async with client_for(emu, etag_cache=FileEtagCache(cache_file)) as client:
            first = await take_snapshot(client, settings=SETTINGS)
            assert first.skip_queue_job_ids == {skipper}
            assert (requests(emu, MEMBERSHIP), requests(emu, EVENTS)) == (1, 1)
            emu.admin.reset_stats()
            await reconcile_tick(direct_steps(client, **steps_settings), SETTINGS)  # type: ignore[arg-type]
            stats = emu.admin.stats()
            assert requests(emu, MEMBERSHIP) == 0
            assert stats["not_modified_by_endpoint"][EVENTS] == stats["requests"][EVENTS] == 1
        # a new controller process reads the same cache file: still no membership call
        emu.admin.reset_stats()
        async with client_for(emu, etag_cache=FileEtagCache(cache_file)) as fresh:
            again = await take_snapshot(fresh, settings=SETTINGS)
        assert again.skip_queue_job_ids == {skipper}
        assert requests(emu, MEMBERSHIP) == 0
        assert emu.admin.stats()["not_modified_by_endpoint"][EVENTS] == 1
        # a new label event is a new question
        emu.admin.unlabel_pr(42, "skip_queue", "alice")
        emu.admin.label_pr(42, "skip_queue", "alice")
        async with client_for(emu, etag_cache=FileEtagCache(cache_file)) as fresh:
            assert (await take_snapshot(fresh, settings=SETTINGS)).skip_queue_job_ids == {skipper}
        assert requests(emu, MEMBERSHIP) == 1


async def authorized(emu: RunningEmulator, settings: AdmissionSettings = SETTINGS) -> set[int]:
    async with client_for(emu, max_retries=0) as client:
        return set((await take_snapshot(client, settings=settings)).skip_queue_job_ids)


async def test_who_labelled_last_and_whether_the_run_is_the_prs_decide() -> None:
    with running_emulator({"x": 3}) as emu:
        emu.admin.set_team_member("gpu-admins", "alice")
        emu.admin.set_team_member("gpu-admins", "dave", "pending")

        def queued(pr: int, *, run_pr: int | None = None) -> int:
            run_for = pr if run_pr is None else run_pr
            job = emu.admin.add_job(labels(f"p{pr}", "1.000", pr=pr), 600, pull_request=run_for)
            return job["id"]

        member = queued(1)
        emu.admin.label_pr(1, "skip_queue", "alice")
        removed = queued(2)
        emu.admin.label_pr(2, "Skip_Queue", "alice")
        emu.admin.unlabel_pr(2, "skip_queue", "bob")
        relabelled = queued(3)
        emu.admin.label_pr(3, "skip_queue", "alice")
        emu.admin.unlabel_pr(3, "skip_queue", "alice")
        emu.admin.label_pr(3, "skip_queue", "mallory")  # the last labeller is the one checked
        allowed = queued(4)
        emu.admin.label_pr(4, "skip_queue", "carol")  # allow-list, case-insensitive
        pending = queued(5)
        emu.admin.label_pr(5, "skip_queue", "dave")
        other_label = queued(6)
        emu.admin.label_pr(6, "ready", "alice")
        borrowed = queued(1, run_pr=7)  # names PR 1, but its run is PR 7's
        emu.admin.label_pr(7, "skip_queue", "alice")

        assert await authorized(emu) == {member, allowed}
        assert requests(emu, MEMBERSHIP) == 3  # alice, mallory and dave; carol is allowed
        assert {removed, relabelled, pending, other_label, borrowed}.isdisjoint(
            await authorized(emu)
        )
        only_allow = SETTINGS.model_copy(update={"skip_queue_team": None})
        assert await authorized(emu, only_allow) == {allowed}
        emu.admin.reset_stats()
        nobody = SETTINGS.model_copy(update={"skip_queue_team": None, "skip_queue_allow": set()})
        assert await authorized(emu, nobody) == set()
        assert requests(emu, EVENTS) == requests(emu, MEMBERSHIP) == 0  # nothing configured


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/orgs/acme/teams/*", 500),
        ("/orgs/acme/teams/*", 403),
        ("/repos/acme/gpu-ci/issues/*", 502),
        ("/repos/acme/gpu-ci/issues/*", 403),
    ],
)
async def test_a_failed_lookup_is_not_authorized_and_the_tick_goes_on(
    path: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    with running_emulator({"x": 3}) as emu:
        skipper = long_queue(emu, pr=42)
        emu.admin.label_pr(42, "skip_queue", "alice")
        emu.admin.set_team_member("gpu-admins", "alice")
        emu.admin.fault("status", method="GET", path=path, status=status, count=1)
        with caplog.at_level(logging.WARNING, logger="slurmgate.github.skipqueue"):
            async with client_for(emu, max_retries=0) as client:
                report = await reconcile_tick(direct_steps(client, settings=SETTINGS), SETTINGS)
                assert report.failures == [] and report.admitted == 1
                assert report.decisions.admit[0].job_id != skipper
                warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
                assert (
                    len(warnings) == 1 and "PR acme/gpu-ci#42 not verified" in warnings[0].message
                )
                # the failure was not remembered: the next read asks again and verifies it
                assert (await take_snapshot(client, settings=SETTINGS)).skip_queue_job_ids == {
                    skipper
                }


async def test_client_reads_label_events_across_pages_and_bounds_them() -> None:
    with running_emulator({}) as emu:
        emu.admin.add_job(["self-hosted"], 600, pull_request=5)
        for n in range(120):
            emu.admin.label_pr(5, f"l{n % 3}", "alice")
        emu.admin.unlabel_pr(5, "l1", "bob")
        async with client_for(emu) as client:
            events = await client.list_label_events(emu.repo, 5)
            assert len(events) == 121 and events[-1].actor == "bob" and not events[-1].added
            assert emu.admin.stats()["requests"][EVENTS] == 2  # two pages of 100
            with pytest.raises(NotFound):
                await client.list_label_events(emu.repo, 6)
            assert await client.team_member_active("acme", "gpu-admins", "alice") is False
        async with client_for(emu, max_pages=1) as small:
            with pytest.raises(MalformedResponse, match="more than 1 pages"):
                await small.list_label_events(emu.repo, 5)


def test_skip_queue_pr_is_bounded() -> None:
    def job_with(*extra: str) -> Job:
        return Job(1, 1, 1, "j", ("self-hosted", *extra), JobStatus.QUEUED, created_at=None)  # type: ignore[arg-type]

    assert skip_queue_pr(job_with()) is None
    assert skip_queue_pr(job_with("CI-Skip-Queue-PR-12")) == 12
    assert skip_queue_pr(job_with("ci-skip-queue-pr-12", "ci-skip-queue-pr-012")) == 12
    for bad in (
        "ci-skip-queue-pr-",
        "ci-skip-queue-pr-0",
        "ci-skip-queue-pr-x1",
        "ci-skip-queue-pr-1.5",
    ):
        with pytest.raises(ValueError, match="ci-skip-queue-pr-<pull request number>"):
            skip_queue_pr(job_with(bad))
    with pytest.raises(ValueError, match="ci-skip-queue-pr-"):
        skip_queue_pr(job_with("ci-skip-queue-pr-" + "9" * 11))
    with pytest.raises(ValueError, match="2 pull requests"):
        skip_queue_pr(job_with("ci-skip-queue-pr-1", "ci-skip-queue-pr-2"))


async def test_hostile_label_events_are_refused_not_believed() -> None:
    """An actor login that is no login makes the PR's label events unreadable: not authorized
    (even once a member labels it after), never a crash, and nobody is asked about it."""
    with running_emulator({"x": 3}) as emu:
        long_queue(emu, pr=42)
        emu.admin.set_team_member("gpu-admins", "alice")
        for actor in ("a" * 60, "al ice", "../alice"):
            emu.admin.label_pr(42, "skip_queue", actor)
            assert await authorized(emu) == set(), actor
        emu.admin.label_pr(42, "skip_queue", "alice")
        assert await authorized(emu) == set()
        assert requests(emu, MEMBERSHIP) == 0

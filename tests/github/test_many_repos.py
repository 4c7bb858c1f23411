"""Many repositories: an org scope over a list or over every repository, and job events (the
relay's job-event store) as the tick's primary source of job state, with polling as repair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from slurmgate.admission.tick import reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.github.client import GitHubClient
from slurmgate.github.errors import NotFound
from slurmgate.github.jobstore import JobEventStore
from slurmgate.github.scope import GitHubScope
from slurmgate.github.snapshot import EventReads, take_snapshot
from slurmgate.github.webhook import job_of, parse_delivery
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.settings.github import EventReadSettings
from slurmgate.testbed.emulator.state import EmuJob
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

SETTINGS = AdmissionSettings(
    PRIORITY_SCHEDULER_ENABLED=True, NODE_SLOT_SCHEDULER_ENABLED=True, orphan_grace_s=0
)
REPOS = ["acme/gpu-ci", "acme/serving", "acme/training"]
JOB_READS = (
    "GET /repos/{owner}/{repo}/actions/runs",
    "GET /repos/{owner}/{repo}/actions/runs/{run_id}/jobs",
    "GET /repos/{owner}/{repo}/actions/jobs/{job_id}",
)


def labels(nodes: int, token: str) -> list[str]:
    return ["self-hosted", "cluster:a", f"nodes:{nodes}", f"ci-job-1.000-{token}", "ci-attempt-1"]


@contextmanager
def org_emulator(runners: int = 6) -> Iterator[RunningEmulator]:
    with running_emulator({"a": runners}, repo=REPOS[0], repos=REPOS[1:]) as emu:
        yield emu


def org_client(emu: RunningEmulator, **scope: object) -> GitHubClient:
    return GitHubClient(GitHubScope(api_url=emu.url, org="acme", **scope), emu.token)  # type: ignore[arg-type]


def job_reads(emu: RunningEmulator) -> int:
    requests = emu.admin.stats()["requests"]
    return sum(requests.get(name, 0) for name in JOB_READS)


class Relayed:
    """The emulator's workflow_job deliveries, parsed as the relay parses them, into a store;
    `drop` names jobs whose deliveries get lost on the way."""

    def __init__(self, emu: RunningEmulator, store: JobEventStore) -> None:
        self.emu, self.store = emu, store
        self.drop: set[int] = set()
        emu.state.listeners.append(self.deliver)

    def deliver(self, action: str, job: EmuJob) -> None:
        if job.id in self.drop:
            return
        body = json.dumps(self.emu.state.webhook_payload(action, job)).encode()
        delivery = parse_delivery(body)
        parsed = job_of(delivery)
        assert parsed is not None
        self.store.record(parsed, delivery.repository.full_name)


@pytest.fixture
def store(tmp_path: Path) -> JobEventStore:
    return JobEventStore(tmp_path / "job-events.sqlite")


# ---- org scope --------------------------------------------------------------------------------


async def test_org_scope_over_a_repo_list_reads_only_those_repos() -> None:
    with org_emulator() as emu:
        ids = {repo: emu.admin.add_job(labels(1, repo[5:]), 600, repo=repo)["id"] for repo in REPOS}
        async with org_client(emu, repos=tuple(REPOS[:2])) as client:
            jobs, sources = await client.read_active_jobs()
        assert {job.id for job in jobs} == {ids["acme/gpu-ci"], ids["acme/serving"]}
        assert sources[ids["acme/serving"]].repo == "acme/serving"


async def test_org_scope_over_all_repos_admits_every_repos_jobs_from_one_pool() -> None:
    with org_emulator(runners=4) as emu:
        ids = [emu.admin.add_job(labels(1, repo[5:]), 600, repo=repo)["id"] for repo in REPOS]
        async with org_client(emu, all_repos=True) as client:
            assert await client.job_repos() == tuple(REPOS)
            report = await reconcile_tick(direct_steps(client), SETTINGS)
        assert report.admitted == 3 and report.failures == []
        for job_id in ids:
            status, runner = emu.job_placement(job_id)
            assert status == "in_progress" and runner is not None  # one org-level pool


async def test_the_read_names_each_jobs_repository_and_its_quota_holds_in_a_tick() -> None:
    """Fairness needs each job's repository: the org read says it, and a repository over its
    quota waits (repo-quota on the board) while another's job of the same score is admitted."""
    limited = AdmissionSettings(
        PRIORITY_SCHEDULER_ENABLED=True,
        NODE_SLOT_SCHEDULER_ENABLED=True,
        orphan_grace_s=0,
        repo_limits={"ACME/gpu-ci": {"max_nodes": 1}},
    )
    with org_emulator(runners=4) as emu:
        hog = emu.admin.add_job(labels(2, "hog"), 600, repo="acme/gpu-ci")["id"]
        fair = emu.admin.add_job(labels(2, "fair"), 600, repo="acme/serving")["id"]
        async with org_client(emu, all_repos=True) as client:
            snap = await take_snapshot(client)
            report = await reconcile_tick(direct_steps(client), limited)
        assert snap.job_repos == {hog: "acme/gpu-ci", fair: "acme/serving"}
        assert report.admitted == 1 and emu.job_placement(fair)[0] == "in_progress"
        [wait] = report.decisions.blocked
        assert (wait.job_id, wait.reason.value, wait.scope) == (
            hog,
            "repo-quota",
            "acme/gpu-ci 0/1",
        )
        [row] = report.decisions.board_rows()
        assert f"job {hog} (2n): repo-quota acme/gpu-ci 0/1" in str(row["blocked"])


def test_all_repos_is_only_for_an_org_and_not_with_a_list() -> None:
    with pytest.raises(ValueError, match="all_repos needs an org scope"):
        GitHubScope(repo="acme/gpu-ci", all_repos=True)
    with pytest.raises(ValueError, match="either repos"):
        GitHubScope(org="acme", repos=("acme/a",), all_repos=True)
    with pytest.raises(ValueError, match="all_repos=true"):
        _ = GitHubScope(org="acme").job_repos
    assert GitHubScope(org="acme", all_repos=True).covers("ACME/anything")
    assert not GitHubScope(org="acme", all_repos=True).covers("other/x")
    assert not GitHubScope(org="acme", repos=("acme/a",)).covers("acme/b")


# ---- events as the primary source -------------------------------------------------------------


async def test_a_job_queued_by_event_is_admitted_without_a_jobs_read(
    store: JobEventStore,
) -> None:
    with org_emulator() as emu:
        Relayed(emu, store)
        events = EventReads(store, full_read_every=10)
        async with org_client(emu, all_repos=True) as client:
            await reconcile_tick(direct_steps(client, events=events), SETTINGS)  # the full read
            job = emu.admin.add_job(labels(2, "evt"), 600, repo="acme/serving")["id"]
            emu.admin.reset_stats()
            report = await reconcile_tick(direct_steps(client, events=events), SETTINGS)
        assert report.admitted == 1
        assert job_reads(emu) == 0  # no run listing, no job listing, no job by id
        assert emu.job_placement(job)[0] == "in_progress"
        assert store.latest([job])[job].job.status == "in_progress"  # the relay's next event


async def test_a_completed_event_releases_its_lease(store: JobEventStore) -> None:
    with org_emulator(runners=4) as emu:
        Relayed(emu, store)
        events = EventReads(store, full_read_every=10)
        async with org_client(emu, repos=tuple(REPOS)) as client:
            await reconcile_tick(direct_steps(client, events=events), SETTINGS)
            job = emu.admin.add_job(labels(3, "rel"), 600, repo="acme/training")["id"]
            assert (await reconcile_tick(direct_steps(client, events=events), SETTINGS)).admitted
            emu.admin.complete_job(job)
            emu.admin.reset_stats()
            report = await reconcile_tick(direct_steps(client, events=events), SETTINGS)
        assert report.released == 1
        assert job_reads(emu) == 0  # the completed event said so; nothing was polled
        held = [lb for r in emu.admin.dump()["runners"] for lb in r["labels"]]
        assert not [lb for lb in held if lb["name"].startswith("ci-lease-")]


async def test_a_missed_event_is_repaired_by_the_full_read_every_k_reads(
    store: JobEventStore,
) -> None:
    with org_emulator() as emu:
        relayed = Relayed(emu, store)
        events = EventReads(store, full_read_every=3)
        async with org_client(emu, all_repos=True) as client:
            await take_snapshot(client, events=events)  # read 1: full
            relayed.drop.add(emu.state._next_job)  # the next job's queued delivery is lost
            lost = emu.admin.add_job(labels(1, "lost"), 600, repo="acme/training")["id"]
            seen = [
                {job.id for job in (await take_snapshot(client, events=events)).jobs}
                for _ in range(3)  # reads 2 and 3 from events, read 4 polls
            ]
        assert [lost in ids for ids in seen] == [False, False, True]
        assert store.latest([lost])[lost].source == "read"  # the store learned it too


async def test_a_stale_queued_event_triggers_one_targeted_read(tmp_path: Path) -> None:
    now = [1_000_000.0]
    store = JobEventStore(tmp_path / "job-events.sqlite", clock=lambda: now[0])
    with org_emulator() as emu:
        relayed = Relayed(emu, store)
        events = EventReads(store, full_read_every=100, recheck_after_s=60)
        async with org_client(emu, all_repos=True) as client:
            await take_snapshot(client, events=events)
            # no runner carries its labels, so it stays queued; then its end goes unreported
            job = emu.admin.add_job(["self-hosted", "nowhere"], 600, repo="acme/serving")["id"]
            relayed.drop.add(job)
            emu.admin.complete_job(job, "cancelled")
            emu.admin.reset_stats()
            fresh = await take_snapshot(client, events=events)
            assert job in {j.id for j in fresh.jobs} and job_reads(emu) == 0  # not stale yet
            now[0] += 61
            repaired = await take_snapshot(client, events=events)
            reads = emu.admin.stats()["requests"]
        assert job not in {j.id for j in repaired.jobs}
        assert reads.get("GET /repos/{owner}/{repo}/actions/jobs/{job_id}") == 1
        assert store.latest([job])[job].job.status == "completed"


async def test_a_lease_whose_job_has_no_event_is_read_by_id(store: JobEventStore) -> None:
    with org_emulator() as emu:
        relayed = Relayed(emu, store)
        events = EventReads(store, full_read_every=100)
        async with org_client(emu, repos=tuple(REPOS)) as client:
            await take_snapshot(client, events=events)
            job = emu.admin.add_job(labels(2, "gone"), 600)["id"]
            await reconcile_tick(direct_steps(client, events=events), SETTINGS)
            relayed.drop.add(job)
            store.forget([job])  # the store lost it (pruned, or a new file)
            emu.admin.reset_stats()
            snapshot = await take_snapshot(client, events=events)
        assert job in {j.id for j in snapshot.jobs}
        assert emu.admin.stats()["requests"]["GET /repos/{owner}/{repo}/actions/jobs/{job_id}"]


def test_without_a_store_file_the_tick_polls(tmp_path: Path) -> None:
    settings = EventReadSettings(job_store=tmp_path / "none.sqlite")
    assert EventReads.configured(settings) is None
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all" * 100)
    assert EventReads.configured(EventReadSettings(job_store=tmp_path / "junk.sqlite")) is None
    JobEventStore(tmp_path / "real.sqlite").forget([])
    chosen = EventReads.configured(
        EventReadSettings(job_store=tmp_path / "real.sqlite", full_read_every=7)
    )
    assert chosen is not None and chosen.full_read_every == 7


def test_full_read_every_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMGATE_FULL_READ_EVERY", "4")
    assert EventReadSettings().full_read_every == 4
    monkeypatch.setenv("SLURMGATE_FULL_READ_EVERY", "0")
    with pytest.raises(ValueError, match="full_read_every"):
        EventReadSettings()


async def test_a_failed_full_read_is_tried_again_on_the_next_read(store: JobEventStore) -> None:
    with org_emulator() as emu:
        Relayed(emu, store)
        events = EventReads(store, full_read_every=10)
        async with org_client(emu, all_repos=True) as client:
            emu.admin.fault("status", status=404, path="/orgs/acme/repos")
            with pytest.raises(Exception, match="404"):
                await take_snapshot(client, events=events)
            emu.admin.clear_faults()
            emu.admin.reset_stats()
            await take_snapshot(client, events=events)
        assert emu.admin.stats()["requests"]["GET /repos/{owner}/{repo}/actions/runs"] == 6


async def test_a_skip_queue_job_from_an_event_is_verified_through_its_run(
    store: JobEventStore,
) -> None:
    settings = AdmissionSettings(
        PRIORITY_SCHEDULER_ENABLED=True,
        NODE_SLOT_SCHEDULER_ENABLED=True,
        skip_queue_allow=frozenset({"alice"}),
    )
    with org_emulator() as emu:
        Relayed(emu, store)
        events = EventReads(store, full_read_every=10)
        async with org_client(emu, repos=(REPOS[0],)) as client:
            await take_snapshot(client, settings=settings, events=events)
            skip = [*labels(1, "skip"), "ci-skip-queue-pr-42"]
            job = emu.admin.add_job(skip, 600, pull_request=42)["id"]
            plain = emu.admin.add_job([*labels(1, "plain"), "ci-skip-queue-pr-43"], 600)["id"]
            emu.admin.label_pr(42, "skip_queue", "alice")
            emu.admin.reset_stats()
            snapshot = await take_snapshot(client, settings=settings, events=events)
        assert snapshot.skip_queue_job_ids == {job}  # the other's run is for no PR
        assert plain in {j.id for j in snapshot.jobs}
        assert emu.admin.stats()["requests"]["GET /repos/{owner}/{repo}/actions/runs/{run_id}"] == 2


# ---- the command line ---------------------------------------------------------------------------


def _cli(emu: RunningEmulator, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURMGATE_", "GITHUB_"))}
    env.update(
        GITHUB_TOKEN=emu.token,
        PRIORITY_SCHEDULER_ENABLED="true",
        NODE_SLOT_SCHEDULER_ENABLED="true",
        SLURMGATE_MIN_WRITE_INTERVAL_S="0",
    )
    return subprocess.run(
        [sys.executable, "-m", "slurmgate.cli", *args, "--api-url", emu.url, "--org", "acme"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_status_reads_an_org_over_a_repo_list_or_every_repo_from_the_command_line() -> None:
    with org_emulator(runners=4) as emu:
        for repo in REPOS:
            emu.admin.add_job(labels(1, repo[5:]), 600, repo=repo)
        everywhere = _cli(emu, "status", "--all-repos", "--json")
        assert everywhere.returncode == 0, everywhere.stderr
        listed = _cli(emu, "status", "--repos", ",".join(REPOS[:2]), "--json")
        assert listed.returncode == 0, listed.stderr
        queued = [json.loads(run.stdout) for run in (everywhere, listed)]
        # the plan this board shows takes every job it reads: 3 repositories, or the 2 listed
        assert [sum(row["admitted_nodes"] for row in rows) for rows in queued] == [3, 2]
        both = _cli(emu, "status", "--all-repos", "--repos", REPOS[0])
        assert both.returncode == 2 and "not both" in both.stderr
        assert "Traceback" not in both.stderr and len(both.stderr.strip().splitlines()) == 1


class Said:
    """A tick log that keeps what it was told."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def info(self, msg: str, *args: object) -> None:
        pass

    def warning(self, msg: str, *args: object) -> None:
        self.warnings.append(msg % args if args else msg)


async def test_a_repository_github_will_not_list_is_skipped_and_named_every_tick() -> None:
    """A renamed repository in the list (404) and one the App was not granted (403): the
    other repositories' jobs are admitted, and each tick's log names both, with the fix."""
    with org_emulator(runners=4) as emu:
        admitted = emu.admin.add_job(labels(1, "here"), 600, repo="acme/gpu-ci")["id"]
        emu.admin.add_job(labels(1, "hidden"), 600, repo="acme/serving")
        emu.admin.fault("status", status=403, path="/repos/acme/serving/*", count=None)
        scope = ("acme/gpu-ci", "acme/serving", "acme/renamed")
        async with org_client(emu, repos=scope) as client:
            for _ in range(2):
                said = Said()
                report = await reconcile_tick(direct_steps(client), SETTINGS, log=said)
                unread = [w for w in said.warnings if w.startswith("repository ")]
                assert len(unread) == 2, said.warnings
                assert unread[0].startswith("repository acme/renamed unread (GET /repos/acme/")
                assert "-> 404" in unread[0] and "fix its name in the scope's repos" in unread[0]
                assert unread[1].startswith("repository acme/serving unread (GET /repos/acme/")
                assert "-> 403" in unread[1] and "grant the App access to it" in unread[1]
        assert report.failures == []
        assert emu.job_placement(admitted)[0] == "in_progress"
        assert [j for j in emu.admin.dump()["jobs"] if j["status"] == "queued"]  # serving's waits


async def test_a_lease_whose_repository_turns_unreadable_is_kept() -> None:
    """Its job is neither listed nor found by id: unknown, not gone, so nothing is released."""
    with org_emulator(runners=4) as emu:
        job = emu.admin.add_job(labels(2, "kept"), 600, repo="acme/serving")["id"]
        async with org_client(emu, repos=("acme/gpu-ci", "acme/serving")) as client:
            first = await reconcile_tick(direct_steps(client), SETTINGS)
            assert first.admitted == 1
            emu.admin.fault("status", status=403, path="/repos/acme/serving/*", count=None)
            second = await reconcile_tick(direct_steps(client), SETTINGS)
        assert second.failures == [] and second.decisions.release == ()
        leased = [
            r
            for r in emu.admin.dump()["runners"]
            if any(x["name"].startswith(f"ci-lease-j{job}-") for x in r["labels"])
        ]
        assert len(leased) == 2


async def test_a_single_repository_scope_still_fails_on_a_repository_it_cannot_read() -> None:
    with org_emulator() as emu:
        async with org_client(emu, repos=("acme/renamed",)) as client:
            with pytest.raises(NotFound):
                await reconcile_tick(direct_steps(client), SETTINGS)


async def test_a_run_deleted_between_listing_and_its_jobs_read_is_passed_over() -> None:
    with org_emulator() as emu:
        kept = emu.admin.add_job(labels(1, "kept"), 600, repo="acme/gpu-ci")["id"]
        gone = emu.admin.add_job(labels(1, "gone"), 600, repo="acme/gpu-ci")["run_id"]
        emu.admin.fault("status", status=404, path=f"/repos/acme/gpu-ci/actions/runs/{gone}/jobs")
        async with org_client(emu, repos=("acme/gpu-ci",)) as client:
            jobs, _ = await client.read_active_jobs()
        assert [job.id for job in jobs] == [kept]

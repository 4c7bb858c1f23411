"""GitHubClient against the live emulator: pagination, ETags, labels, runs and jobs, parsing."""

from __future__ import annotations

import time
from datetime import UTC

import pytest
from pydantic import ValidationError

from slurmgate.admission.model import JobStatus
from slurmgate.github.client import GitHubClient
from slurmgate.github.errors import NotFound, ValidationFailed
from slurmgate.github.etags import FileEtagCache, MemoryEtagCache
from slurmgate.github.scope import GitHubScope
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

from .conftest import MakeClient

RUNNERS = ("GET", "/repos/{owner}/{repo}/actions/runners")


def test_scope_needs_exactly_one_of_repo_or_org() -> None:
    assert GitHubScope(repo="acme/gpu-ci").runners_path == "/repos/acme/gpu-ci/actions/runners"
    assert GitHubScope(org="acme").runners_path == "/orgs/acme/actions/runners"
    with pytest.raises(ValidationError, match="exactly one of repo"):
        GitHubScope()
    with pytest.raises(ValidationError, match="exactly one of repo"):
        GitHubScope(repo="acme/gpu-ci", org="acme")
    with pytest.raises(ValidationError, match="repo 'acme' is not OWNER/NAME"):
        GitHubScope(repo="acme")
    with pytest.raises(ValidationError, match="api_url"):
        GitHubScope(api_url="api.github.com", repo="acme/gpu-ci")


async def test_list_runners_follows_link_across_250_runners() -> None:
    with running_emulator(pools={"big": 250}) as emu:
        async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), emu.token) as gh:
            runners = await gh.list_runners()
            assert [r.id for r in runners] == list(range(1, 251))
            assert runners[0].name == "big-001" and runners[-1].name == "big-250"
            assert runners[0].pool == "cluster:big"
            assert runners[0].read_only == frozenset({"self-hosted", "Linux", "X64"})
            # per_page=100: three pages, three requests, nothing else
            assert gh.calls.requests[RUNNERS] == 3
            assert emu.admin.stats()["requests"] == {"GET /repos/{owner}/{repo}/actions/runners": 3}


async def test_org_scope_lists_the_same_fleet(emu: RunningEmulator) -> None:
    async with GitHubClient(GitHubScope(api_url=emu.url, org=emu.owner), emu.token) as gh:
        runners = await gh.list_runners()
    assert len(runners) == 9
    assert "GET /orgs/{org}/actions/runners" in emu.admin.stats()["requests"]


async def test_etag_304_costs_no_quota_and_returns_the_cached_fleet(
    emu: RunningEmulator, make_client: MakeClient
) -> None:
    gh = make_client()
    first = await gh.list_runners()
    assert gh.rate_limit is not None
    remaining = gh.rate_limit.remaining
    second = await gh.list_runners()
    assert second == first
    assert gh.calls.not_modified[RUNNERS] == 1
    assert gh.rate_limit.remaining == remaining
    assert emu.admin.stats()["not_modified"] == 1
    # a label write changes the body: the next conditional read is a fresh 200
    await gh.add_labels(1, ["ci-lease-j7-a1-t100"])
    third = await gh.list_runners()
    assert "ci-lease-j7-a1-t100" in third[0].labels
    assert gh.calls.not_modified[RUNNERS] == 1


async def test_verification_read_bypasses_the_etag_cache(make_client: MakeClient) -> None:
    gh = make_client()
    await gh.list_runners()
    await gh.list_runners(conditional=False)
    assert gh.calls.requests[RUNNERS] == 2
    assert gh.calls.not_modified[RUNNERS] == 0


async def test_file_etag_cache_gives_304s_to_a_second_client(
    emu: RunningEmulator, make_client: MakeClient, tmp_path
) -> None:
    path = tmp_path / "etags.json"
    with running_emulator(pools={"p": 150}) as big:
        scope = GitHubScope(api_url=big.url, repo=big.repo)
        async with GitHubClient(scope, big.token, etag_cache=FileEtagCache(path)) as gh:
            first = await gh.list_runners()
            emu_runs = await gh.list_runs("queued")
        assert path.exists()
        big.admin.reset_stats()
        async with GitHubClient(scope, big.token, etag_cache=FileEtagCache(path)) as fresh:
            again = await fresh.list_runners()
            assert await fresh.list_runs("queued") == emu_runs
            assert again == first and len(again) == 150
            # both pages of runners and the runs list came back 304
            assert fresh.calls.total_not_modified == 3
        stats = big.admin.stats()
        assert stats["not_modified"] == 3 and stats["quota_used"] == 0


def test_file_etag_cache_survives_a_corrupt_file(tmp_path) -> None:
    path = tmp_path / "etags.json"
    path.write_text("{not json")
    cache = FileEtagCache(path)
    assert cache.get("x") is None
    cache.put("x", '"abc"', {"body": 1})
    cache.flush()
    assert FileEtagCache(path).get("x") == ('"abc"', {"body": 1})


def test_file_etag_cache_batches_writes_until_flush(tmp_path) -> None:
    path = tmp_path / "etags.json"
    cache = FileEtagCache(path, flush_interval_s=3600)
    for i in range(50):
        cache.put(f"k{i}", f'"{i}"', {"body": i})
    assert not path.exists()  # 50 puts, no rewrite of the file each time
    cache.flush()
    assert len(FileEtagCache(path)) == 50
    eager = FileEtagCache(tmp_path / "eager.json", flush_interval_s=0)
    eager.put("k", '"e"', {"body": 0})
    assert (tmp_path / "eager.json").exists()


def test_etag_caches_drop_the_least_recently_used(tmp_path) -> None:
    cache = MemoryEtagCache(max_entries=3)
    for key in ("a", "b", "c"):
        cache.put(key, '"e"', {"body": key})
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", '"e"', {"body": "d"})
    assert cache.get("b") is None and cache.get("a") is not None and len(cache) == 3
    path = tmp_path / "bounded.json"
    bounded = FileEtagCache(path, max_entries=2)
    for key in ("x", "y", "z"):
        bounded.put(key, '"e"', {"body": key})
    bounded.flush()
    assert FileEtagCache(path).get("x") is None and len(FileEtagCache(path)) == 2


async def test_client_close_writes_the_file_cache(emu: RunningEmulator, tmp_path) -> None:
    path = tmp_path / "etags.json"
    scope = GitHubScope(api_url=emu.url, repo=emu.repo)
    gh = GitHubClient(scope, emu.token, etag_cache=FileEtagCache(path, flush_interval_s=3600))
    await gh.list_runners()
    assert not path.exists()
    await gh.aclose()
    assert len(FileEtagCache(path)) == 1


async def test_unusable_cache_entry_is_read_afresh(emu: RunningEmulator) -> None:
    cache = MemoryEtagCache()
    scope = GitHubScope(api_url=emu.url, repo=emu.repo)
    async with GitHubClient(scope, emu.token, etag_cache=cache) as gh:
        await gh.list_runners()
        (key,) = list(cache._entries)
        etag, _ = cache._entries[key]
        cache.put(key, etag, ["not", "the", "client's", "format"])
        assert len(await gh.list_runners()) == 9
        assert gh.calls.total_not_modified == 0


async def test_labels_add_set_remove(emu: RunningEmulator, make_client: MakeClient) -> None:
    gh = make_client()
    labels = await gh.add_labels(1, ["ci-lease-j1-a1-t5", "nodes:2"])
    assert labels == ["self-hosted", "Linux", "X64", "cluster:h100", "ci-lease-j1-a1-t5", "nodes:2"]
    # adding a label it already has (any case) is a no-op, as on GitHub
    assert await gh.add_labels(1, ["NODES:2"]) == labels
    assert await gh.remove_label(1, "nodes:2") is True
    assert await gh.remove_label(1, "nodes:2") is False  # 404 -> absent -> idempotent
    assert await gh.set_labels(1, ["cluster:h100"]) == [
        "self-hosted",
        "Linux",
        "X64",
        "cluster:h100",
    ]
    assert await gh.list_labels(1) == ["self-hosted", "Linux", "X64", "cluster:h100"]
    runner = await gh.get_runner(1)
    assert runner.labels == ("self-hosted", "Linux", "X64", "cluster:h100")


async def test_read_only_label_cannot_be_removed(make_client: MakeClient) -> None:
    gh = make_client()
    with pytest.raises(ValidationFailed) as info:
        await gh.remove_label(1, "self-hosted")
    assert info.value.status == 422 and "read-only" in str(info.value)
    assert "self-hosted" in await gh.list_labels(1)
    assert gh.calls.retries == 0


async def test_unknown_runner_is_not_found(make_client: MakeClient) -> None:
    gh = make_client()
    with pytest.raises(NotFound) as info:
        await gh.get_runner(999)
    # the message names the request as sent; counters and retry rules keep the template
    assert info.value.path == "/repos/acme/gpu-ci/actions/runners/999"
    assert "GET /repos/acme/gpu-ci/actions/runners/999 -> 404" in str(info.value)
    assert info.value.template == "/repos/{owner}/{repo}/actions/runners/{runner_id}"
    assert info.value.method == "GET" and info.value.status == 404
    with pytest.raises(NotFound):
        await gh.add_labels(999, ["x"])


async def test_runs_and_jobs_parse_into_the_model(
    emu: RunningEmulator, make_client: MakeClient
) -> None:
    gh = make_client()
    queued = emu.admin.add_job(["self-hosted", "cluster:h100", "ci-job-1.000-abc"], 30)
    running = emu.admin.add_job(["self-hosted", "cluster:b200"], 30)
    assert [r["id"] for r in await gh.list_runs("queued")] == [queued["run_id"]]
    assert [r["id"] for r in await gh.list_runs("in_progress")] == [running["run_id"]]
    jobs = await gh.list_run_jobs(queued["run_id"])
    assert len(jobs) == 1
    job = jobs[0]
    assert job.id == queued["id"] and job.status is JobStatus.QUEUED
    assert job.labels == ("self-hosted", "cluster:h100", "ci-job-1.000-abc")
    assert job.created_at.tzinfo is not None and job.created_at.utcoffset() == UTC.utcoffset(None)
    assert job.started_at is None and job.runner_id is None and job.run_attempt == 1
    got = await gh.get_job(running["id"])
    assert got is not None and got.status is JobStatus.IN_PROGRESS
    assert got.runner_name == "b200-01" and got.started_at is not None
    assert await gh.get_job(123456789) is None
    active = await gh.list_active_jobs()
    assert [j.id for j in active] == [queued["id"], running["id"]]


async def test_list_run_jobs_of_a_multi_job_run(
    emu: RunningEmulator, make_client: MakeClient
) -> None:
    gh = make_client()
    first = emu.admin.add_job(["nope"], 1)
    for _ in range(120):
        emu.state.add_job(["nope"], 1, run_id=first["run_id"])
    jobs = await gh.list_run_jobs(first["run_id"])
    assert len(jobs) == 121 and len({j.id for j in jobs}) == 121
    assert gh.calls.requests[("GET", "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs")] == 2


async def test_write_pacing_spaces_mutating_requests(make_client: MakeClient) -> None:
    gh = make_client(min_write_interval_s=0.15)
    start = time.monotonic()
    await gh.add_labels(1, ["a-1"])
    await gh.add_labels(2, ["a-2"])
    await gh.remove_label(1, "a-1")
    writes_elapsed = time.monotonic() - start
    start = time.monotonic()
    for _ in range(3):
        await gh.list_runners(conditional=False)
    reads_elapsed = time.monotonic() - start
    assert writes_elapsed >= 0.3  # two gaps between three writes
    assert reads_elapsed < 0.3  # reads are not paced


def test_memory_cache_is_per_instance() -> None:
    one, two = MemoryEtagCache(), MemoryEtagCache()
    one.put("k", '"e"', 1)
    assert one.get("k") == ('"e"', 1) and two.get("k") is None


async def test_org_scope_reads_jobs_from_its_repos(emu: RunningEmulator) -> None:
    job = emu.admin.add_job(["nowhere"], 5)
    scope = GitHubScope(api_url=emu.url, org=emu.owner, repos=(emu.repo,))
    async with GitHubClient(scope, emu.token) as gh:
        assert [j.id for j in await gh.list_active_jobs()] == [job["id"]]
        found = await gh.get_job(job["id"])
        assert found is not None and found.id == job["id"]
    bare = GitHubScope(api_url=emu.url, org=emu.owner)
    async with GitHubClient(bare, emu.token) as gh:
        with pytest.raises(ValueError, match="set repos="):
            await gh.list_active_jobs()

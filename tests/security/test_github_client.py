"""The GitHub client facing a hostile GitHub: links to other hosts, endless pages, huge bodies.

GitHub is stood in for by a small starlette app under uvicorn whose answer each test scripts;
a second server plays the other host a pagination link points at, and records whether the
token ever reached it. The client, its parsing and the snapshot reader are the real ones.
"""

from __future__ import annotations

import gzip
import json
import logging
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from slurmgate.admission.model import JobStatus
from slurmgate.errors import ExternalError
from slurmgate.github.app_auth import (
    AppTokenUnavailable,
    GitHubAppCredentials,
    InstallationTokenProvider,
)
from slurmgate.github.client import GitHubClient
from slurmgate.github.errors import MalformedResponse
from slurmgate.github.etags import FileEtagCache, MemoryEtagCache
from slurmgate.github.payloads import MAX_LABEL_LENGTH
from slurmgate.github.scope import GitHubScope, is_login, is_repo
from slurmgate.github.snapshot import take_snapshot
from slurmgate.serving import ThreadedServer
from slurmgate.testbed.emulator.apps import new_private_key

TOKEN = "ghp_hostile-test-token-0123456789"
REPO = "acme/gpu-ci"
RUNNERS = f"/repos/{REPO}/actions/runners"

Handler = Callable[[Request], Response]


@dataclass
class ScriptedGitHub:
    """A server that answers every request with the current `handler` and records requests."""

    handler: Handler = field(default=lambda request: JSONResponse({"message": "unset"}, 500))
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)

    def app(self) -> Starlette:
        async def endpoint(request: Request) -> Response:
            self.seen.append(
                (request.method, str(request.url), request.headers.get("authorization"))
            )
            return self.handler(request)

        methods = ["GET", "POST", "PUT", "DELETE"]
        return Starlette(routes=[Route("/{path:path}", endpoint, methods=methods)])


@dataclass
class Servers:
    github: ScriptedGitHub
    github_url: str
    elsewhere: ScriptedGitHub
    elsewhere_url: str

    def reset(self) -> None:
        for fake in (self.github, self.elsewhere):
            fake.seen.clear()
            fake.handler = ScriptedGitHub().handler


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    github, elsewhere = ScriptedGitHub(), ScriptedGitHub()
    with ThreadedServer(github.app()) as api, ThreadedServer(elsewhere.app()) as other:
        yield Servers(github, api.base_url, elsewhere, other.base_url)


@pytest.fixture
def fake(servers: Servers) -> Iterator[Servers]:
    servers.reset()
    yield servers
    servers.reset()


@pytest.fixture
async def client(fake: Servers) -> AsyncIterator[GitHubClient]:
    async with GitHubClient(
        GitHubScope(api_url=fake.github_url, repo=REPO), TOKEN, max_retries=0
    ) as gh:
        yield gh


def runner(runner_id: int, *labels: Any, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": runner_id,
        "name": f"r{runner_id}",
        "os": "linux",
        "status": "online",
        "busy": False,
        "labels": [{"id": i, "name": name, "type": "custom"} for i, name in enumerate(labels)]
        or [{"id": 1, "name": "self-hosted", "type": "read-only"}],
    }
    body.update(fields)
    return body


def runner_page(*runners: dict[str, Any]) -> dict[str, Any]:
    return {"total_count": len(runners), "runners": list(runners)}


# ---- pagination: where the token goes ---------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "{elsewhere}{path}?page=2",  # another port of the same loopback host
        "{elsewhere_localhost}{path}?page=2",  # another host name
        "https://{github_hostport}{path}?page=2",  # another scheme
        "//{elsewhere_hostport}{path}?page=2",  # scheme-relative: no scheme of its own
    ],
)
async def test_a_next_link_off_api_url_is_not_followed_and_the_token_stays_home(
    fake: Servers, client: GitHubClient, target: str
) -> None:
    elsewhere_hostport = fake.elsewhere_url.removeprefix("http://")
    link = target.format(
        elsewhere=fake.elsewhere_url,
        elsewhere_localhost=fake.elsewhere_url.replace("127.0.0.1", "localhost"),
        elsewhere_hostport=elsewhere_hostport,
        github_hostport=fake.github_url.removeprefix("http://"),
        path=RUNNERS,
    )
    fake.github.handler = lambda request: JSONResponse(
        runner_page(runner(1)), headers={"link": f'<{link}>; rel="next"'}
    )
    fake.elsewhere.handler = lambda request: JSONResponse(runner_page(runner(2)))
    with pytest.raises(MalformedResponse, match="leaves") as info:
        await client.list_runners()
    assert TOKEN not in str(info.value)
    assert fake.elsewhere.seen == []  # the other host never saw a request, let alone the token
    assert len(fake.github.seen) == 1


async def test_a_next_link_on_api_url_is_followed(fake: Servers, client: GitHubClient) -> None:
    def pages(request: Request) -> Response:
        if request.query_params.get("page") == "2":
            return JSONResponse(runner_page(runner(2)))
        nxt = f"{fake.github_url}{RUNNERS}?per_page=100&page=2"
        return JSONResponse(runner_page(runner(1)), headers={"link": f'<{nxt}>; rel="next"'})

    fake.github.handler = pages
    assert [r.id for r in await client.list_runners()] == [1, 2]
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth in fake.github.seen)


async def test_endless_pagination_stops_at_the_page_cap(fake: Servers) -> None:
    def endless(request: Request) -> Response:
        page = int(request.query_params.get("page", "1"))
        nxt = f"{fake.github_url}{RUNNERS}?per_page=100&page={page + 1}"
        return JSONResponse(runner_page(runner(page)), headers={"link": f'<{nxt}>; rel="next"'})

    fake.github.handler = endless
    scope = GitHubScope(api_url=fake.github_url, repo=REPO)
    async with GitHubClient(scope, TOKEN, max_retries=0, max_pages=5) as gh:
        with pytest.raises(MalformedResponse, match="more than 5 pages"):
            await gh.list_runners()
    assert len(fake.github.seen) == 5


async def test_a_redirect_is_not_followed(fake: Servers, client: GitHubClient) -> None:
    fake.github.handler = lambda request: Response(
        status_code=302, headers={"location": f"{fake.elsewhere_url}{RUNNERS}"}
    )
    with pytest.raises(ExternalError):
        await client.list_runners()
    assert fake.elsewhere.seen == []


# ---- api_url --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://api.github.com",
        "http://10.0.0.5:8080",
        "http://127.0.0.1.example.com",
        "https://user:secret@api.github.com",
        "https://api.github.com?x=1",
        "ftp://api.github.com",
    ],
)
def test_api_urls_that_would_leak_the_token_are_refused(url: str) -> None:
    with pytest.raises(ValidationError, match="api_url"):
        GitHubScope(api_url=url, repo=REPO)


@pytest.mark.parametrize(
    "url",
    [
        "https://api.github.com",
        "https://ghe.example.com/api/v3",
        "http://127.0.0.1:8000",
        "http://127.0.0.2:8000",
        "http://localhost:8000",
        "http://[::1]:8000",
    ],
)
def test_https_anywhere_and_plain_http_on_loopback_are_accepted(url: str) -> None:
    assert GitHubScope(api_url=url, repo=REPO).api_url == url


# ---- bodies ---------------------------------------------------------------------------------


def _padded_page(total_bytes: int) -> Iterator[bytes]:
    yield b'{"total_count": 1, "runners": [' + json.dumps(runner(1)).encode() + b'], "pad": "'
    chunk = b"x" * 65536
    for _ in range(total_bytes // len(chunk)):
        yield chunk
    yield b'"}'


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "streamed"])
async def test_an_absurdly_large_body_is_refused(fake: Servers, declared: bool) -> None:
    size = 3 * 1024 * 1024
    if declared:
        body = b"".join(_padded_page(size))
        fake.github.handler = lambda request: Response(body, media_type="application/json")
    else:
        fake.github.handler = lambda request: StreamingResponse(
            _padded_page(size), media_type="application/json"
        )
    scope = GitHubScope(api_url=fake.github_url, repo=REPO)
    async with GitHubClient(scope, TOKEN, max_retries=0, max_body_bytes=1024 * 1024) as gh:
        with pytest.raises(MalformedResponse, match="larger than 1048576 bytes"):
            await gh.list_runners()


async def test_a_compressed_bomb_is_cut_at_the_cap(fake: Servers) -> None:
    bomb = gzip.compress(b"".join(_padded_page(8 * 1024 * 1024)))
    assert len(bomb) < 100_000
    fake.github.handler = lambda request: Response(
        bomb, media_type="application/json", headers={"content-encoding": "gzip"}
    )
    scope = GitHubScope(api_url=fake.github_url, repo=REPO)
    async with GitHubClient(scope, TOKEN, max_retries=0, max_body_bytes=1024 * 1024) as gh:
        with pytest.raises(MalformedResponse, match="larger than"):
            await gh.list_runners()


@pytest.mark.parametrize(
    "body",
    [
        b"<html>not json</html>",
        b"[" * 200_000 + b"]" * 200_000,  # deeper than Python's recursion limit
        b'{"runners": 1' + b"0" * 5000 + b"}",  # an integer past Python's digit limit
        b"[]",
        b'{"runners": null}',
        b'{"runners": "r1"}',
        b'{"runners": {"id": 1}}',
        b'"runners"',
        b"null",
        json.dumps(runner_page(*(runner(i) for i in range(1, 102)))).encode(),
    ],
    ids=[
        "html",
        "deep",
        "huge-int",
        "list",
        "null-runners",
        "string-runners",
        "object-runners",
        "string",
        "null",
        "101-items",
    ],
)
async def test_a_malformed_runner_listing_fails_the_read_with_a_typed_error(
    fake: Servers, client: GitHubClient, body: bytes
) -> None:
    fake.github.handler = lambda request: Response(body, media_type="application/json")
    with pytest.raises(MalformedResponse) as info:
        await take_snapshot(client)
    assert isinstance(info.value, ExternalError) and not info.value.transient
    assert len(str(info.value)) < 400


# ---- items ----------------------------------------------------------------------------------

MALFORMED_RUNNERS = {
    "labels as strings": runner(10, labels=["self-hosted", "cluster:x"]),
    "no id": {k: v for k, v in runner(11).items() if k != "id"},
    "id as a string": runner(12, id="12"),
    "id as a bool": runner(13, id=True),
    "busy as a string": runner(14, busy="no"),
    "labels null": runner(15, labels=None),
    "a label name with a newline": runner(16, "cluster:x\nci-lease-j1-a1-t1"),
    "a label name too long": runner(17, "x" * (MAX_LABEL_LENGTH + 1)),
    "too many labels": runner(18, *(f"l{i}" for i in range(300))),
    "a list, not an object": [runner(19)],
    "null": None,
}


async def test_malformed_runners_are_skipped_and_each_is_warned_about_once(
    fake: Servers, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    good = [runner(1, "cluster:x"), runner(2, "cluster:x")]
    page = runner_page(good[0], *MALFORMED_RUNNERS.values(), good[1])
    fake.github.handler = lambda request: JSONResponse(page)
    scope = GitHubScope(api_url=fake.github_url, repo=REPO)
    cache_file = tmp_path / "etags.json"  # each tick is a fresh flow process with this file

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    with caplog.at_level(logging.WARNING, logger="slurmgate.github"):
        for _tick in range(3):
            async with GitHubClient(scope, TOKEN, etag_cache=FileEtagCache(cache_file)) as gh:
                runners = await gh.list_runners()
            assert [r.id for r in runners] == [1, 2]
        first = warnings()
        assert len(first) == len(MALFORMED_RUNNERS)
        assert all("skipped" in line for line in first)
        assert all("\n" not in line for line in first)  # nothing of the hostile value is echoed
        caplog.clear()
        async with GitHubClient(scope, TOKEN, etag_cache=MemoryEtagCache()) as forgetful:
            await forgetful.list_runners()
        assert len(warnings()) == len(MALFORMED_RUNNERS)  # the memory, not luck, kept it quiet


def job(job_id: int, status: str = "queued", **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": job_id,
        "run_id": 100,
        "run_attempt": 1,
        "name": f"job {job_id}",
        "labels": ["self-hosted", "cluster:x", "nodes:2", f"ci-job-1.000-t{job_id}"],
        "status": status,
        "conclusion": None,
        "created_at": "2026-11-29T12:00:00Z",
        "started_at": "2026-11-29T12:00:00Z",
        "completed_at": None,
        "runner_id": None,
        "runner_name": None,
    }
    body.update(fields)
    return body


def actions_api(runs: Any, jobs: Any, single: dict[int, Any]) -> Handler:
    def handle(request: Request) -> Response:
        path = request.url.path
        if path.endswith("/actions/runs"):
            status = request.query_params.get("status")
            return JSONResponse(runs if status == "queued" else {"workflow_runs": []})
        if path.endswith("/jobs"):
            return JSONResponse(jobs)
        if "/actions/jobs/" in path:
            job_id = int(path.rsplit("/", 1)[1])
            if job_id in single:
                return JSONResponse(single[job_id])
            return JSONResponse({"message": "Not Found"}, 404)
        return JSONResponse(runner_page(runner(1, "cluster:x")))

    return handle


async def test_unknown_statuses_and_malformed_jobs_are_not_active(
    fake: Servers, client: GitHubClient
) -> None:
    jobs = [
        job(1),
        job(2, "action_required"),
        job(3, "some-future-status"),
        job(4, labels="nodes:2"),  # labels as one string
        job(5, created_at="2026-11-29 12:00:00", started_at=None),  # no offset
        job(6, status=None),
        job(7, labels=["x" * 5000]),
        job(8, "in_progress"),
    ]
    runs = {"total_count": 1, "workflow_runs": [{"id": 100}, {"id": "101"}, {"no": "id"}]}
    fake.github.handler = actions_api(runs, {"total_count": 8, "jobs": jobs}, {2: jobs[1]})
    active = await client.list_active_jobs()
    assert [j.id for j in active] == [1, 8]
    unknown = await client.get_job(2)
    assert unknown is not None and unknown.status is JobStatus.UNKNOWN and not unknown.active


async def test_a_malformed_job_listing_hides_only_its_own_jobs(
    fake: Servers, client: GitHubClient
) -> None:
    def handle(request: Request) -> Response:
        path = request.url.path
        if path.endswith("/actions/runs"):
            status = request.query_params.get("status")
            return JSONResponse({"workflow_runs": [{"id": 100 if status == "queued" else 200}]})
        if path.endswith("/runs/100/jobs"):
            return JSONResponse([job(1)])  # a list instead of {"jobs": [...]}
        if path.endswith("/runs/200/jobs"):
            return JSONResponse({"jobs": [job(2, "in_progress", run_id=200)]})
        return JSONResponse({"message": "Not Found"}, 404)

    fake.github.handler = handle
    assert [j.id for j in await client.list_active_jobs()] == [2]


async def test_a_malformed_lease_job_is_unknown_not_gone(
    fake: Servers, client: GitHubClient
) -> None:
    leased = runner(1, "cluster:x", "ci-lease-j7-a1-t1764417600")
    broken = job(7, "in_progress", labels={"not": "a list"})
    handle = actions_api({"workflow_runs": []}, {"jobs": []}, {7: broken})

    def with_runners(request: Request) -> Response:
        if request.url.path.endswith("/actions/runners"):
            return JSONResponse(runner_page(leased))
        return handle(request)

    fake.github.handler = with_runners
    snapshot = await take_snapshot(client)
    assert [r.id for r in snapshot.runners] == [1]
    assert snapshot.jobs == ()
    assert snapshot.missing_job_ids == frozenset()  # a 404 would have been missing: release


async def test_a_malformed_write_echo_does_not_fail_the_write(
    fake: Servers, client: GitHubClient
) -> None:
    fake.github.handler = lambda request: JSONResponse({"labels": "ci-lease-j1-a1-t1"})
    assert await client.add_labels(1, ["ci-lease-j1-a1-t1"]) == []
    assert fake.github.seen[0][0] == "POST"


@pytest.mark.parametrize("value", ["octo\n", "octo\r\n"])
def test_a_login_or_repository_with_a_trailing_newline_is_refused(value: str) -> None:
    # A newline would split a header or a log line; `$` alone lets one through before the end.
    assert not is_login(value)
    assert not is_repo(f"octo/{value}")
    assert is_login(value.strip()) and is_repo(f"octo/{value.strip()}")


# ---- decoded size bounded as it streams -------------------------------------------------------


async def test_a_gzip_bomb_is_cut_as_it_inflates_not_after(fake: Servers) -> None:
    """64 MiB in 64 KiB of gzip: httpx inflated a raw chunk whole before the cap could count."""
    bomb = gzip.compress(b"".join(_padded_page(64 * 1024 * 1024)))
    fake.github.handler = lambda request: Response(
        bomb, media_type="application/json", headers={"content-encoding": "gzip"}
    )
    scope = GitHubScope(api_url=fake.github_url, repo=REPO)
    caught: list[BaseException] = []

    async def read() -> None:
        async with GitHubClient(scope, TOKEN, max_retries=0, max_body_bytes=1024 * 1024) as gh:
            try:
                await gh.list_runners()
            except MalformedResponse as exc:
                caught.append(exc)

    tracemalloc.start()
    try:
        await read()
        peak = tracemalloc.get_traced_memory()[1] / (1024 * 1024)
    finally:
        tracemalloc.stop()
    assert caught and "larger than 1048576 bytes" in str(caught[0])
    assert peak < 8, f"{peak:.0f} MiB held for a 1 MiB cap"


@pytest.mark.parametrize("encoding", ["gzip, gzip", "deflate", "br", "gzip, identity"])
async def test_only_identity_or_one_gzip_is_read(fake: Servers, encoding: str) -> None:
    """Stacked gzip took the client to about 1 GB before its cap refused it."""
    inner = gzip.compress(b"".join(_padded_page(16 * 1024 * 1024)))
    body = gzip.compress(inner) if encoding.startswith("gzip") else inner
    fake.github.handler = lambda request: Response(
        body, media_type="application/json", headers={"content-encoding": encoding}
    )
    scope = GitHubScope(api_url=fake.github_url, repo=REPO)
    tracemalloc.start()
    try:
        async with GitHubClient(scope, TOKEN, max_retries=0) as gh:
            with pytest.raises(MalformedResponse, match="only identity or gzip"):
                await gh.list_runners()
        peak = tracemalloc.get_traced_memory()[1] / (1024 * 1024)
    finally:
        tracemalloc.stop()
    assert peak < 8, f"{peak:.0f} MiB held"
    assert fake.github.seen[0][0] == "GET"


async def test_the_app_token_answer_is_read_under_a_cap(fake: Servers) -> None:
    """The access-token request is the App's own; its answer was read whole, with no cap."""
    bomb = gzip.compress(b'{"token": "' + b"x" * (64 * 1024 * 1024) + b'"}')
    fake.github.handler = lambda request: Response(
        bomb, status_code=201, media_type="application/json", headers={"content-encoding": "gzip"}
    )
    credentials = GitHubAppCredentials(77, SecretStr(new_private_key()), 5)
    provider = InstallationTokenProvider(
        credentials, GitHubScope(api_url=fake.github_url, repo=REPO)
    )
    tracemalloc.start()
    try:
        with pytest.raises(AppTokenUnavailable) as caught:
            await provider.token()
        peak = tracemalloc.get_traced_memory()[1] / (1024 * 1024)
    finally:
        tracemalloc.stop()
    assert "larger than 1048576 bytes" in str(caught.value)
    assert str(caught.value).startswith("GitHub App 77") and "\n" not in str(caught.value)
    assert peak < 8, f"{peak:.0f} MiB held"

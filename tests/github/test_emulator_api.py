"""The emulator's GitHub endpoints: shapes (validated against GitHub's OpenAPI), codes, headers."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest

from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

Validate = Callable[[httpx.Response], None]
REPO = "/repos/acme/gpu-ci/actions"
ORG = "/orgs/acme/actions"


def _links(response: httpx.Response) -> dict[str, str]:
    return {
        rel: url
        for url, rel in re.findall(r'<([^>]+)>;\s*rel="(\w+)"', response.headers.get("link", ""))
    }


def test_every_endpoint_validates_against_the_openapi_subset(
    emu: RunningEmulator, api: httpx.Client, validate: Validate
) -> None:
    queued = emu.admin.add_job(["self-hosted", "nowhere"], 5)
    running = emu.admin.add_job(["self-hosted", "cluster:h100"], 5)
    responses: list[tuple[str, httpx.Response, int]] = []

    def call(method: str, path: str, expect: int, **kwargs: object) -> httpx.Response:
        response = api.request(method, path, **kwargs)  # type: ignore[arg-type]
        responses.append((f"{method} {path}", response, expect))
        return response

    for base in (f"{REPO}/runners", f"{ORG}/runners"):
        call("GET", base, 200)
        call("GET", base, 200, params={"per_page": 2, "page": 2})
        call("GET", f"{base}/1", 200)
        call("GET", f"{base}/1/labels", 200)
        call("POST", f"{base}/1/labels", 200, json={"labels": ["ci-lease-j1-a1-t1", "nodes:2"]})
        call("DELETE", f"{base}/1/labels/nodes:2", 200)
        call("DELETE", f"{base}/1/labels/nodes:2", 404)
        call("DELETE", f"{base}/1/labels/self-hosted", 422)
        call("PUT", f"{base}/1/labels", 200, json={"labels": ["cluster:h100", "extra"]})
        call("PUT", f"{base}/1/labels", 422, json={"labels": "not-a-list"})
        call("POST", f"{base}/1/labels", 422, json={"labels": []})
        call("POST", f"{base}/999/labels", 404, json={"labels": ["x"]})
        call("GET", f"{base}/999/labels", 404)
        call("DELETE", f"{base}/2/labels", 200)
        call("PUT", f"{base}/2/labels", 200, json={"labels": ["cluster:h100"]})
    call("DELETE", f"{REPO}/runners/{emu.state.jobs[running['id']].runner_id}", 422)
    call("DELETE", f"{REPO}/runners/9", 204)
    call("GET", f"{REPO}/runs", 200)
    call("GET", f"{REPO}/runs", 200, params={"status": "queued"})
    call("GET", f"{REPO}/runs/{queued['run_id']}", 200)
    call("GET", f"{REPO}/runs/{queued['run_id']}/jobs", 200)
    call("GET", f"{REPO}/runs/{queued['run_id']}/jobs", 200, params={"filter": "all"})
    call("GET", f"{REPO}/runs/{queued['run_id']}/attempts/1/jobs", 200)
    call("GET", f"{REPO}/runs/{queued['run_id']}/attempts/2/jobs", 404)
    call("GET", f"{REPO}/jobs/{queued['id']}", 200)
    call("GET", f"{REPO}/jobs/{running['id']}", 200)
    call("GET", "/rate_limit", 200)
    emu.admin.complete_job(running["id"])
    call("GET", f"{REPO}/jobs/{running['id']}", 200)
    call("GET", f"{REPO}/runs", 200, params={"status": "completed"})

    for name, response, expect in responses:
        assert response.status_code == expect, (name, response.text)
        validate(response)
    # read-only labels survived; custom ones were replaced
    assert [lb["name"] for lb in api.get(f"{REPO}/runners/1/labels").json()["labels"]] == [
        "self-hosted",
        "Linux",
        "X64",
        "cluster:h100",
        "extra",
    ]


def test_the_org_repository_listing_validates_and_paginates(validate: Validate) -> None:
    """GET /orgs/{org}/repos, which an org scope over every repository reads: each page is
    GitHub's array of `minimal-repository`, and the pages together are the org's repositories."""
    names = [f"acme/repo-{i:02d}" for i in range(45)]
    with (
        running_emulator(pools={"p": 1}, repo=names[0], repos=names[1:]) as emu,
        httpx.Client(base_url=emu.url, headers={"Authorization": f"Bearer {emu.token}"}) as api,
    ):
        seen: list[str] = []
        url: str | None = "/orgs/acme/repos?per_page=20"
        while url:
            response = api.get(url)
            assert response.status_code == 200, response.text
            validate(response)
            seen += [repo["full_name"] for repo in response.json()]
            url = _links(response).get("next")
        assert sorted(seen) == names
        forged = response.json()
        del forged[0]["full_name"]
        with pytest.raises(Exception, match="full_name"):
            validate(
                httpx.Response(
                    200,
                    json=forged,
                    request=response.request,
                    headers={"content-type": "application/json"},
                )
            )


def test_validator_rejects_a_wrong_shape(api: httpx.Client, validate: Validate) -> None:
    """The spec check is real: a runner without `busy` does not pass."""
    from openapi_core.validation.response.exceptions import InvalidData

    response = api.get(f"{REPO}/runners/1")
    body = response.json()
    del body["busy"]
    forged = httpx.Response(
        200, json=body, request=response.request, headers={"content-type": "application/json"}
    )
    with pytest.raises(InvalidData):
        validate(forged)


def test_pagination_links_and_totals(validate: Validate) -> None:
    with (
        running_emulator(pools={"p": 250}) as emu,
        httpx.Client(base_url=emu.url, headers={"Authorization": "Bearer t"}) as api,
    ):
        first = api.get(f"{REPO}/runners")
        assert first.json()["total_count"] == 250
        assert len(first.json()["runners"]) == 30  # GitHub's default per_page
        links = _links(first)
        assert set(links) == {"next", "last"}
        assert "page=2" in links["next"] and "page=9" in links["last"]
        page = api.get(f"{REPO}/runners", params={"per_page": 500, "page": 2})
        assert len(page.json()["runners"]) == 100  # capped at 100
        links = _links(page)
        assert set(links) == {"prev", "next", "last", "first"}
        last = api.get(links["last"])
        assert [r["id"] for r in last.json()["runners"]] == list(range(201, 251))
        assert set(_links(last)) == {"prev", "first"}
        beyond = api.get(f"{REPO}/runners", params={"per_page": 100, "page": 7})
        assert beyond.json()["runners"] == [] and beyond.json()["total_count"] == 250
        seen: list[int] = []
        url: str | None = f"{REPO}/runners?per_page=100"
        while url:
            response = api.get(url)
            validate(response)
            seen += [r["id"] for r in response.json()["runners"]]
            url = _links(response).get("next")
        assert seen == list(range(1, 251))


def test_etag_304_and_quota_headers(emu: RunningEmulator, api: httpx.Client) -> None:
    first = api.get(f"{REPO}/runners")
    etag = first.headers["etag"]
    remaining = int(first.headers["x-ratelimit-remaining"])
    for header in ("x-ratelimit-limit", "x-ratelimit-used", "x-ratelimit-reset"):
        assert first.headers[header].isdigit()
    assert first.headers["x-ratelimit-resource"] == "core"
    again = api.get(f"{REPO}/runners", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    assert int(again.headers["x-ratelimit-remaining"]) == remaining
    weak = api.get(f"{REPO}/runners", headers={"If-None-Match": f"W/{etag}"})
    assert weak.status_code == 304
    stale = api.get(f"{REPO}/runners", headers={"If-None-Match": '"0000"'})
    assert stale.status_code == 200
    assert int(stale.headers["x-ratelimit-remaining"]) == remaining - 1
    api.post(f"{REPO}/runners/1/labels", json={"labels": ["changed"]})
    changed = api.get(f"{REPO}/runners", headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag
    stats = emu.admin.stats()
    assert stats["not_modified"] == 2
    assert stats["not_modified_by_endpoint"] == {"GET /repos/{owner}/{repo}/actions/runners": 2}


def test_quota_exhaustion_is_a_primary_403(emu: RunningEmulator, api: httpx.Client) -> None:
    emu.admin.set_quota(limit=2, window_s=60)
    assert api.get(f"{REPO}/runners/1").status_code == 200
    assert api.get(f"{REPO}/runners/1").status_code == 200
    refused = api.get(f"{REPO}/runners/1")
    assert refused.status_code == 403
    assert refused.headers["x-ratelimit-remaining"] == "0"
    assert "rate limit" in refused.json()["message"]
    # a refused write is not applied
    assert api.post(f"{REPO}/runners/1/labels", json={"labels": ["x"]}).status_code == 403
    assert "x" not in [n for n, _ in emu.state.runners[1].labels]
    limits = api.get("/rate_limit")  # free of quota, and still answers
    assert limits.status_code == 200
    assert limits.json()["resources"]["core"]["remaining"] == 0


def test_auth(emu: RunningEmulator) -> None:
    with httpx.Client(base_url=emu.url) as bare:
        assert bare.get(f"{REPO}/runners").status_code == 401
        assert bare.get(f"{REPO}/runners", headers={"Authorization": "Bearer"}).status_code == 401
        assert bare.get(f"{REPO}/runners", headers={"Authorization": "token x"}).status_code == 200
        assert bare.get("/_emulator/stats").status_code == 200  # admin API needs no auth
    with (
        running_emulator(pools={"p": 1}, token="fixed") as locked,
        httpx.Client(base_url=locked.url) as bare,
    ):
        assert bare.get(f"{REPO}/runners", headers={"Authorization": "Bearer x"}).status_code == 401
        assert (
            bare.get(f"{REPO}/runners", headers={"Authorization": "Bearer fixed"}).status_code
            == 200
        )


def test_wrong_repo_or_org_is_404(api: httpx.Client) -> None:
    assert api.get("/repos/acme/other/actions/runners").status_code == 404
    assert api.get("/orgs/other/actions/runners").status_code == 404
    assert api.get("/repos/ACME/GPU-CI/actions/runners").status_code == 200  # case-insensitive
    assert api.get(f"{REPO}/runners/abc").status_code == 404


def test_label_writes_are_case_insensitive(api: httpx.Client) -> None:
    api.post(f"{REPO}/runners/1/labels", json={"labels": ["GPU-big"]})
    labels = api.post(f"{REPO}/runners/1/labels", json={"labels": ["gpu-BIG"]}).json()["labels"]
    assert [lb["name"] for lb in labels].count("GPU-big") == 1
    assert len(labels) == 5
    assert api.delete(f"{REPO}/runners/1/labels/gpu-big").status_code == 200
    removed = api.delete(f"{REPO}/runners/1/labels/CLUSTER:H100")
    assert [lb["name"] for lb in removed.json()["labels"]] == ["self-hosted", "Linux", "X64"]


def test_remove_all_returns_read_only_labels(api: httpx.Client) -> None:
    api.post(f"{REPO}/runners/1/labels", json={"labels": ["a", "b"]})
    response = api.delete(f"{REPO}/runners/1/labels")
    assert response.json() == {
        "total_count": 3,
        "labels": [
            {"id": 1, "name": "self-hosted", "type": "read-only"},
            {"id": 2, "name": "Linux", "type": "read-only"},
            {"id": 3, "name": "X64", "type": "read-only"},
        ],
    }


def test_skip_queue_reads_validate_paginate_and_answer_304(
    emu: RunningEmulator, api: httpx.Client, validate: Validate
) -> None:
    """The issue-events listing (a bare array, oldest first, Link pages, ETag) and the team
    membership read (200 active or pending, 404 for no member) in GitHub's shapes."""
    job = emu.admin.add_job(["self-hosted", "nowhere"], 5, pull_request=42)
    run = api.get(f"{REPO}/runs/{job['run_id']}")
    validate(run)
    assert [pr["number"] for pr in run.json()["pull_requests"]] == [42]
    assert run.json()["event"] == "pull_request"
    for n in range(3):
        emu.admin.label_pr(42, "skip_queue", f"user{n}")
    emu.admin.unlabel_pr(42, "skip_queue", "user1")
    events = "/repos/acme/gpu-ci/issues/42/events"
    first = api.get(events, params={"per_page": 3})
    validate(first)
    assert [e["event"] for e in first.json()] == ["labeled", "labeled", "labeled"]
    assert first.json()[2]["actor"]["login"] == "user2"
    assert first.json()[0]["label"]["name"] == "skip_queue"
    last = api.get(_links(first)["next"])
    validate(last)
    assert [(e["event"], e["actor"]["login"]) for e in last.json()] == [("unlabeled", "user1")]
    assert api.get(events, headers={"If-None-Match": first.headers["etag"]}).status_code == 200
    again = api.get(
        events, params={"per_page": 3}, headers={"If-None-Match": first.headers["etag"]}
    )
    assert again.status_code == 304
    assert api.get("/repos/acme/gpu-ci/issues/43/events").status_code == 404

    emu.admin.set_team_member("gpu-admins", "Alice")
    emu.admin.set_team_member("gpu-admins", "bob", "pending")
    member = "/orgs/acme/teams/gpu-admins/memberships"
    active = api.get(f"{member}/alice")
    pending = api.get(f"{member}/bob")
    validate(active)
    validate(pending)
    assert (active.json()["state"], pending.json()["state"]) == ("active", "pending")
    missing = api.get(f"{member}/carol")
    assert missing.status_code == 404 and missing.json()["message"] == "Not Found"
    assert api.get("/orgs/acme/teams/other-team/memberships/alice").status_code == 404
    assert api.get("/orgs/other/teams/gpu-admins/memberships/alice").status_code == 404
    emu.admin.set_team_member("gpu-admins", "alice", None)
    assert api.get(f"{member}/alice").status_code == 404

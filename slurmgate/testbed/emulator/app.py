"""The emulator's HTTP face: GitHub's runner, label, run and job endpoints, and `/_emulator/`.

Besides those, the two reads of skip-queue authorization: a pull request's issue events
(paginated, conditional) and an organization team's membership of one login (200 or 404).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from slurmgate.testbed.emulator.apps import app_admin_routes, app_routes, refusal_for
from slurmgate.testbed.emulator.state import (
    API_DOCS,
    EmuJob,
    EmulatorInputError,
    EmulatorState,
    EmuRun,
    EmuRunner,
    FaultPlan,
)

log = logging.getLogger(__name__)

_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
REPO_RUNNERS = "/repos/{owner}/{repo}/actions/runners"
ORG_RUNNERS = "/orgs/{org}/actions/runners"
REPO_ACTIONS = "/repos/{owner}/{repo}/actions"


class ApiError(Exception):
    """An error answer in GitHub's shape."""

    def __init__(self, status: int, message: str, errors: list[str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.errors = errors

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"message": self.message, "documentation_url": API_DOCS}
        if self.status == 422:
            body["errors"] = self.errors or [self.message]
        else:
            body["status"] = str(self.status)
        return body


def _etag(payload: bytes) -> str:
    return '"' + hashlib.sha256(payload).hexdigest()[:40] + '"'


def _etag_matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    wanted = etag.removeprefix("W/")
    return any(
        tag.strip() == "*" or tag.strip().removeprefix("W/") == wanted for tag in header.split(",")
    )


def _dumps(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


# ---- scope and lookups --------------------------------------------------------------------------


def _check_scope(request: Request, state: EmulatorState) -> None:
    params = request.path_params
    if "org" in params:
        if params["org"].casefold() != state.owner.casefold():
            raise ApiError(404, "Not Found")
    elif "owner" in params and state.known_repo(f"{params['owner']}/{params['repo']}") is None:
        raise ApiError(404, "Not Found")


def _in_repo(request: Request, state: EmulatorState, run: EmuRun) -> EmuRun:
    """The run, or GitHub's 404 when it belongs to another repository than the path's."""
    path_repo = state.known_repo(f"{request.path_params['owner']}/{request.path_params['repo']}")
    if path_repo != state.run_repo(run):
        raise ApiError(404, "Not Found")
    return run


def _int_param(request: Request, name: str) -> int:
    try:
        return int(request.path_params[name])
    except ValueError:
        raise ApiError(404, "Not Found") from None


T = TypeVar("T")


def _found(table: Mapping[int, T], request: Request, param: str) -> T:
    """The object the path parameter `param` names, or GitHub's 404."""
    found = table.get(_int_param(request, param))
    if found is None:
        raise ApiError(404, "Not Found")
    return found


def _runner(request: Request, state: EmulatorState) -> EmuRunner:
    return _found(state.runners, request, "runner_id")


def _page(
    request: Request, items: list[T], key: str, render: Callable[[T], Any]
) -> tuple[int, Any, dict[str, str]]:
    """A 200 answer listing one page of `items` under `key`, with GitHub's total_count."""
    chunk, headers = _paginate(request, items)
    return 200, {"total_count": len(items), key: [render(item) for item in chunk]}, headers


def _paginate(request: Request, items: list[T]) -> tuple[list[T], dict[str, str]]:
    """GitHub pagination: per_page (default 30, max 100) and page, plus a Link header."""
    query = request.query_params
    try:
        per_page = int(query.get("per_page", "30"))
        page = int(query.get("page", "1"))
    except ValueError:
        raise ApiError(422, "Validation Failed", ["per_page and page must be integers"]) from None
    per_page = min(100, max(1, per_page))
    page = max(1, page)
    last = max(1, math.ceil(len(items) / per_page))
    chunk = items[(page - 1) * per_page : page * per_page]
    links: list[str] = []

    def url(p: int) -> str:
        return str(request.url.include_query_params(per_page=per_page, page=p))

    if page > 1:
        links.append(f'<{url(min(page - 1, last))}>; rel="prev"')
    if page < last:
        links.append(f'<{url(page + 1)}>; rel="next"')
        links.append(f'<{url(last)}>; rel="last"')
    if page > 1:
        links.append(f'<{url(1)}>; rel="first"')
    return chunk, ({"link": ", ".join(links)} if links else {})


async def _labels_body(request: Request, minimum: int) -> list[str]:
    try:
        body = json.loads(await request.body() or b"null")
    except ValueError:
        raise ApiError(400, "Problems parsing JSON") from None
    labels = body.get("labels") if isinstance(body, dict) else None
    if not isinstance(labels, list):
        raise ApiError(422, "Invalid request.", ['"labels" is a required array of label names'])
    if not minimum <= len(labels) <= 100:
        raise ApiError(
            422, "Invalid request.", [f"labels must have {minimum} to 100 items, got {len(labels)}"]
        )
    if not all(isinstance(x, str) and x.strip() for x in labels):
        raise ApiError(422, "Invalid request.", ["every label must be a non-empty string"])
    return [x.strip() for x in labels]


# ---- GitHub endpoints ---------------------------------------------------------------------------
# Each handler returns (status, body) or raises ApiError; `_api` wraps auth, faults, quota, ETag.


async def list_runners(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    name = request.query_params.get("name")
    with state.lock:
        runners = sorted(state.runners.values(), key=lambda r: r.id)
        if name is not None:
            runners = [r for r in runners if r.name == name]
        return _page(request, runners, "runners", state.runner_json)


async def get_runner(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    with state.lock:
        return 200, state.runner_json(_runner(request, state)), {}


async def delete_runner(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    with state.lock:
        runner = _runner(request, state)
        if runner.busy:
            raise ApiError(422, "Bad request", [f'Runner "{runner.name}" is still running a job'])
        del state.runners[runner.id]
    return 204, None, {}


async def list_labels(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    with state.lock:
        return 200, state.labels_json(_runner(request, state)), {}


async def add_labels(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    return await _write_labels(request, state, 1, state.add_labels)


async def set_labels(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    return await _write_labels(request, state, 0, state.set_labels)


async def _write_labels(
    request: Request,
    state: EmulatorState,
    at_least: int,
    write: Callable[[EmuRunner, list[str]], object],
) -> tuple[int, Any, dict[str, str]]:
    """POST (add, at least one label) or PUT (replace, possibly none); answers the full list."""
    labels = await _labels_body(request, at_least)
    with state.lock:
        runner = _runner(request, state)
        write(runner, labels)
        return 200, state.labels_json(runner), {}


async def remove_all_labels(
    request: Request, state: EmulatorState
) -> tuple[int, Any, dict[str, str]]:
    with state.lock:
        runner = _runner(request, state)
        state.remove_all_labels(runner)
        return 200, state.labels_json(runner, only_read_only=True), {}


async def remove_label(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    name = request.path_params["name"]
    with state.lock:
        runner = _runner(request, state)
        outcome = state.remove_label(runner, name)
        if outcome == "absent":
            raise ApiError(404, "Not Found")
        if outcome == "read-only":
            # GitHub's answer here is unverified; the spec declares 422 for this operation and
            # a read-only label is never removable, so the emulator refuses it with 422.
            raise ApiError(
                422, "Validation Failed", [f"label {name!r} is read-only and cannot be removed"]
            )
        return 200, state.labels_json(runner), {}


async def list_runs(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    wanted = request.query_params.get("status")
    with state.lock:
        home = state.known_repo(f"{request.path_params['owner']}/{request.path_params['repo']}")
        runs = sorted(
            (r for r in state.runs.values() if state.run_repo(r) == home),
            key=lambda r: r.id,
            reverse=True,
        )
        if wanted:
            runs = [r for r in runs if wanted in state.run_status(r)]
        return _page(request, runs, "workflow_runs", state.run_json)


async def get_run(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    with state.lock:
        return (
            200,
            state.run_json(_in_repo(request, state, _found(state.runs, request, "run_id"))),
            {},
        )


async def list_run_jobs(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    flt = request.query_params.get("filter", "latest")
    if flt not in ("latest", "all"):
        raise ApiError(422, "Validation Failed", [f"filter {flt!r} is not latest or all"])
    with state.lock:
        run = _in_repo(request, state, _found(state.runs, request, "run_id"))
        attempt = request.path_params.get("attempt_number")
        jobs = sorted((j for j in state.jobs.values() if j.run_id == run.id), key=lambda j: j.id)
        if attempt is not None:
            number = _int_param(request, "attempt_number")
            if not 1 <= number <= run.run_attempt:
                raise ApiError(404, "Not Found")
            jobs = [j for j in jobs if j.run_attempt == number]
        elif flt == "latest":
            jobs = [j for j in jobs if j.run_attempt == run.run_attempt]
        return _page(request, jobs, "jobs", state.job_json)


async def get_job(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    with state.lock:
        job = _found(state.jobs, request, "job_id")
        _in_repo(request, state, state.runs[job.run_id])
        return 200, state.job_json(job), {}


async def list_org_repos(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    """GET /orgs/{org}/repos: a bare JSON array of the organization's repositories."""
    with state.lock:
        chunk, headers = _paginate(request, list(state.repo_names))
        return 200, [state.repository_json(name) for name in chunk], headers


async def list_issue_events(
    request: Request, state: EmulatorState
) -> tuple[int, Any, dict[str, str]]:
    """A bare JSON array of the issue's events, oldest first (GitHub's order), paginated."""
    number = _int_param(request, "issue_number")
    with state.lock:
        events = state.issue_events.get(number)
        if events is None:
            raise ApiError(404, "Not Found")
        chunk, headers = _paginate(request, list(events))
        return 200, [state.issue_event_json(number, event) for event in chunk], headers


async def get_team_membership(
    request: Request, state: EmulatorState
) -> tuple[int, Any, dict[str, str]]:
    slug, login = request.path_params["team_slug"], request.path_params["username"]
    member_state = state.team_membership(slug, login)
    if member_state is None:
        raise ApiError(404, "Not Found")
    return 200, state.team_membership_json(slug, login, member_state), {}


async def rate_limit(request: Request, state: EmulatorState) -> tuple[int, Any, dict[str, str]]:
    headers = state.quota_headers()
    core = {
        "limit": int(headers["x-ratelimit-limit"]),
        "remaining": int(headers["x-ratelimit-remaining"]),
        "reset": int(headers["x-ratelimit-reset"]),
        "used": int(headers["x-ratelimit-used"]),
    }
    search = {"limit": 30, "remaining": 30, "reset": core["reset"], "used": 0}
    return 200, {"resources": {"core": core, "search": search}, "rate": core}, {}


Endpoint = Callable[[Request, EmulatorState], Any]


def _error_response(
    state: EmulatorState, error: ApiError, headers: dict[str, str] | None = None
) -> Response:
    with state.lock:
        state.statuses[error.status] += 1
    merged = {**state.quota_headers(), **(headers or {})}
    return JSONResponse(error.body(), status_code=error.status, headers=merged)


async def _stall(seconds: float) -> bool:
    """Sleep for an injected delay; False when server shutdown cut it short (not an app error)."""
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        return False
    return True


def _retry_after(seconds: float) -> str:
    """Retry-After as GitHub writes it (whole seconds), or a fraction when the plan compresses."""
    return str(int(seconds)) if float(seconds).is_integer() else f"{seconds:g}"


def _planned_refusal(state: EmulatorState, kind: str, method: str) -> Response | None:
    """The answer of a fault-plan fault that refuses the request before it is applied."""
    retry = {"retry-after": _retry_after(state.fault_plan.retry_after_s)}
    if kind == "server-error":
        status = state.server_error_status()
        return _error_response(state, ApiError(status, "Server Error (injected)"))
    if kind == "rate-limit":
        return _error_response(state, ApiError(429, "Too Many Requests (injected)"), retry)
    if kind == "secondary-limit":
        message = (
            "You have exceeded a secondary rate limit. Please wait a few minutes before you "
            "try again. (injected)"
        )
        return _error_response(state, ApiError(403, message), retry)
    if kind == "lost-answer" and method not in _WRITES:
        return _error_response(state, ApiError(502, "Bad Gateway (injected)"))
    return None


def _api(
    state: EmulatorState,
    template: str,
    handler: Endpoint,
    methods: list[str],
    needs: tuple[str, ...] = (),
) -> Route:
    """Wrap one GitHub endpoint: auth, counters, faults, quota, ETag/304, rate-limit headers.

    `needs`: the App permissions any one of which (read for GET, write otherwise) lets an
    installation token call it, as GitHub's "Permissions required for GitHub Apps" lists them.
    """
    free_of_quota = template == "/rate_limit"

    async def endpoint(request: Request) -> Response:
        method = request.method
        path = request.url.path
        with state.lock:
            state.requests[f"{method} {template}"] += 1
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() not in ("bearer", "token") or not token.strip():
            return _error_response(state, ApiError(401, "Requires authentication"))
        presented = token.strip()
        # The emulator's own token first: a configured token may have GitHub's ghs_ shape too.
        if state.token is None or not hmac.compare_digest(presented, state.token):
            granted = state.apps.check_token(presented)  # None: not a ghs_ token
            if granted is False or (granted is None and state.token):
                return _error_response(state, ApiError(401, "Bad credentials"))
            accepted = refusal_for(granted, needs, method) if isinstance(granted, dict) else None
            if accepted is not None:
                state.consume_quota()
                return _error_response(
                    state,
                    ApiError(403, "Resource not accessible by integration"),
                    {"x-accepted-github-permissions": accepted},
                )
        latency = state.take_fault("latency", method, path)
        if latency is not None and not await _stall(latency.latency_ms / 1000):
            return Response(status_code=503)
        fault = state.take_fault("status", method, path)
        if fault is not None:
            return _error_response(state, ApiError(fault.status, "Injected fault"))
        fault = state.take_fault("rate_limit", method, path)
        if fault is not None:
            retry = fault.retry_after_s
            return _error_response(
                state,
                ApiError(fault.status, "You have exceeded a secondary rate limit."),
                {} if retry is None else {"retry-after": str(math.ceil(retry))},
            )
        if not free_of_quota and state.quota_exhausted():
            return _error_response(
                state,
                ApiError(403, f"API rate limit exceeded for installation on {state.repo}."),
            )
        hang_after = 0.0
        planned = None if free_of_quota else state.draw_fault()
        if planned is not None:
            refused = _planned_refusal(state, planned, method)
            if refused is not None:
                return refused
            if planned == "timeout":
                hang_after = state.fault_plan.delay_s
        if method in _WRITES:
            _, write_fault = state.next_write()
            if write_fault is not None and write_fault.kind == "fail_nth_write":
                if not free_of_quota:
                    state.consume_quota()
                return _error_response(state, ApiError(write_fault.status, "Injected write fault"))
            if write_fault is not None and write_fault.kind == "hang_nth_write":
                if not write_fault.applied:
                    await _stall(write_fault.hang_s)
                    return _error_response(state, ApiError(write_fault.status, "Injected hang"))
                hang_after = write_fault.hang_s
        try:
            _check_scope(request, state)
            status, body, headers = await handler(request, state)
        except ApiError as error:
            if not free_of_quota:
                state.consume_quota()
            return _error_response(state, error)
        if hang_after and not await _stall(hang_after):
            return Response(status_code=503)
        if planned == "lost-answer":
            # the write above was applied; only its answer is lost, as a gateway would lose it
            return _error_response(state, ApiError(502, "Bad Gateway (injected: answer lost)"))
        payload = b"" if body is None else _dumps(body)
        etag = _etag(payload)
        if method == "GET" and _etag_matches(request.headers.get("if-none-match"), etag):
            with state.lock:
                state.not_modified[f"{method} {template}"] += 1
                state.statuses[304] += 1
            return Response(status_code=304, headers={**state.quota_headers(), "etag": etag})
        if not free_of_quota:
            state.consume_quota()
        with state.lock:
            state.statuses[status] += 1
        out_headers = {**state.quota_headers(), **headers}
        if body is None:
            return Response(status_code=status, headers=out_headers)
        out_headers["etag"] = etag
        out_headers["cache-control"] = "private, max-age=60, s-maxage=60"
        return Response(
            payload, status_code=status, headers=out_headers, media_type="application/json"
        )

    return Route(template, endpoint, methods=methods, name=template)


ORG_RUNNERS_PERM = "organization_self_hosted_runners"
"""The organisation permission GitHub's settings page calls "Self-hosted runners"."""


def github_routes(state: EmulatorState) -> list[BaseRoute]:
    routes: list[BaseRoute] = []
    for base, runners in ((REPO_RUNNERS, "administration"), (ORG_RUNNERS, ORG_RUNNERS_PERM)):
        need = (runners,)
        routes += [
            _api(state, base, list_runners, ["GET"], need),
            _api(state, base + "/{runner_id}", get_runner, ["GET"], need),
            _api(state, base + "/{runner_id}", delete_runner, ["DELETE"], need),
            _api(state, base + "/{runner_id}/labels", list_labels, ["GET"], need),
            _api(state, base + "/{runner_id}/labels", add_labels, ["POST"], need),
            _api(state, base + "/{runner_id}/labels", set_labels, ["PUT"], need),
            _api(state, base + "/{runner_id}/labels", remove_all_labels, ["DELETE"], need),
            _api(state, base + "/{runner_id}/labels/{name}", remove_label, ["DELETE"], need),
        ]
    actions = ("actions",)
    routes += [
        _api(state, REPO_ACTIONS + "/runs", list_runs, ["GET"], actions),
        _api(state, REPO_ACTIONS + "/runs/{run_id}", get_run, ["GET"], actions),
        _api(state, REPO_ACTIONS + "/runs/{run_id}/jobs", list_run_jobs, ["GET"], actions),
        _api(
            state,
            REPO_ACTIONS + "/runs/{run_id}/attempts/{attempt_number}/jobs",
            list_run_jobs,
            ["GET"],
            actions,
        ),
        _api(state, REPO_ACTIONS + "/jobs/{job_id}", get_job, ["GET"], actions),
        _api(state, "/orgs/{org}/repos", list_org_repos, ["GET"], ("metadata",)),
        _api(
            state,
            "/repos/{owner}/{repo}/issues/{issue_number}/events",
            list_issue_events,
            ["GET"],
            ("issues", "pull_requests"),
        ),
        _api(
            state,
            "/orgs/{org}/teams/{team_slug}/memberships/{username}",
            get_team_membership,
            ["GET"],
            ("members",),
        ),
        _api(state, "/rate_limit", rate_limit, ["GET"]),
    ]
    return routes


# ---- admin API (no auth; GitHub never uses this prefix) ----------------------------------------


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise EmulatorInputError("request body is not JSON") from None
    if not isinstance(body, dict):
        raise EmulatorInputError("request body must be a JSON object")
    return body


def admin_routes(state: EmulatorState) -> list[BaseRoute]:
    def admin(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                status, body = await handler(request)
            except EmulatorInputError as exc:
                return JSONResponse({"message": str(exc)}, status_code=400)
            except KeyError as exc:
                return JSONResponse({"message": f"no such id {exc}"}, status_code=404)
            return JSONResponse(body, status_code=status)

        return endpoint

    async def add_job(request: Request) -> tuple[int, Any]:
        body = await _json(request)
        try:
            duration = float(body.get("duration_s", 5.0))
            run_id = body.get("run_id")
            run_id = None if run_id is None else int(run_id)
            pull_request = body.get("pull_request")
            pull_request = None if pull_request is None else int(pull_request)
            repo = body.get("repo")
            if repo is not None and not isinstance(repo, str):
                raise TypeError
        except (TypeError, ValueError):
            raise EmulatorInputError(
                "duration_s must be a number, run_id and pull_request integers, repo OWNER/NAME"
            ) from None
        job = state.add_job(
            body.get("labels"),  # type: ignore[arg-type]  # validated by add_job
            duration,
            name=body.get("name"),
            run_id=run_id,
            pull_request=pull_request,
            repo=repo,
        )
        return 201, {"id": job.id, "run_id": job.run_id}

    async def add_runner(request: Request) -> tuple[int, Any]:
        body = await _json(request)
        labels = body.get("labels", [])
        if not isinstance(labels, list) or not all(isinstance(x, str) and x for x in labels):
            raise EmulatorInputError("labels must be a list of non-empty strings")
        read_only = body.get("read_only", ["self-hosted", "Linux", "X64"])
        if not isinstance(read_only, list) or not all(isinstance(x, str) for x in read_only):
            raise EmulatorInputError("read_only must be a list of strings")
        runner = state.add_runner(
            str(body.get("name") or ""),
            labels,
            status=str(body.get("status", "online")),
            read_only=tuple(read_only),
        )
        return 201, state.runner_json(runner)

    async def runner_status(request: Request) -> tuple[int, Any]:
        body = await _json(request)
        runner = state.set_runner_status(
            _admin_id(request, "runner_id"), str(body.get("status", ""))
        )
        return 200, state.runner_json(runner)

    async def complete_job(request: Request) -> tuple[int, Any]:
        body = await _json(request)
        conclusion = str(body.get("conclusion", "success"))
        job = state.finish_job(_admin_id(request, "job_id"), conclusion)
        return 200, state.job_json(job)

    async def cancel_job(request: Request) -> tuple[int, Any]:
        job = state.finish_job(_admin_id(request, "job_id"), "cancelled")
        return 200, state.job_json(job)

    async def rerun(request: Request) -> tuple[int, Any]:
        run_id = _admin_id(request, "run_id")
        jobs = state.rerun(run_id)
        attempt = state.runs[run_id].run_attempt
        return 201, {"run_id": run_id, "run_attempt": attempt, "job_ids": [j.id for j in jobs]}

    async def add_fault(request: Request) -> tuple[int, Any]:
        fault = state.add_fault(await _json(request))
        return 201, {"id": fault.id, "kind": fault.kind}

    async def clear_faults(request: Request) -> tuple[int, Any]:
        state.clear_faults()
        return 200, {"faults": 0}

    async def set_fault_plan(request: Request) -> tuple[int, Any]:
        state.set_fault_plan(FaultPlan.from_spec(await _json(request)))
        return 200, state.fault_plan.describe()

    async def fault_plan(request: Request) -> tuple[int, Any]:
        with state.lock:
            injected = dict(sorted(state.faults_injected.items()))
        return 200, {**state.fault_plan.describe(), "injected": injected}

    async def stats(request: Request) -> tuple[int, Any]:
        return 200, state.stats()

    async def reset_stats(request: Request) -> tuple[int, Any]:
        state.reset_stats()
        return 200, state.stats()

    async def dump(request: Request) -> tuple[int, Any]:
        return 200, state.dump()

    async def quota(request: Request) -> tuple[int, Any]:
        body = await _json(request)
        try:
            limit = body.get("limit")
            window = body.get("window_s")
            state.set_quota(
                None if limit is None else int(limit), None if window is None else float(window)
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, EmulatorInputError):
                raise
            raise EmulatorInputError("limit must be an integer and window_s a number") from None
        return 200, state.quota_headers()

    async def webhooks(request: Request) -> tuple[int, Any]:
        body = await _json(request)
        urls = body.get("urls", [])
        if not isinstance(urls, list) or not all(
            isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls
        ):
            raise EmulatorInputError("urls must be a list of http(s) URLs")
        secret = body.get("secret")
        if secret is not None and not isinstance(secret, str):
            raise EmulatorInputError("secret must be a string")
        with state.lock:
            state.webhook_urls = list(urls)
            state.webhook_secret = secret
        return 200, {"urls": urls, "signed": bool(secret)}

    async def tick(request: Request) -> tuple[int, Any]:
        state.tick()
        return 200, {"ok": True}

    async def issue_label(request: Request) -> tuple[int, Any]:
        body = await _json(request)
        action = body.get("action", "labeled")
        if action not in ("labeled", "unlabeled"):
            raise EmulatorInputError(f"action {action!r} is not labeled or unlabeled")
        write = state.label_issue if action == "labeled" else state.unlabel_issue
        record = write(
            _admin_id(request, "number"), str(body.get("label", "")), str(body.get("actor", ""))
        )
        return 201, {"id": record.id, "event": record.event}

    async def team_member(request: Request) -> tuple[int, Any]:
        body = await _json(request)
        member_state = body.get("state", "active")
        state.set_team_member(
            request.path_params["team_slug"],
            request.path_params["login"],
            None if member_state is None else str(member_state),
        )
        return 200, {"state": member_state}

    p = "/_emulator"
    return [
        Route(f"{p}/jobs", admin(add_job), methods=["POST"]),
        Route(f"{p}/jobs/{{job_id}}/complete", admin(complete_job), methods=["POST"]),
        Route(f"{p}/jobs/{{job_id}}/cancel", admin(cancel_job), methods=["POST"]),
        Route(f"{p}/runs/{{run_id}}/rerun", admin(rerun), methods=["POST"]),
        Route(f"{p}/runners", admin(add_runner), methods=["POST"]),
        Route(f"{p}/runners/{{runner_id}}/status", admin(runner_status), methods=["POST"]),
        Route(f"{p}/faults", admin(add_fault), methods=["POST"]),
        Route(f"{p}/faults", admin(clear_faults), methods=["DELETE"]),
        Route(f"{p}/fault-plan", admin(set_fault_plan), methods=["PUT"]),
        Route(f"{p}/fault-plan", admin(fault_plan), methods=["GET"]),
        Route(f"{p}/stats", admin(stats), methods=["GET"]),
        Route(f"{p}/stats/reset", admin(reset_stats), methods=["POST"]),
        Route(f"{p}/state", admin(dump), methods=["GET"]),
        Route(f"{p}/quota", admin(quota), methods=["POST"]),
        Route(f"{p}/tick", admin(tick), methods=["POST"]),
        Route(f"{p}/webhooks", admin(webhooks), methods=["POST"]),
        Route(f"{p}/issues/{{number}}/labels", admin(issue_label), methods=["POST"]),
        Route(f"{p}/teams/{{team_slug}}/members/{{login}}", admin(team_member), methods=["PUT"]),
    ]


def _admin_id(request: Request, name: str) -> int:
    try:
        return int(request.path_params[name])
    except ValueError:
        raise EmulatorInputError(
            f"{name} {request.path_params[name]!r} is not an integer"
        ) from None


# ---- webhooks (the job-change seam) --------------------------------------------------------------


def sign(secret: str, payload: bytes) -> str:
    """GitHub's X-Hub-Signature-256 value for a payload."""
    return "sha256=" + hmac.new(secret.encode(), payload, hashlib.sha256).hexdigest()


async def _send_webhooks(state: EmulatorState, queue: asyncio.Queue[dict[str, Any]]) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            payload = await queue.get()
            data = _dumps(payload)
            headers = {
                "content-type": "application/json",
                "x-github-event": "workflow_job",
                "x-github-delivery": str(uuid.uuid4()),
                "user-agent": "GitHub-Hookshot/slurmgate-emulator",
            }
            if state.webhook_secret:
                headers["x-hub-signature-256"] = sign(state.webhook_secret, data)
            for url in list(state.webhook_urls):
                try:
                    await client.post(url, content=data, headers=headers)
                except httpx.HTTPError as exc:
                    log.warning("webhook to %s failed: %s", url, type(exc).__name__)


# ---- app ----------------------------------------------------------------------------------------


def create_app(state: EmulatorState, *, tick_s: float = 0.1) -> Starlette:
    """The emulator as an ASGI app; a background loop completes and dispatches jobs every tick_s."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        def enqueue(action: str, job: EmuJob) -> None:
            if state.webhook_urls:  # the payload is a snapshot taken now, under the state lock
                loop.call_soon_threadsafe(queue.put_nowait, state.webhook_payload(action, job))

        state.listeners.append(enqueue)
        tasks = [
            asyncio.create_task(_tick_loop(state, tick_s)),
            asyncio.create_task(_send_webhooks(state, queue)),
        ]
        try:
            yield
        finally:
            if enqueue in state.listeners:
                state.listeners.remove(enqueue)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    routes = [
        *github_routes(state),
        *app_routes(state),
        *admin_routes(state),
        *app_admin_routes(state, "/_emulator"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.emulator = state
    return app


async def _tick_loop(state: EmulatorState, tick_s: float) -> None:
    while True:
        try:
            state.tick()
        except Exception:  # a bug in one tick must not stop dispatch for good
            log.exception("emulator tick failed")
        await asyncio.sleep(tick_s)

"""Async GitHub REST client for runners, labels, runs and jobs: paced, conditional, typed errors.

It also reads what skip-queue authorization needs: a pull request's label events and a team
membership. The request path under the endpoints (pacing, retries, ETags, bounded pages) is
`session.py`'s; items are checked in `payloads.py`: a malformed one is skipped and warned
about once, and the listing goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from slurmgate.admission.model import Job, JobStatus, Runner
from slurmgate.github.errors import AuthError, MalformedResponse, NotFound, refused_repository
from slurmgate.github.pacing import RateLimit
from slurmgate.github.payloads import (
    LabelEvent,
    MalformedPayload,
    parse_job,
    parse_label_event,
    parse_run_id,
    parse_run_pull_requests,
    parse_runner,
    parse_team_membership,
)
from slurmgate.github.scope import is_repo
from slurmgate.github.session import PER_PAGE, GitHubSession

log = logging.getLogger(__name__)

REPOS_TTL_S = 60.0
"""How long an all-repos scope's repository list is reused before it is read again."""
MAX_EVENT_PAGES = 10
"""Most pages of one pull request's issue events read: 1,000 events (a PR with more has its
label events refused as unreadable, so it is not authorized to skip the queue)."""


@dataclass(frozen=True, slots=True)
class JobSource:
    """Where a listed job came from: its repository, and the pull requests its run is for
    (GitHub's `pull_requests` of the run; empty for a push, or a PR from a fork)."""

    repo: str
    pull_requests: frozenset[int] = frozenset()


class GitHubClient(GitHubSession):
    """Talks to GitHub for one scope. Use `async with GitHubClient(...) as gh:` or call aclose()."""

    # ---- runners and labels ----

    async def list_runners(self, conditional: bool = True) -> list[Runner]:
        """Every runner of the scope, following Link; conditional=False for verification reads.

        A runner of the wrong shape is left out (warned about once); a page of the wrong shape
        fails the whole listing with MalformedResponse, since a partial fleet is no fleet.
        """
        template = self.scope.runners_template
        pages = await self._paginate(
            template, self.scope.runners_path, {"per_page": PER_PAGE}, conditional
        )
        runners: dict[int, Runner] = {}
        unreadable = 0
        for item in self._items(pages, "runners", template):
            try:
                runner = parse_runner(item)
            except MalformedPayload as exc:
                self._skip(exc)
                unreadable += 1
                continue
            # a runner registered between two page reads shifts the pages: it may show twice
            runners.setdefault(runner.id, runner)
        self.unreadable_runners = unreadable
        return list(runners.values())

    async def get_runner(self, runner_id: int) -> Runner:
        """One runner, read fresh. Raises NotFound when it does not exist."""
        template = self._tpl("/{runner_id}")
        reply = await self._call("GET", template, self._runner_path(runner_id))
        try:
            return parse_runner(reply.body)
        except MalformedPayload as exc:
            raise MalformedResponse("GET", template, reply.status, str(exc)) from None

    async def list_labels(self, runner_id: int) -> list[str]:
        template = self._tpl("/{runner_id}/labels")
        reply = await self._call("GET", template, f"{self._runner_path(runner_id)}/labels")
        names = _label_names(reply.body)
        if names is None:
            raise MalformedResponse("GET", template, reply.status, "labels are not label objects")
        return names

    async def add_labels(self, runner_id: int, labels: list[str] | tuple[str, ...]) -> list[str]:
        """POST custom labels (1..100); returns the runner's full label list afterwards."""
        return await self._write_labels("POST", runner_id, labels)

    async def set_labels(self, runner_id: int, labels: list[str] | tuple[str, ...]) -> list[str]:
        """PUT: replace every custom label (0..100); returns the full label list afterwards."""
        return await self._write_labels("PUT", runner_id, labels)

    async def _write_labels(
        self, method: str, runner_id: int, labels: list[str] | tuple[str, ...]
    ) -> list[str]:
        path = f"{self._runner_path(runner_id)}/labels"
        body = {"labels": list(labels)}
        reply = await self._call(method, self._tpl("/{runner_id}/labels"), path, json_body=body)
        # The write's status code says it landed; its echo of the labels is only informative.
        names = _label_names(reply.body)
        if names is None:
            log.warning("%s labels of runner %s: GitHub echoed no label list", method, runner_id)
        return names or []

    async def remove_label(self, runner_id: int, label: str) -> bool:
        """DELETE one custom label. False when GitHub answers 404 (already absent): idempotent."""
        try:
            await self._call(
                "DELETE",
                self._tpl("/{runner_id}/labels/{name}"),
                f"{self._runner_path(runner_id)}/labels/{quote(label, safe='')}",
            )
        except NotFound:
            return False
        return True

    # ---- runs and jobs ----

    async def list_runs(self, status: str, *, repo: str | None = None) -> list[dict[str, Any]]:
        """Workflow runs with `status` (queued / in_progress) of one repo, or of every job repo."""
        template = "/repos/{owner}/{repo}/actions/runs"
        runs: list[dict[str, Any]] = []
        for name in (repo,) if repo else await self.job_repos():
            pages = await self._paginate(
                template,
                f"/repos/{name}/actions/runs",
                {"status": status, "per_page": PER_PAGE},
                True,
            )
            runs.extend(self._items(pages, "workflow_runs", template))
        return runs

    async def list_run_jobs(self, run_id: int, *, repo: str | None = None) -> list[Job]:
        """The latest attempt's jobs of one run (conditional, paginated)."""
        name = repo or self._only_job_repo()
        template = "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs"
        pages = await self._paginate(
            template,
            f"/repos/{name}/actions/runs/{int(run_id)}/jobs",
            {"filter": "latest", "per_page": PER_PAGE},
            True,
        )
        jobs: list[Job] = []
        for item in self._items(pages, "jobs", template):
            try:
                jobs.append(self._job(item))
            except MalformedPayload as exc:
                self._skip(exc)
        return jobs

    async def get_job(self, job_id: int, *, repo: str | None = None) -> Job | None:
        """One job by id, read fresh; None when no scanned repository has it (404).

        Raises MalformedResponse when GitHub answers with something that is not a job: the
        job is then unknown, which is not the same as gone.
        """
        template = "/repos/{owner}/{repo}/actions/jobs/{job_id}"
        refused: AuthError | None = None
        for name in (repo,) if repo else await self.job_repos():
            try:
                reply = await self._call(
                    "GET", template, f"/repos/{name}/actions/jobs/{int(job_id)}"
                )
            except NotFound:
                continue
            except AuthError as exc:
                if repo or not refused_repository(exc):
                    raise
                refused = refused or exc  # the job may be there: not gone, unknown
                continue
            try:
                return self._job(reply.body)
            except MalformedPayload as exc:
                self._skip(exc)
                raise MalformedResponse("GET", template, reply.status, str(exc)) from None
        if refused is not None:
            raise refused
        return None

    async def get_run_pull_requests(self, run_id: int, *, repo: str) -> frozenset[int]:
        """The pull requests a workflow run is for (conditional); empty for a push or a fork's
        PR. Raises MalformedResponse when the answer is not a run."""
        template = "/repos/{owner}/{repo}/actions/runs/{run_id}"
        reply = await self._call(
            "GET", template, f"/repos/{repo}/actions/runs/{int(run_id)}", conditional=True
        )
        if not isinstance(reply.body, dict):
            raise MalformedResponse("GET", template, reply.status, "the run is not an object")
        return parse_run_pull_requests(reply.body)

    async def list_active_jobs(self) -> list[Job]:
        """Queued and in-progress jobs of every job repo (active runs first, then their jobs).

        A run listing or a run's job listing that GitHub answers with a malformed body is
        skipped with a warning (once) and the others are still read: a job it hid is not
        admitted this tick, and a lease job is still looked up by id by the snapshot.
        """
        jobs, _ = await self.read_active_jobs()
        return jobs

    async def read_active_jobs(self) -> tuple[list[Job], dict[int, JobSource]]:
        """`list_active_jobs`, with where each job came from (its repository and its run's
        pull requests), keyed by job id."""
        jobs: dict[int, Job] = {}
        sources: dict[int, JobSource] = {}
        repos = await self.job_repos()
        self.unread_repos = {}
        for name in repos:
            seen: set[int] = set()
            for status in ("queued", "in_progress"):
                try:
                    runs = await self.list_runs(status, repo=name)
                except MalformedResponse as exc:
                    self.problems.report(f"{status} run listing", name, str(exc), "skipped")
                    continue
                except (NotFound, AuthError) as exc:
                    # One repository of many that cannot be read (renamed, deleted, or not
                    # granted to the App) must not stop the others' admissions; alone, it is
                    # the scope that is wrong, and the tick says so.
                    if len(repos) == 1 or not refused_repository(exc):
                        raise
                    self.unread_repos[name] = str(exc)
                    for job_id in [i for i, source in sources.items() if source.repo == name]:
                        jobs.pop(job_id, None)  # half a repository is none of it
                        sources.pop(job_id, None)
                    break
                for run in runs:
                    try:
                        run_id = parse_run_id(run)
                    except MalformedPayload as exc:
                        self._skip(exc)
                        continue
                    if run_id in seen:
                        continue
                    seen.add(run_id)
                    try:
                        run_jobs = await self.list_run_jobs(run_id, repo=name)
                    except MalformedResponse as exc:
                        self.problems.report("job listing of run", str(run_id), str(exc), "skipped")
                        continue
                    except NotFound:
                        continue  # the run was deleted since it was listed: no jobs to admit
                    source = JobSource(name, parse_run_pull_requests(run))
                    for job in run_jobs:
                        if job.active:
                            jobs[job.id] = job
                            sources[job.id] = source
        return sorted(jobs.values(), key=lambda j: j.id), sources

    async def job_repos(self) -> tuple[str, ...]:
        """The repositories whose runs and jobs are read: the scope's own, or with `all_repos`
        every repository `GET /orgs/{org}/repos` lists (conditional, so an unchanged list costs
        304s; archived and disabled ones and items of the wrong shape are passed over)."""
        if not self.scope.all_repos:
            return self.scope.job_repos
        if self._repos_read is not None and time.monotonic() - self._repos_read[0] < REPOS_TTL_S:
            return self._repos_read[1]
        template = "/orgs/{org}/repos"
        pages = await self._paginate(
            template, f"/orgs/{self.scope.org}/repos", {"per_page": PER_PAGE}, True
        )
        owner = (self.scope.org or "").casefold()
        names: list[str] = []
        for number, page in enumerate(pages, start=1):
            if not isinstance(page, list) or len(page) > PER_PAGE:
                raise MalformedResponse(
                    "GET", template, 200, f"page {number} is not a list of at most 100 repositories"
                )
            for item in page:
                name = item.get("full_name") if isinstance(item, dict) else None
                if not isinstance(name, str) or not is_repo(name):
                    self.problems.report("repository", str(name)[:100], "no OWNER/NAME", "skipped")
                    continue
                if name.partition("/")[0].casefold() != owner:
                    continue  # another owner's repository is not this scope's
                if item.get("archived") is True or item.get("disabled") is True:
                    continue  # no workflow runs there
                names.append(name)
        found = tuple(dict.fromkeys(names))
        self._repos_read = (time.monotonic(), found)
        return found

    # ---- pull requests and teams (skip-queue authorization) ----

    async def list_label_events(self, repo: str, number: int) -> list[LabelEvent]:
        """The label events of issue or pull request `number` of `repo`, in GitHub's order
        (oldest first); conditional, so an unchanged listing costs one 304 a page.

        Events of other kinds are passed over. Raises NotFound for an issue the token cannot
        see, and MalformedResponse for a page that is not a list, more than MAX_EVENT_PAGES
        pages, or a label event of the wrong shape (it might be the one that decides).
        """
        template = "/repos/{owner}/{repo}/issues/{issue_number}/events"
        pages = await self._paginate(
            template,
            f"/repos/{repo}/issues/{int(number)}/events",
            {"per_page": PER_PAGE},
            True,
            max_pages=MAX_EVENT_PAGES,
        )
        events: list[LabelEvent] = []
        for page_number, page in enumerate(pages, start=1):
            if not isinstance(page, list) or len(page) > PER_PAGE:
                raise MalformedResponse(
                    "GET", template, 200, f"page {page_number} is not a list of at most 100 events"
                )
            for item in page:
                try:
                    event = parse_label_event(item)
                except MalformedPayload as exc:
                    raise MalformedResponse("GET", template, 200, str(exc)) from None
                if event is not None:
                    events.append(event)
        return events

    async def team_member_active(self, org: str, team_slug: str, login: str) -> bool:
        """True when `login` is an active member of the organization's team; False for a
        pending invitation or no membership (404, which is also what a team the token cannot
        see answers)."""
        template = "/orgs/{org}/teams/{team_slug}/memberships/{username}"
        path = "/orgs/{}/teams/{}/memberships/{}".format(
            *(quote(part, safe="") for part in (org, team_slug, login))
        )
        try:
            reply = await self._call("GET", template, path)
        except NotFound:
            return False
        try:
            return parse_team_membership(reply.body)
        except MalformedPayload as exc:
            raise MalformedResponse("GET", template, reply.status, str(exc)) from None

    async def fetch_rate_limit(self) -> RateLimit | None:
        """GET /rate_limit (free of primary quota); updates and returns `rate_limit`."""
        reply = await self._call("GET", "/rate_limit", "/rate_limit")
        body = reply.body if isinstance(reply.body, dict) else {}
        resources = body.get("resources")
        core = (resources.get("core") if isinstance(resources, dict) else None) or body.get("rate")
        if isinstance(core, dict):
            try:
                self._rate_limit = RateLimit(
                    limit=int(core["limit"]),
                    remaining=int(core["remaining"]),
                    reset=int(core["reset"]),
                    used=int(core["used"]),
                    resource="core",
                )
            except (KeyError, TypeError, ValueError):
                raise MalformedResponse(
                    "GET", "/rate_limit", reply.status, "core limits are not integers"
                ) from None
        return self._rate_limit

    # ---- plumbing ----

    def _tpl(self, suffix: str) -> str:
        return self.scope.runners_template + suffix

    def _runner_path(self, runner_id: int) -> str:
        return f"{self.scope.runners_path}/{int(runner_id)}"

    def _only_job_repo(self) -> str:
        repos = self.scope.job_repos
        if len(repos) != 1:
            raise ValueError(
                f"scope has {len(repos)} job repositories; pass repo=OWNER/NAME to pick one"
            )
        return repos[0]

    def _job(self, data: Any) -> Job:
        job = parse_job(data)
        if job.status is JobStatus.UNKNOWN:
            self.problems.report(
                "job",
                str(job.id),
                f"status {str(data.get('status'))[:64]!r} is not one slurmgate knows",
                "treated as not active",
            )
        return job

    def _skip(self, exc: MalformedPayload) -> None:
        self.problems.report(exc.kind, exc.item_id, exc.problem, "skipped")


def _label_names(body: Any) -> list[str] | None:
    """The label names of a labels answer, or None when it is not a list of label objects."""
    labels = body.get("labels") if isinstance(body, dict) else None
    if not isinstance(labels, list):
        return None
    names = [label.get("name") if isinstance(label, dict) else None for label in labels]
    return (
        [name for name in names if isinstance(name, str)]
        if all(isinstance(name, str) for name in names)
        else None
    )

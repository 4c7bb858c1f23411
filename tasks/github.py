"""Prefect tasks over the GitHub client: the snapshot read, one task per lease, with retries."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.states import Completed
from prefect.tasks import Task

from slurmgate.admission.batch_verify import BatchShare
from slurmgate.admission.leases import (
    Admission,
    AdmitOutcome,
    DispatchCheck,
    LeaseSteps,
    RemovalOutcome,
    UnwindReport,
    read_dispatch,
    remove_labels,
)
from slurmgate.admission.model import Admit, Snapshot
from slurmgate.blocks import GitHubScopeBlock
from slurmgate.errors import is_transient
from slurmgate.github.app_auth import (
    AppCredentialsError,
    GitHubAppCredentials,
    credentials_from_env,
)
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import ScopeError
from slurmgate.github.snapshot import EventReads, take_snapshot
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.settings.github import GitHubSettings

# The client is bound per flow run and never passed as a parameter: Prefect serialises flow
# parameters for the API, and a client object would carry the token there.
_client: ContextVar[GitHubClient | None] = ContextVar("slurmgate_github_client", default=None)


@asynccontextmanager
async def bound_client(client: GitHubClient) -> AsyncIterator[GitHubClient]:
    """Make `client` the one the tasks of this flow run use."""
    token = _client.set(client)
    try:
        yield client
    finally:
        _client.reset(token)


def current_client() -> GitHubClient:
    client = _client.get()
    if client is None:
        raise RuntimeError(
            "no GitHub client is bound: run slurmgate tasks inside the reconcile or "
            "release-lease flow, or wrap the call in `async with bound_client(client)`"
        )
    return client


def retry_transient(task: Task[Any, Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry server faults, rate limits and timeouts; never a 4xx or a lost verification."""
    exc = state.data
    if isinstance(exc, BaseException):
        return is_transient(exc)
    return False


RETRIES = 3
RETRY_DELAYS = [0.5, 1.0, 2.0]

_task_options: dict[str, Any] = {
    "retries": RETRIES,
    "retry_delay_seconds": RETRY_DELAYS,
    "retry_condition_fn": retry_transient,
    "cache_policy": NO_CACHE,
    "persist_result": False,
}


@task(name="read-snapshot", **_task_options)
async def read_snapshot(settings: AdmissionSettings | None = None) -> Snapshot:
    """Runners, active jobs and every lease's job, read conditionally; with `settings`, the
    queued skip-queue jobs verified (`github/skipqueue.py`). When the webhook relay keeps a
    job-event store, the jobs come from it (`EventReads`; a full read every K reads)."""
    events = EventReads.configured()
    return await take_snapshot(current_client(), settings=settings, events=events)


@task(
    name="lease",
    task_run_name="lease-j{admission.admit.job_id}-a{admission.admit.attempt}",
    **_task_options,
)
async def lease_task(
    admission: Admission, fleet_size: int | None = None, share: BatchShare | None = None
) -> State[AdmitOutcome]:
    """Label the runners, verify, anchor: one task run per admission, retried as a whole.

    A retry resumes where the last run failed (`Admission`): confirmed writes are not sent
    again and nothing is rolled back. The compensation is our own stack, not a Prefect
    transaction, because a step that fails once and passes on retry must not roll anything back
    (prefect 3.9 transactions would). A failure that is final (not transient, or the last run)
    undoes exactly this admission's labels, logged here as a rollback.

    The outcome's line ("admitted job=... lease=... pool=... nodes=... anchor=...") is the
    final state's message, so Prefect's own "Finished in state" record carries it: one log
    record per lease instead of two (each costs a console render and an API row).
    """
    logger = get_run_logger()
    admit = admission.admit

    def log_rollback(exc: BaseException, report: UnwindReport) -> None:
        logger.warning(
            "rollback job=%s lease=%s pool=%s undone=%d left=%d cause=%s: %s",
            admit.job_id,
            admit.lease_label,
            admit.pool,
            len(report.undone),
            len(report.failed),
            type(exc).__name__,
            exc,
        )

    share = share or BatchShare()
    steps = LeaseSteps(current_client(), fleet_size, share.deadline(), share.verifier)
    outcome = await steps.run(admission, on_rollback=log_rollback)
    line = (
        admit.line("admitted")
        if outcome.admitted
        else f"{admit.line('not admitted')} why={outcome.reason}"
    )
    return Completed(message=line, data=outcome)


async def run_lease(admit: Admit, fleet_size: int, share: BatchShare | None = None) -> AdmitOutcome:
    """The tick's admit step: one `lease` task run, retried on transient faults; when Prefect
    gives up on it some other way (the run cancelled between retries), what it wrote is
    unwound here. `share` is what its batch shares: the verification read, the deadline."""
    admission = Admission(admit, retries=RETRIES)
    try:
        state = await lease_task(admission, fleet_size, share)
        return await state.aresult()
    finally:
        if not admission.settled:
            await admission.abandon()


@task(name="remove-labels", **_task_options)
async def remove_labels_task(pairs: Sequence[tuple[int, Sequence[str]]]) -> RemovalOutcome:
    """DELETE each managed label (404 = already gone); a retry repeats only harmless deletes."""
    return await remove_labels(current_client(), pairs)


@task(name="read-dispatch", task_run_name="read-dispatch-j{job_id}", **_task_options)
async def read_dispatch_task(job_id: int, anchor_id: int | None) -> DispatchCheck:
    """A fresh read of a lease's job and anchor, right before a release that races dispatch."""
    return await read_dispatch(current_client(), job_id, anchor_id)


GITHUB_TOKEN_ENV = "GITHUB_TOKEN"
WRITE_INTERVAL_ENV = "SLURMGATE_MIN_WRITE_INTERVAL_S"
RETRIES_ENV = "SLURMGATE_REQUEST_RETRIES"


async def resolve_scope(
    scope_block: str | None,
    api_url: str | None = None,
    repo: str | None = None,
    org: str | None = None,
    repos: list[str] | None = None,
    all_repos: bool = False,
) -> GitHubScopeBlock:
    """The scope block named `scope_block`, or an inline scope with the token from GITHUB_TOKEN
    (or the GitHub App the $SLURMGATE_GITHUB_APP_* variables name)."""
    if api_url or repo or org:
        try:
            credentials = credentials_from_env()
        except AppCredentialsError as exc:
            raise ScopeError(str(exc)) from None
        if credentials is None:
            raise ScopeError(
                f"an inline scope (api_url/repo/org) reads its token from ${GITHUB_TOKEN_ENV}, "
                "which is empty; export GITHUB_TOKEN (or SLURMGATE_GITHUB_APP_ID and "
                "SLURMGATE_GITHUB_APP_PRIVATE_KEY_FILE) or use a saved scope block"
            )
        auth: dict[str, Any] = (
            {
                "app_id": credentials.app_id,
                "app_private_key": credentials.private_key,
                "app_installation_id": credentials.installation_id,
            }
            if isinstance(credentials, GitHubAppCredentials)
            else {"token": credentials}
        )
        pacing: dict[str, Any] = {}
        for env, field in (
            (WRITE_INTERVAL_ENV, "min_write_interval_s"),
            (RETRIES_ENV, "request_retries"),
        ):
            raw = GitHubSettings.environ().get(env, "").strip()
            if raw:
                pacing[field] = raw
        try:
            return GitHubScopeBlock(
                api_url=api_url or "https://api.github.com",
                repo=repo,
                org=org,
                repos=tuple(repos or ()),
                all_repos=all_repos,
                **auth,
                **pacing,
            )
        except ValueError as exc:
            raise ScopeError(
                f"inline scope is invalid (api_url/repo/org/repos, ${WRITE_INTERVAL_ENV}, "
                f"${RETRIES_ENV}): {exc}"
            ) from None
    if not scope_block:
        raise ScopeError(
            "no scope: pass scope_block (the name of a saved slurmgate-github-scope block) "
            "or api_url with repo or org"
        )
    try:
        block = await GitHubScopeBlock.aload(scope_block)
    except ValueError as exc:
        raise ScopeError(
            f"scope_block {scope_block!r} could not be loaded ({exc}); save it with "
            f"`slurmgate init --repo OWNER/NAME --name {scope_block}` (PREFECT_API_URL set), or "
            f"`prefect block register -m blocks` and blocks.GitHubScopeBlock(repo=..., "
            f"token=...).save({scope_block!r})"
        ) from None
    return block

"""The reconcile flow: the core's tick, with Prefect's retries, a task per lease, logs, board."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import Artifact, acreate_table_artifact

from slurmgate.admission.batch_verify import BatchShare
from slurmgate.admission.estimates import HistoryError, RuntimeHistory
from slurmgate.admission.leases import AdmitOutcome
from slurmgate.admission.metrics import METRICS
from slurmgate.admission.model import Admit
from slurmgate.admission.tick import TickLog, TickReport, TickSteps, reconcile_tick
from slurmgate.blocks import AdmissionPolicyBlock, RuntimeHistoryBlock
from slurmgate.controller.steps import slurm_capacity_step
from slurmgate.github.access import ScopeAccessError, app_id_of, explain
from slurmgate.github.client import GitHubClient
from slurmgate.github.errors import GitHubError
from slurmgate.github.scope import ScopeError
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.tasks.allocation import reap_crashed_allocations
from slurmgate.tasks.github import (
    bound_client,
    read_dispatch_task,
    read_snapshot,
    remove_labels_task,
    resolve_scope,
    run_lease,
)

BOARD_KEY = "slurmgate-pool-board"
HISTORY_BLOCK = "default"


async def load_history(logger: TickLog) -> RuntimeHistory:
    """The learned runtimes (empty before the first save, or when the stored copy is bad)."""
    try:
        block: RuntimeHistoryBlock = await RuntimeHistoryBlock.aload(HISTORY_BLOCK)
    except ValueError:
        return RuntimeHistory()
    try:
        return block.runtime_history()
    except HistoryError as exc:
        logger.warning("runtime history ignored (%s); estimates fall back to timeouts", exc)
        return RuntimeHistory()


async def save_history(history: RuntimeHistory, logger: TickLog) -> None:
    """Store what this tick learned, as a union with the stored copy (writers agree)."""
    merged = (await load_history(logger)).merge(history)
    await RuntimeHistoryBlock(history=merged.to_json()).asave(HISTORY_BLOCK, overwrite=True)


async def load_settings(policy_block: str | None) -> AdmissionSettings:
    """The named policy block's settings, or the environment's (AdmissionSettings)."""
    if not policy_block:
        return AdmissionSettings()
    try:
        policy: AdmissionPolicyBlock = await AdmissionPolicyBlock.aload(policy_block)
        return policy.to_settings()
    except ValueError as exc:
        raise ScopeError(
            f"policy_block {policy_block!r} could not be loaded ({exc}); save it with "
            f"`slurmgate init --repo OWNER/NAME --name {policy_block}` (PREFECT_API_URL set), or "
            f"`prefect block register -m blocks` and blocks.AdmissionPolicyBlock(...).save("
            f"{policy_block!r}), or pass policy_block=None to read PRIORITY_SCHEDULER_ENABLED "
            "etc. from the environment"
        ) from None


async def write_board_if_changed(table: list[dict[str, Any]]) -> bool:
    """Write the board artifact only when it differs from the latest version (keyed artifacts
    keep one version per write; a 30 s tick would make ~2,900 a day)."""
    latest = await Artifact.aget(BOARD_KEY)
    if latest is not None:
        data = latest.data
        try:
            previous = json.loads(data) if isinstance(data, str) else data
        except ValueError:
            previous = None
        if previous == table:
            return False
    await acreate_table_artifact(
        table=table, key=BOARD_KEY, description="slurmgate pools: capacity, leases, blocked jobs"
    )
    return True


class BatchedTickLog:
    """The tick's log for Prefect: its info lines (one per decision, hundreds in a busy tick)
    go out as a few multi-line records, since each Prefect record costs a console render and
    an API row; warnings go at once, after what is held, so the order stays."""

    MAX_CHARS = 64_000  # far under Prefect's per-record limit (1 MB by default)

    def __init__(self, logger: TickLog) -> None:
        self.logger = logger
        self.held: list[str] = []

    def info(self, msg: str, *args: Any) -> None:
        self.held.append(msg % args if args else msg)

    def warning(self, msg: str, *args: Any) -> None:
        self.flush()
        self.logger.warning(msg, *args)

    def flush(self) -> None:
        chunk: list[str] = []
        size = 0
        for line in self.held:
            if chunk and size + len(line) > self.MAX_CHARS:
                self._send(chunk)
                chunk, size = [], 0
            chunk.append(line)
            size += len(line) + 1
        if chunk:
            self._send(chunk)
        self.held = []

    def _send(self, lines: list[str]) -> None:
        self.logger.info("%d tick lines:\n%s", len(lines), "\n".join(lines))


def record_metrics(
    report: TickReport | None, client: GitHubClient, duration_s: float, logger: TickLog
) -> None:
    """The tick into the process's admission metrics (`admission/metrics.py`)."""
    limit = client.rate_limit
    METRICS.record_report(
        report,
        duration_s,
        api_calls=client.calls.total,
        rate_limit=(limit.remaining, limit.limit) if limit is not None else None,
        log=logger,
    )


@flow(name="reconcile", log_prints=False)
async def reconcile(
    scope_block: str | None = "default",
    policy_block: str | None = None,
    api_url: str | None = None,
    repo: str | None = None,
    org: str | None = None,
    repos: list[str] | None = None,
    all_repos: bool = False,
    reap_allocations: bool = True,
    runs_dir: str | None = None,
) -> dict[str, Any]:
    """One reconcile tick: reap crashed allocations, read, plan, release, clean, admit in order.

    Parameters name saved blocks (`slurmgate-github-scope`, `slurmgate-admission-policy`); the
    CLI passes an inline scope instead (api_url with repo or org, and with org the `repos` whose
    jobs are read or `all_repos`; token from $GITHUB_TOKEN or the $SLURMGATE_GITHUB_APP_*).
    Without a policy block the settings come from the environment (AdmissionSettings).
    `reap_allocations` cancels the Slurm jobs and steps of allocation runs on this host whose
    controller died (records under `runs_dir`, default $SLURMGATE_RUNS_DIR or
    ~/.cache/slurmgate/runs); it never fails the tick.
    """
    logger = get_run_logger()
    # First, and apart from GitHub: a crashed run's allocation holds nodes whatever GitHub says.
    reap = (
        await asyncio.to_thread(
            reap_crashed_allocations, logger, Path(runs_dir) if runs_dir else None
        )
        if reap_allocations
        else None
    )
    scope = await resolve_scope(scope_block, api_url, repo, org, repos, all_repos)
    settings = await load_settings(policy_block)
    if scope.org and not scope.repos and not scope.all_repos:
        logger.warning(
            "org scope %s lists no repos: no workflow jobs can be read, so nothing is admitted; "
            "set repos (or all_repos) on the scope block",
            scope.org,
        )
    tick_log = BatchedTickLog(logger)

    async def admit(planned: Admit, fleet_size: int, share: BatchShare) -> AdmitOutcome:
        tick_log.flush()  # the decisions appear before the lease task runs they start
        return await run_lease(planned, fleet_size, share)

    steps = TickSteps(
        lambda: read_snapshot(settings),
        remove=remove_labels_task,
        admit=admit,
        read_dispatch=read_dispatch_task,
        # Slurm's nodes for the pools mapped to partitions; a failed read counts runners only
        # (one warning), so it is not a retried task
        read_capacity=slurm_capacity_step(settings),
        write_interval_s=scope.min_write_interval_s,  # sizes the verification batches
    )
    async with scope.get_client() as client, bound_client(client):
        history = await load_history(logger)
        started = time.monotonic()
        try:
            report = await reconcile_tick(steps, settings, history=history, log=tick_log)
        except GitHubError as exc:  # a read that failed for good: say why, as the CLI does
            record_metrics(None, client, time.monotonic() - started, logger)
            line = explain(scope.scope(), exc, app_id_of(scope.credentials()))
            raise ScopeAccessError(line) from None
        except Exception:
            record_metrics(None, client, time.monotonic() - started, logger)
            raise
        finally:
            tick_log.flush()
        record_metrics(report, client, time.monotonic() - started, logger)
        if report.runtimes_learned:
            await save_history(history, logger)
        summary: dict[str, Any] = {
            **report.counts(),
            "reaped": reap.reaped if reap else 0,
            "reap_deferred": reap.deferred if reap else 0,
            "board_written": await write_board_if_changed(report.decisions.board_rows()),
            "api_calls": client.calls.total,
            "api_not_modified": client.calls.total_not_modified,
            "api_writes": client.calls.writes,
        }
    logger.info("tick %s", json.dumps(summary, sort_keys=True))
    for line in report.failures:
        logger.error("failed %s", line)
    report.raise_for_failures()
    return summary

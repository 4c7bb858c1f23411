"""The reconcile flow: snapshot, plan, release, clean, then one lease subflow per admission."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import Artifact, acreate_table_artifact
from pydantic import ValidationError

from slurmgate.estimates import HistoryError, RuntimeHistory
from slurmgate.leases import AdmitOutcome, UnwindReport, run_admission
from slurmgate.model import Admit, Decisions, Snapshot
from slurmgate.planner import plan
from slurmgate.settings import AdmissionSettings
from tasks.allocation import reap_crashed_allocations
from tasks.github import (
    ScopeError,
    add_anchor_labels_task,
    add_lease_labels_task,
    bound_client,
    read_snapshot,
    remove_labels_task,
    resolve_scope,
    verify_lease_task,
)

BOARD_KEY = "slurmgate-pool-board"
HISTORY_BLOCK = "default"


async def load_history(logger: Any) -> RuntimeHistory:
    """The learned runtimes (empty before the first save, or when the stored copy is bad)."""
    from blocks import RuntimeHistoryBlock

    try:
        block: RuntimeHistoryBlock = await RuntimeHistoryBlock.aload(HISTORY_BLOCK)
    except ValueError:
        return RuntimeHistory()
    try:
        return block.runtime_history()
    except HistoryError as exc:
        logger.warning("runtime history ignored (%s); estimates fall back to timeouts", exc)
        return RuntimeHistory()


async def learn_history(
    history: RuntimeHistory, snapshot: Snapshot, settings: AdmissionSettings, logger: Any
) -> None:
    """Record the runtimes of finished lease jobs; save only when something was learned."""
    from blocks import RuntimeHistoryBlock

    if not history.learn(snapshot.jobs, settings.node_slots):
        return
    merged = (await load_history(logger)).merge(history)  # a union: concurrent writers agree
    await RuntimeHistoryBlock(history=merged.to_json()).asave(HISTORY_BLOCK, overwrite=True)


class ReconcileError(RuntimeError):
    """Some decisions of the tick failed after their retries; the rest were carried out."""


@flow(name="lease", flow_run_name="lease-j{admit.job_id}-a{admit.attempt}", log_prints=False)
async def lease(admit: Admit, fleet_size: int | None = None) -> AdmitOutcome:
    """Label the runners, verify, anchor; on any failure undo exactly this attempt's labels.

    Compensation is our own stack, not a Prefect transaction: a step that fails once and then
    passes on retry must not roll anything back (prefect 3.9 transactions would).
    """
    logger = get_run_logger()

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

    outcome = await run_admission(
        admit,
        add_lease_labels_task,
        lambda a: verify_lease_task(a, fleet_size),
        add_anchor_labels_task,
        on_rollback=log_rollback,
    )
    if outcome.admitted:
        logger.info(
            "admitted job=%s lease=%s pool=%s nodes=%d anchor=%s",
            admit.job_id,
            admit.lease_label,
            admit.pool,
            admit.nodes,
            admit.anchor_id,
        )
    return outcome


def log_decisions(decisions: Decisions, logger: Any, *, admissions: bool) -> None:
    """One line per decision: job id, lease id, pool and the reason (blocked jobs too).

    `admissions=False` logs releases and cleans; `admissions=True` the admits, blocked jobs,
    misconfigured runners and notes of the plan the admissions come from.
    """
    if not admissions:
        _log_removals(decisions, logger)
        return
    _log_admissions(decisions, logger)


def _log_removals(decisions: Decisions, logger: Any) -> None:
    for r in decisions.release:
        logger.info(
            "release job=%s lease=%s pool=%s reason=%s %s",
            r.job_id,
            r.lease_label,
            r.pool,
            r.reason.value,
            r.detail,
        )
    for c in decisions.clean:
        logger.info(
            "clean runner=%s labels=%s reason=%s", c.runner_id, ",".join(c.labels), c.reason
        )


def _log_admissions(decisions: Decisions, logger: Any) -> None:
    for a in decisions.admit:
        logger.info(
            "admit job=%s lease=%s pool=%s nodes=%d anchor=%s reason=%s",
            a.job_id,
            a.lease_label,
            a.pool,
            a.nodes,
            a.anchor_id,
            a.reason,
        )
    for b in decisions.blocked:
        logger.info(
            "blocked job=%s lease=- pool=%s nodes=%s reason=%s %s",
            b.job_id,
            b.pool,
            b.nodes,
            b.reason.value,
            b.detail,
        )
    for runner_id, why in decisions.misconfigured_runners:
        logger.warning("misconfigured runner=%s %s", runner_id, why)
    for note in decisions.notes:
        logger.info("note %s", note)


def board_table(decisions: Decisions) -> list[dict[str, Any]]:
    """The pool board: capacity, leased, free and the blocked jobs with their reasons."""
    return decisions.board_rows()


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


@flow(name="reconcile", log_prints=False)
async def reconcile(
    scope_block: str | None = "default",
    policy_block: str | None = None,
    api_url: str | None = None,
    repo: str | None = None,
    org: str | None = None,
    reap_allocations: bool = True,
    runs_dir: str | None = None,
) -> dict[str, Any]:
    """One reconcile tick: reap crashed allocations, read, plan, release, clean, admit in order.

    Parameters name saved blocks (`slurmgate-github-scope`, `slurmgate-admission-policy`); the
    CLI passes an inline scope instead (api_url with repo or org; token from $GITHUB_TOKEN).
    Without a policy block the settings come from the environment (AdmissionSettings).
    `reap_allocations` cancels the Slurm jobs and steps of allocation runs on this host whose
    controller died (records under `runs_dir`, default $SLURMGATE_RUNS_DIR or
    ~/.cache/slurmgate/runs); it never fails the tick.
    """
    from blocks import AdmissionPolicyBlock

    logger = get_run_logger()
    # First, and apart from GitHub: a crashed run's allocation holds nodes whatever GitHub says.
    reap = (
        await asyncio.to_thread(
            reap_crashed_allocations, logger, Path(runs_dir) if runs_dir else None
        )
        if reap_allocations
        else None
    )
    scope = await resolve_scope(scope_block, api_url, repo, org)
    if policy_block:
        try:
            policy: AdmissionPolicyBlock = await AdmissionPolicyBlock.aload(policy_block)
            settings = policy.to_settings()
        except ValueError as exc:
            raise ScopeError(
                f"policy_block {policy_block!r} could not be loaded ({exc}); save one with "
                f"AdmissionPolicyBlock(...).save({policy_block!r}), or pass policy_block=None "
                "to read PRIORITY_SCHEDULER_ENABLED etc. from the environment"
            ) from None
    else:
        settings = AdmissionSettings()
    summary: dict[str, Any] = {
        "admitted": 0,
        "rolled_back": 0,
        "released": 0,
        "cleaned": 0,
        "blocked": 0,
        "errors": 0,
        "reaped": reap.reaped if reap else 0,
        "reap_deferred": reap.deferred if reap else 0,
    }
    failures: list[str] = []
    if scope.org and not scope.repos:
        logger.warning(
            "org scope %s lists no repos: no workflow jobs can be read, so nothing is admitted; "
            "set repos on the scope block",
            scope.org,
        )
    async with scope.get_client() as client, bound_client(client):
        snapshot = await read_snapshot()
        history = await load_history(logger)
        await learn_history(history, snapshot, settings, logger)
        started = time.perf_counter()
        decisions = plan(snapshot, settings, datetime.now(UTC), history=history)
        summary["plan_s"] = round(time.perf_counter() - started, 6)
        log_decisions(decisions, logger, admissions=False)

        for release in decisions.release:
            try:
                await remove_labels_task(release.labels)
                summary["released"] += 1
            except Exception as exc:
                failures.append(f"release {release.lease_label}: {type(exc).__name__}: {exc}")
        for clean in decisions.clean:
            try:
                await remove_labels_task(((clean.runner_id, clean.labels),))
                summary["cleaned"] += 1
            except Exception as exc:
                failures.append(f"clean runner {clean.runner_id}: {type(exc).__name__}: {exc}")
        if summary["released"] or summary["cleaned"]:
            # Freed runners still carried their labels in the first read; admit from a fresh
            # read so released capacity is reused in this tick, never guessed at.
            snapshot = await read_snapshot()
            started = time.perf_counter()
            decisions = plan(snapshot, settings, datetime.now(UTC), history=history)
            summary["plan_s"] += round(time.perf_counter() - started, 6)
            for deferred in (*decisions.release, *decisions.clean):
                logger.info("deferred to the next tick: %s", deferred)
        log_decisions(decisions, logger, admissions=True)
        summary["blocked"] = len(decisions.blocked)

        # one admission at a time: GitHub has no compare-and-swap, so we are the single writer
        for admit in decisions.admit:
            try:
                outcome = await lease(admit, fleet_size=len(snapshot.runners))
            except Exception as exc:
                failures.append(f"lease {admit.lease_label}: {type(exc).__name__}: {exc}")
                continue
            summary["admitted" if outcome.admitted else "rolled_back"] += 1

        summary["board_written"] = await write_board_if_changed(board_table(decisions))
        summary["api_calls"] = client.calls.total
        summary["api_not_modified"] = client.calls.total_not_modified
        summary["api_writes"] = client.calls.writes
    summary["errors"] = len(failures)
    logger.info("tick %s", json.dumps(summary, sort_keys=True))
    if failures:
        for line in failures:
            logger.error("failed %s", line)
        raise ReconcileError(
            f"{len(failures)} decision(s) failed after retries (the next tick repairs them): "
            + "; ".join(failures)
        )
    return summary


def reconcile_once_cli(api_url: str, repo: str | None = None, org: str | None = None) -> int:
    """`slurmgate reconcile --once`: one tick through the Prefect flow; 0 on success.

    The token comes from $GITHUB_TOKEN and the policy flags from the environment.
    """
    if (repo is None) == (org is None):
        print(
            "slurmgate reconcile: pass exactly one of --repo OWNER/NAME or --org NAME",
            file=sys.stderr,
        )
        return 2
    if not os.environ.get("GITHUB_TOKEN", "").strip():
        print(
            "slurmgate reconcile: GITHUB_TOKEN is empty; export a token with admin rights on "
            "the runners (any non-empty value for the emulator)",
            file=sys.stderr,
        )
        return 2
    try:
        AdmissionSettings()
    except ValidationError as exc:
        print(
            f"slurmgate reconcile: bad admission settings in the environment: {exc}",
            file=sys.stderr,
        )
        return 2
    try:
        summary = asyncio.run(reconcile(scope_block=None, api_url=api_url, repo=repo, org=org))
    except ScopeError as exc:
        print(f"slurmgate reconcile: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"slurmgate reconcile: tick failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, sort_keys=True))
    return 0

"""Prefect helpers for the allocation flow: run-scoped logging and the artifacts it publishes."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.exceptions import MissingContextError

from slurmgate.runtime import layout as layout_mod
from slurmgate.runtime import slurm
from slurmgate.runtime.controller import (
    AllocationRun,
    default_runs_root,
    defer_reap,
    load_records,
    mark_reaped,
    reap_due,
    reap_run,
    stale_records,
)

# Subflows get a run id; the live run (with its processes) stays in this process. The registry
# lives here and flows reach it as `module.attribute`: a served flow is cloudpickled by value,
# which would copy a dict imported into the flow module's globals once per function.
LIVE_RUNS: dict[str, AllocationRun] = {}
# flow-run id → run id, so the cancellation/crash hooks find the run to clean.
RUNS_BY_FLOW_RUN: dict[str, str] = {}


def log(message: str) -> None:
    """One line per decision into the current Prefect run's log (stderr outside a run)."""
    try:
        get_run_logger().info(message)
    except MissingContextError:
        import sys

        print(f"[slurmgate] {message}", file=sys.stderr, flush=True)


def publish_layout(run: AllocationRun) -> None:
    """The resolved layout as a table: one row per lane."""
    assert run.layout is not None
    create_table_artifact(
        table=layout_mod.describe(run.layout),
        key="allocation-layout",
        description=f"Lanes of run {run.run_id} in allocation {run.job_id}",
    )


class Progress:
    """A progress artifact for lanes coming up, updated in place."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.artifact_id: Any = None

    def __call__(self, what: str, ready: int, total: int) -> None:
        value = 100.0 * ready / total if total else 100.0
        with contextlib.suppress(Exception):  # a progress bar never fails a run
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(
                    progress=value,
                    key="allocation-readiness",
                    description=f"Lane heads ready in run {self.run_id}",
                )
            else:
                update_progress_artifact(artifact_id=self.artifact_id, progress=value)


def publish_record(run: AllocationRun) -> None:
    """Job and step ids of the run, so a later pass can reap what a killed controller left."""
    rec = run.record()
    lines = [
        f"# Run {rec['run_id']}",
        "",
        f"- job: `{rec['job_id']}` (owned: {rec['owned_allocation']})",
        f"- status: {rec['status']}; phase: {rec['phase']}",
        f"- record file: `{run.record_path}`",
        "",
        "| step | Slurm step | pgid | exit |",
        "|---|---|---|---|",
    ]
    for s in rec["steps"]:
        lines.append(f"| {s['name']} | {s['step_id'] or '-'} | {s['pgid']} | {s['returncode']} |")
    with contextlib.suppress(Exception):
        create_markdown_artifact(
            markdown="\n".join(lines),
            key="allocation-record",
            description="Slurm job and step ids of the run (for reap_leftovers)",
        )


def endpoint_rows(metrics: dict[str, str]) -> list[dict[str, str]]:
    """The endpoints' Prometheus counters and gauges as table rows."""
    from prometheus_client.parser import text_string_to_metric_families

    rows: list[dict[str, str]] = []
    for deployment, text in sorted(metrics.items()):
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for family in families:
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                rows.append(
                    {
                        "deployment": deployment,
                        "metric": sample.name,
                        "labels": labels,
                        "value": f"{sample.value:g}",
                    }
                )
    return rows


def publish_endpoint_stats(run: AllocationRun) -> None:
    rows = endpoint_rows(run.endpoint_metrics)
    if rows:
        create_table_artifact(
            table=rows,
            key="allocation-endpoint-stats",
            description=f"Logical endpoint metrics of run {run.run_id}, read before they stopped",
        )


@dataclass(frozen=True)
class ReapTally:
    """One reap pass: runs reaped, and stale runs left for a later pass (Slurm did not answer
    now or at the last try, whose backoff has not run out)."""

    reaped: int = 0
    deferred: int = 0


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def reap_crashed_allocations(
    logger: Any, runs_root: Path | None = None, *, slurm_timeout_s: float = 10.0
) -> ReapTally:
    """Reap the Slurm leftovers of allocation runs whose controller died, on this host.

    Reads the run records under `runs_root` ($SLURMGATE_RUNS_DIR or ~/.cache/slurmgate/runs):
    a run that is unfinished and whose controller process is gone (SIGKILL, crash, lost worker)
    gets its owned job or its steps cancelled and its srun groups killed, one log line per action,
    and its record marked `reaped`. Live and finished runs are never touched, and a pass with
    nothing stale runs no Slurm command. It never raises: when Slurm cannot answer, one warning
    line gives the reason and the stale runs wait (30 s, doubling to 5 min) for a later pass.
    """
    root = runs_root or default_runs_root()
    try:
        stale = stale_records(load_records(root))
    except Exception as exc:  # an unreadable runs directory must not fail the caller
        logger.warning("reap skipped: cannot read run records in %s: %s", root, _one_line(exc))
        return ReapTally()
    now = time.time()
    due = [rec for rec in stale if reap_due(rec, now)]
    reaped = 0
    for index, rec in enumerate(due):
        run_id, job_id = rec.get("run_id"), rec.get("job_id") or "-"
        try:
            actions = reap_run(rec, timeout=slurm_timeout_s)
        except slurm.SlurmError as exc:
            # Slurm is down or absent: one line for the pass, and every due run waits
            left = due[index:]
            reason = _one_line(exc)
            waits = [_defer_quietly(r, reason) for r in left]
            logger.warning(
                "reap deferred run=%s job=%s: %d stale run(s) wait %.0f s for Slurm: %s",
                run_id,
                job_id,
                len(left),
                min(waits),
                reason,
            )
            break
        except Exception as exc:
            reason = _one_line(exc)
            wait = _defer_quietly(rec, reason)
            logger.warning(
                "reap failed run=%s job=%s (retry in %.0f s): %s", run_id, job_id, wait, reason
            )
            continue
        for action in actions or ["nothing left (allocation over, no live srun group)"]:
            logger.info("reap run=%s job=%s %s", run_id, job_id, action)
        try:
            mark_reaped(rec, actions)
        except Exception as exc:
            logger.warning(
                "reap run=%s job=%s done, but its record could not be marked: %s",
                run_id,
                job_id,
                _one_line(exc),
            )
        reaped += 1
    return ReapTally(reaped=reaped, deferred=len(stale) - reaped)


def _defer_quietly(rec: dict[str, Any], reason: str) -> float:
    try:
        return defer_reap(rec, reason)
    except Exception:  # an unwritable record is retried on the next pass instead
        return 0.0

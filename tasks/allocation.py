"""Prefect helpers for the allocation flow: run-scoped logging and the artifacts it publishes."""

from __future__ import annotations

import contextlib
import json
import logging
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

from slurmgate.errors import SlurmgateError
from slurmgate.paths import default_runs_root
from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.ledger.reaper import ReapTally, reap_all_users_from_env, reap_stale_runs
from slurmgate.runtime.ledger.records import RunRecord, load_records
from slurmgate.runtime.run.allocation_run import AllocationRun

# Subflows get a run id; the live run (with its processes) stays in this process. The registry
# lives here and flows reach it as `module.attribute`: a served flow is cloudpickled by value,
# which would copy a dict imported into the flow module's globals once per function.
LIVE_RUNS: dict[str, AllocationRun] = {}
# flow-run id → run id, so the cancellation/crash hooks find the run to clean.
RUNS_BY_FLOW_RUN: dict[str, str] = {}


class KnownFailureTraceback(logging.Filter):
    """Drop the traceback Prefect logs with a failed allocation flow run when the failure is
    one of slurmgate's own errors: their message already names the cause and the fix, and a
    traceback after it reads as a crash. Anything else (a bug) keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        failure = record.exc_info[1] if record.exc_info else None
        flow = str(getattr(record, "flow_name", ""))
        if isinstance(failure, SlurmgateError) and flow.startswith("allocation"):
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_known_failures() -> None:
    """Install KnownFailureTraceback on Prefect's flow-run logger, once."""
    logger = logging.getLogger("prefect.flow_runs")
    if not any(isinstance(f, KnownFailureTraceback) for f in logger.filters):
        logger.addFilter(KnownFailureTraceback())


def log(message: str) -> None:
    """One line per decision into the current Prefect run's log (stderr outside a run)."""
    try:
        get_run_logger().info(message)
    except MissingContextError:
        import sys

        print(f"[slurmgate] {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    """A warning into the current Prefect run's log (stderr outside a run)."""
    try:
        get_run_logger().warning(message)
    except MissingContextError:
        import sys

        print(f"[slurmgate] warning: {message}", file=sys.stderr, flush=True)


def read_secret_block(name: str) -> str:
    """The value of the Prefect Secret block `name`: how a spec's `{secret: NAME}` resolves.

    Called on the controller (the client host) when the run starts; the value is never a
    flow-run parameter, a log line or a record field.
    """
    from prefect.blocks.system import Secret

    block = Secret.load(name, _sync=True)  # type: ignore[call-arg]
    if not isinstance(block, Secret):  # the sync call returns the block itself
        raise TypeError(f"Secret.load({name!r}) returned {type(block).__name__}")
    value = block.get()
    return value if isinstance(value, str) else json.dumps(value)


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
        f"# Run {rec.run_id}",
        "",
        f"- job: `{rec.job_id}` (owned: {rec.owned_allocation})",
        f"- status: {rec.status}; phase: {rec.phase}",
        f"- record file: `{run.record_path}`",
        "",
        "| step | Slurm step | pgid | exit |",
        "|---|---|---|---|",
    ]
    if rec.error:
        lines[4:4] = [f"- error: {rec.error}"]  # redacted by the run
    for s in rec.steps:
        lines.append(f"| {s.name} | {s.step_id or '-'} | {s.pgid} | {s.returncode} |")
    if rec.hooks:
        lines += ["", "| site hook | outcome |", "|---|---|"]
        lines += [f"| {name} | {outcome.describe()} |" for name, outcome in rec.hooks.items()]
    lines += outputs_lines(rec)
    try:
        create_markdown_artifact(
            markdown=run.redact("\n".join(lines)),
            key="allocation-record",
            description="Slurm job and step ids of the run (for the reaper)",
        )
    except Exception as exc:  # the record file stays the reaper's source; say it is missing here
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        warn(f"run {rec.run_id}: the allocation-record artifact was not published: {reason}")


def outputs_lines(rec: RunRecord) -> list[str]:
    """The record's collected outputs as markdown: a link to the folder (and the upload), then
    one row per node."""
    if not rec.outputs:
        return []
    lines = ["", f"## Logs and results: [{rec.outputs_dir}](file://{rec.outputs_dir})"]
    if rec.outputs_upload and rec.outputs_upload.startswith("s3://"):
        lines.append(f"- uploaded to [{rec.outputs_upload}]({rec.outputs_upload})")
    elif rec.outputs_upload:
        lines.append(f"- upload {rec.outputs_upload} (the local copy stays)")
    lines += [
        "",
        "| node | status | files | cut to head and tail | folder |",
        "|---|---|---|---|---|",
    ]
    for o in rec.outputs:
        where = f"[{o.node}](file://{o.dir})" if o.dir else (o.error or "-")
        lines.append(f"| {o.node} | {o.status} | {o.files} | {len(o.cut)} | {where} |")
    return lines


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


def reap_crashed_allocations(
    logger: Any, runs_root: Path | None = None, *, slurm_timeout_s: float = 10.0
) -> ReapTally:
    """Reap, on this host, the Slurm leftovers of allocation runs whose controller died.

    Reads the run records under `runs_root` (by default the runs home, and the legacy one) and
    hands the stale ones to `reap_stale_runs`, which logs one line per action. It never raises:
    an unreadable runs directory is one warning, and the tick goes on.
    """
    root = runs_root or default_runs_root()
    try:
        records = load_records(runs_root, warn=logger.warning)
    except Exception as exc:  # an unreadable runs directory must not fail the caller
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        logger.warning("reap skipped: cannot read run records in %s: %s", root, reason)
        return ReapTally()
    return reap_stale_runs(
        records,
        timeout=slurm_timeout_s,
        info=logger.info,
        warn=logger.warning,
        all_users=reap_all_users_from_env(),
    )

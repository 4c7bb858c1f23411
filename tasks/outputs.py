"""Prefect tasks for a run's outputs: each node's collection retried, the optional S3 upload."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.context import FlowRunContext
from prefect.runtime import task_run

import slurmgate.tasks.allocation as registry
from slurmgate.errors import InputError
from slurmgate.runtime.ledger.records import NodeOutputs
from slurmgate.runtime.redact import Redactor
from slurmgate.runtime.run import outputs
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.tasks.allocation import log, warn

# Retries after a node's first attempt; each attempt is bounded by the node's time limit
# (SLURMGATE_OUTPUTS_NODE_TIMEOUT_S), so a dead node costs (1 + retries) limits at most.
COLLECT_RETRIES = 1


@task(name="collect-node-outputs", retries=COLLECT_RETRIES, retry_delay_seconds=1)
def collect_node_outputs(run_id: str, host: str) -> NodeOutputs:
    """One node's logs and results into the run's directory (`outputs.collect_node`); a
    failure (the node's step failed or ran out of time) raises, and Prefect retries it."""
    run = registry.LIVE_RUNS[run_id]
    got = outputs.collect_node(run.context, host)
    got.attempts = int(task_run.run_count or 1)
    return got


def node_collector(run: AllocationRun) -> Callable[[list[str]], list[NodeOutputs]]:
    """What cleanup calls for the nodes: one retryable task per node, all at once. Outside a
    flow run (a crash hook's cleanup), the core's own loop does it."""

    def collect(hosts: list[str]) -> list[NodeOutputs]:
        if FlowRunContext.get() is None:
            return outputs.collect_nodes(run.context, hosts, outputs.CollectOptions.from_env())
        futures = {host: collect_node_outputs.submit(run.run_id, host) for host in hosts}
        got = []
        for host, future in futures.items():
            try:
                got.append(future.result())
            except Exception as exc:
                reason = run.redact(" ".join(f"{exc}".split()))
                got.append(outputs.failed(host, reason, COLLECT_RETRIES + 1))
        return got

    return collect


def check_bucket_block(name: str) -> None:
    """Fail at once, in one line, when `outputs_bucket` cannot work: prefect-aws missing, or no
    S3Bucket block of that name. (The store itself is reached only at the end of the run.)"""
    try:
        from prefect_aws.s3 import S3Bucket
    except ImportError:
        raise InputError(
            "outputs_bucket: the S3 upload needs prefect-aws: pip install 'slurmgate[s3]'"
        ) from None
    try:
        S3Bucket.load(name, _sync=True)  # type: ignore[call-arg]
    except ValueError:
        raise InputError(
            f"outputs_bucket: no S3Bucket block named {name!r}; save one (README, Results out "
            "to S3) or leave outputs_bucket empty"
        ) from None


def _bucket_secrets(bucket: Any) -> list[str]:
    """The key values an S3Bucket block's credentials hold: masked wherever a message goes."""
    creds = getattr(bucket, "credentials", None)
    found = []
    for field in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
        value = getattr(creds, field, None)
        if value is None:
            continue
        text = value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
        found.append(text)
    return found


@task(name="upload-run-outputs", retries=1, retry_delay_seconds=2)
def upload_run_outputs(bucket_block: str, folder: str, to_folder: str) -> str:
    """The run's outputs folder into the S3Bucket block's bucket, under `to_folder`; its URL."""
    from prefect_aws.s3 import S3Bucket

    bucket = S3Bucket.load(bucket_block, _sync=True)  # type: ignore[call-arg]
    if not isinstance(bucket, S3Bucket):
        raise TypeError(f"S3Bucket.load({bucket_block!r}) returned {type(bucket).__name__}")
    mask = Redactor(_bucket_secrets(bucket))
    try:
        bucket.upload_from_folder(folder, to_folder=to_folder)
    except Exception as exc:  # the block's keys never reach a log, even in botocore's words
        raise RuntimeError(mask(f"{type(exc).__name__}: {exc}")) from None
    prefix = "/".join(p for p in (bucket.bucket_folder.strip("/"), to_folder) if p)
    return f"s3://{bucket.bucket_name}/{prefix}/"


def upload_outputs(run: AllocationRun, bucket_block: str) -> str | None:
    """Upload what the run collected to the S3Bucket block `bucket_block`; the URL, or None
    when it failed: then the local copy stays, and the run's log and record say so."""
    folder = run.context.outputs_dir
    if not folder.is_dir():
        warn(f"run {run.run_id}: nothing collected to upload (no {folder})")
        return None
    try:
        url = upload_run_outputs(bucket_block, str(folder), run.run_id)
    except Exception as exc:
        reason = run.redact(" ".join(f"{exc}".split()))[:400]
        run.context.outputs_upload = f"failed: {reason}"
        run.save()
        warn(
            f"run {run.run_id}: outputs not uploaded to the S3 bucket of block {bucket_block!r}: "
            f"{reason}; the local copy stays in {folder}"
        )
        return None
    run.context.outputs_upload = url
    run.save()
    log(f"run {run.run_id}: outputs uploaded to {url}")
    return url

"""A run's outputs through Prefect: each node's collection a retried task, and the upload to
S3-compatible storage through prefect-aws's S3Bucket and AwsCredentials blocks, against a real
S3 API (moto's server, started here) that answers, lacks the bucket, or has stopped."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect import flow
from pydantic import SecretStr

import slurmgate.tasks.allocation as registry
from slurmgate.errors import InputError
from slurmgate.runtime.ledger.records import NodeOutputs, RunRecord
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.steps import outputs as node_outputs
from slurmgate.tasks.allocation import outputs_lines
from slurmgate.tasks.outputs import (
    COLLECT_RETRIES,
    check_bucket_block,
    node_collector,
    upload_outputs,
)

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "examples" / "specs" / "local-stub.yaml"
ACCESS_KEY = "AKIASLURMGATETEST01"
SECRET_KEY = "sg-test-secret-key-value-0123456789abcdef"
BUCKET = "slurmgate-runs"

# `srun` for the collection test: its options dropped, the command run here as the named node
# would run it; the node `dead` never answers.
SRUN = """#!/bin/sh
node=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nodelist=*) node="${1#--nodelist=}"; shift ;;
    -*) shift ;;
    *) break ;;
  esac
done
[ "$node" = dead ] && exec sleep 60
SLURMD_NODENAME="$node" exec "$@"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto's S3 API server on 127.0.0.1, as its own process."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        server = shutil.which("moto_server", path=str(Path(sys.executable).parent))
        assert server, "moto_server is missing: install the dev extra (moto[server])"
        self.proc = subprocess.Popen(
            [server, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(self.url + "/moto-api/", timeout=1)
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise AssertionError("moto_server did not start") from None
                time.sleep(0.2)

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def s3(prefect_harness: None) -> Iterator[S3Server]:
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


def _save_bucket_block(name: str, url: str, bucket: str) -> None:
    from prefect_aws import AwsClientParameters, AwsCredentials
    from prefect_aws.s3 import S3Bucket

    credentials = AwsCredentials(
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SecretStr(SECRET_KEY),
        region_name="us-east-1",
        # one try, a short connect: the stopped-server case fails in seconds, not minutes
        aws_client_parameters=AwsClientParameters(
            endpoint_url=url, config={"retries": {"max_attempts": 1}, "connect_timeout": 2}
        ),
    )
    S3Bucket(bucket_name=bucket, credentials=credentials, bucket_folder="ci").save(
        name, overwrite=True
    )


def _run(tmp_path: Path) -> AllocationRun:
    run = AllocationRun(AllocationSpec.from_yaml(SPEC), runs_root=tmp_path / "runs")
    where = run.context.outputs_dir / "node-1" / "logs"
    where.mkdir(parents=True)
    (where / "lane-0.log").write_text("lane up\n")
    run.context.outputs = [NodeOutputs(node="node-1", status="collected", files=1)]
    return run


def test_outputs_upload_to_s3_and_a_failed_upload_keeps_the_local_copy(
    s3: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s3.client().create_bucket(Bucket=BUCKET)
    _save_bucket_block("sg-test-outputs", s3.url, BUCKET)
    _save_bucket_block("sg-test-no-bucket", s3.url, "no-such-bucket")
    run = _run(tmp_path)

    @flow
    def upload(block: str) -> str | None:
        return upload_outputs(run, block)

    check_bucket_block("sg-test-outputs")
    with pytest.raises(InputError, match=r"^outputs_bucket: no S3Bucket block named 'sg-typo'"):
        check_bucket_block("sg-typo")
    caplog.set_level(logging.DEBUG)
    url = upload("sg-test-outputs")
    assert url == f"s3://{BUCKET}/ci/{run.run_id}/"
    listed = s3.client().list_objects_v2(Bucket=BUCKET)["Contents"]
    assert [o["Key"] for o in listed] == [f"ci/{run.run_id}/node-1/logs/lane-0.log"]
    record = RunRecord.read(run.record_path)
    assert record.outputs_upload == url
    assert f"uploaded to [{url}]({url})" in "\n".join(outputs_lines(record))

    assert upload("sg-test-no-bucket") is None  # the bucket is missing
    assert (run.context.outputs_upload or "").startswith("failed: ")
    assert "NoSuchBucket" in (run.context.outputs_upload or "")

    s3.stop()
    assert upload("sg-test-outputs") is None  # the server is gone
    failed = RunRecord.read(run.record_path).outputs_upload or ""
    assert failed.startswith("failed: ") and "127.0.0.1" in failed
    assert (run.context.outputs_dir / "node-1" / "logs" / "lane-0.log").read_text() == "lane up\n"
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "the local copy stays in" in said
    assert SECRET_KEY not in said and SECRET_KEY not in run.record_path.read_text()
    assert SECRET_KEY not in "\n".join(outputs_lines(RunRecord.read(run.record_path)))


def test_each_node_is_a_retried_task_and_a_dead_node_fails_within_its_limit(
    prefect_harness: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text(SRUN)
    (bindir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURMGATE_NODE_OUTPUTS_ROOT", str(tmp_path / "node-root"))
    monkeypatch.setenv("SLURMGATE_OUTPUTS_NODE_TIMEOUT_S", "1")
    run = AllocationRun(AllocationSpec.from_yaml(SPEC), runs_root=tmp_path / "runs")
    run.context.job_id = "77"
    logs, _ = node_outputs.prepare(run.run_id, "node-1")
    Path(logs, "lane-0.log").write_text("HF_TOKEN=hf_" + "x" * 30 + "\n")
    registry.LIVE_RUNS[run.run_id] = run

    @flow
    def collect() -> list[NodeOutputs]:
        return node_collector(run)(["node-1", "dead"])

    try:
        t0 = time.monotonic()
        got = {o.node: o for o in collect()}
        assert time.monotonic() - t0 < 30
    finally:
        registry.LIVE_RUNS.pop(run.run_id, None)
    assert got["node-1"].status == "collected" and got["node-1"].attempts == 1
    log = (run.context.outputs_dir / "node-1" / "logs" / "lane-0.log").read_text()
    assert log == "HF_TOKEN=***\n"
    assert got["dead"].status == "failed" and got["dead"].attempts == COLLECT_RETRIES + 1
    assert "SLURMGATE_OUTPUTS_NODE_TIMEOUT_S" in (got["dead"].error or "")

"""A run's outputs without Slurm: bounded files, redaction, the node collector as a real process,
the node worker's lane logs and results, and collection through an `srun` stand-in on PATH
(a node that answers, a dead node under its time limit, a collector that fails)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from slurmgate.runtime.engines import layout
from slurmgate.runtime.ledger.records import RunRecord
from slurmgate.runtime.redact import MASK, Redactor
from slurmgate.runtime.run import outputs
from slurmgate.runtime.run.state import RunContext
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.steps import outputs as node_outputs
from slurmgate.runtime.steps.node_worker import LaneSpec, NodeSpec, WorkerSpec

from .conftest import example_data

HOST = socket.gethostname().split(".")[0]
HF = "hf_" + "Q" * 30
AWS_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----"
SECRETS = (
    f"HF_TOKEN={HF}\nAWS_SECRET_ACCESS_KEY={AWS_KEY}\n{PEM}\n"
    "Authorization: Bearer the-endpoint-token-value\n"
)


@pytest.fixture(autouse=True)
def _node_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "node-root"
    monkeypatch.setenv("SLURMGATE_NODE_OUTPUTS_ROOT", str(root))
    return root


def test_a_file_within_the_bound_is_whole_and_a_larger_one_keeps_head_and_tail(
    tmp_path: Path,
) -> None:
    small = tmp_path / "small.log"
    small.write_bytes(b"x" * 1024)
    assert node_outputs.bounded(str(small), 1024) == (b"x" * 1024, 1024)
    big = tmp_path / "big.log"
    big.write_bytes(b"H" * 5000 + b"M" * 100_000 + b"T" * 5000)
    data, size = node_outputs.bounded(str(big), 2048)
    assert size == 110_000
    assert data.startswith(b"H" * 1024) and data.endswith(b"T" * 1024)
    assert b"M" not in data
    assert b"107952 bytes cut from the middle" in data and b"bound 2048 bytes" in data


def _archive(src: Path, bound: int = 4096) -> tuple[Path, dict[str, object]]:
    path = src.parent / "a.tgz"
    with path.open("wb") as fh:
        manifest = node_outputs.write_archive(str(src), fh, bound)
    return path, manifest


def test_the_archive_keeps_regular_files_bounded_and_unpacks_them_redacted(
    tmp_path: Path,
) -> None:
    src = tmp_path / "node"
    (src / "logs").mkdir(parents=True)
    (src / "results").mkdir()
    (src / "logs" / "lane-0.log").write_text("serving\n" + SECRETS + "ready\n")
    (src / "logs" / "huge.log").write_bytes(b"a" * 3000 + b"b" * 10_000 + b"z" * 3000)
    (src / "results" / "scores.json").write_text('{"score": 1}')
    (src / "results" / "binary.bin").write_bytes(bytes(range(256)))
    (src / "results" / "escape").symlink_to("/etc/passwd")
    archive, manifest = _archive(src)
    assert manifest["cut"] == ["logs/huge.log"]
    assert manifest["skipped"] == ["results/escape (not a regular file)"]

    dest = tmp_path / "run" / "outputs" / "node-1"
    got = outputs.unpack(archive, dest, Redactor(["the-endpoint-token-value"]), 4096)
    assert (got.status, got.files, got.cut) == ("collected", 4, ["logs/huge.log"])
    log = (dest / "logs" / "lane-0.log").read_text()
    for secret in (HF, AWS_KEY, "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC", "the-endpoint-token-value"):
        assert secret not in log
    assert log.startswith("serving\n") and log.endswith("ready\n") and MASK in log
    assert (dest / "results" / "scores.json").read_text() == '{"score": 1}'
    assert (dest / "results" / "binary.bin").read_bytes() == bytes(range(256))
    assert not (dest / "results" / "escape").exists()
    assert len((dest / "logs" / "huge.log").read_bytes()) < 4096 + 200
    assert oct((dest / "logs" / "lane-0.log").stat().st_mode & 0o777) == "0o600"


def test_an_archive_member_outside_the_nodes_folder_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("../../escaped.txt", "/abs.txt", "ok/fine.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
        link = tarfile.TarInfo("ok/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        tar.addfile(link)
    dest = tmp_path / "outputs" / "n"
    got = outputs.unpack(archive, dest, Redactor(), 4096)
    assert got.files == 1 and (dest / "ok" / "fine.txt").read_text() == "hi"
    assert not (tmp_path / "escaped.txt").exists() and not Path("/abs.txt").exists()
    assert len(got.skipped) == 3


def test_the_collector_streams_this_nodes_outputs_and_removes_them(
    tmp_path: Path, _node_root: Path
) -> None:
    logs, results = node_outputs.prepare("sg-run-1", "node-7")
    Path(logs, "lane-0.log").write_text("hello\n")
    Path(results, "out.csv").write_text("a,b\n")
    env = {**os.environ, "SLURMD_NODENAME": "node-7"}
    done = subprocess.run(
        [sys.executable, "-m", "slurmgate.runtime.steps.outputs", "collect", "sg-run-1", "2048"],
        env=env,
        capture_output=True,
        timeout=30,
        check=True,
    )
    with tarfile.open(fileobj=io.BytesIO(done.stdout), mode="r:gz") as tar:
        names = sorted(tar.getnames())
        manifest = json.loads(tar.extractfile(node_outputs.MANIFEST).read())  # type: ignore[union-attr]
    assert names == sorted(["logs/lane-0.log", "results/out.csv", node_outputs.MANIFEST])
    assert manifest["files"] == {"logs/lane-0.log": 6, "results/out.csv": 4}
    assert not (_node_root / "sg-run-1").exists()  # the node's unredacted copy is gone
    bad = subprocess.run(
        [sys.executable, "-m", "slurmgate.runtime.steps.outputs", "collect", "r", "12"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 64 and "MAX_FILE_BYTES at least 1024" in bad.stderr


def test_a_lanes_output_reaches_the_step_and_a_node_log_and_its_results_dir(
    tmp_path: Path, _node_root: Path
) -> None:
    token = f"sg-out-{os.getpid()}"
    lane = LaneSpec(
        id="lane-0",
        argv=[
            sys.executable,
            "-c",
            "import os,sys,time\n"
            "print('lane says hi', flush=True)\n"
            "print('on stderr', file=sys.stderr, flush=True)\n"
            "open(os.path.join(os.environ['SLURMGATE_RESULTS_DIR'],'r.txt'),'w').write('42')\n"
            "time.sleep(0.5)\n"
            "sys.exit(3)\n",
        ],
        gpus=[0],
        delay_s=0.0,
        env={},
    )
    spec = WorkerSpec(
        run_id=token,
        name="d",
        gpus_per_node=1,
        model_path=None,
        grace_s=1.0,
        nodes=[NodeSpec(host=HOST, ports=[], lanes=[lane])],
    )
    env = {
        **os.environ,
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURMD_NODENAME": HOST,
        "CUDA_VISIBLE_DEVICES": "0",
    }
    done = subprocess.run(
        [sys.executable, "-m", "slurmgate.runtime.steps.node_worker", "serve", "--spec", "-"],
        input=spec.encode(),
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 3, done.stderr
    assert "lane says hi" in done.stderr and "on stderr" in done.stderr
    where = _node_root / token / HOST
    log = (where / "logs" / "lane-0.log").read_text()
    assert "lane says hi\n" in log and "on stderr\n" in log
    assert (where / "results" / "r.txt").read_text() == "42"


# -- collection through srun, on this host -------------------------------------------------

# `srun` for these tests: its options dropped, the command run here as the named node would
# run it; the node `dead` never answers, the node `broken` fails, the node `nocollect` fails
# only its collection (its copy can still be removed).
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
case " $* " in
  *" collect "*) [ "$node" = nocollect ] && { echo "srun: step failed" >&2; exit 1; } ;;
esac
[ "$node" = broken ] && { echo "srun: error: node broken: Unable to contact" >&2; exit 1; }
SLURMD_NODENAME="$node" exec "$@"
"""


@pytest.fixture
def context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunContext:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text(SRUN)
    (bindir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    data = example_data()
    data["endpoint_token"] = {"from_env": "SG_TEST_ENDPOINT_TOKEN"}
    monkeypatch.setenv("SG_TEST_ENDPOINT_TOKEN", "the-endpoint-token-value")
    spec = AllocationSpec.model_validate(data)
    ctx = RunContext.open(spec, runs_root=tmp_path / "runs", log=lambda m: None)
    ctx.job_id = "4242"
    return ctx


def _plant(ctx: RunContext, host: str) -> None:
    logs, results = node_outputs.prepare(ctx.run_id, host)
    Path(logs, "lane-0.log").write_text(f"{host} up\n{SECRETS}")
    Path(results, "metrics.json").write_text('{"ok": true}')


def test_collection_gathers_each_node_and_bounds_a_dead_one(context: RunContext) -> None:
    for host in ("node-1", "node-2"):
        _plant(context, host)
    options = outputs.CollectOptions(max_file_bytes=4096, node_timeout_s=1.0)
    t0 = time.monotonic()
    got = outputs.collect_nodes(context, ["node-1", "node-2", "dead", "broken"], options)
    # both bad nodes tried twice, side by side with the good ones: limit x attempts, not more
    assert time.monotonic() - t0 < 2 * (1.0 + outputs.KILL_GRACE_S) + 4
    by = {o.node: o for o in got}
    assert by["node-1"].status == by["node-2"].status == "collected"
    assert by["node-1"].files == 2
    log = (context.outputs_dir / "node-2" / "logs" / "lane-0.log").read_text()
    assert log.startswith("node-2 up\n") and HF not in log and AWS_KEY not in log
    assert "the-endpoint-token-value" not in log
    assert by["dead"].status == "failed" and by["dead"].attempts == 2
    assert "no archive within 1 s (SLURMGATE_OUTPUTS_NODE_TIMEOUT_S)" in (by["dead"].error or "")
    assert "exited 1" in (by["broken"].error or "") and "Unable to contact" in (
        by["broken"].error or ""
    )
    assert not list(context.outputs_dir.glob(".*.tgz"))  # no archive left behind


def test_collect_all_stores_step_logs_and_client_results_and_records_them(
    context: RunContext,
) -> None:
    step_log = context.run_dir / "03-client.log"
    step_log.write_text("client ran\n" + SECRETS)
    context.client_results_dir.mkdir()
    (context.client_results_dir / "report.txt").write_text("tokens/s 12\n")
    options = outputs.CollectOptions(max_file_bytes=2048, node_timeout_s=1.0)
    lines = outputs.collect_all(context, options)
    assert lines == ["steps: 1 file(s) collected", "client: 1 file(s) collected"]
    copied = (context.outputs_dir / "steps" / "03-client.log").read_text()
    assert copied.startswith("client ran\n") and HF not in copied
    assert (context.outputs_dir / "client" / "results" / "report.txt").exists()
    assert not context.client_results_dir.exists()
    record = RunRecord.read(context.record_path)
    assert record.outputs_dir == str(context.outputs_dir)
    assert [o.node for o in record.outputs] == ["steps", "client"]


def test_a_bad_bound_is_one_line_naming_the_variable(
    context: RunContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURMGATE_OUTPUTS_MAX_FILE_BYTES", "12")
    lines = outputs.collect_all(context)
    assert len(lines) == 1 and "SLURMGATE_OUTPUTS_MAX_FILE_BYTES" in lines[0]
    assert "\n" not in lines[0]


def _launched(ctx: RunContext, hosts: list[str]) -> None:
    ctx.layout = layout.Layout(plan=ctx.plan, hosts=tuple(hosts), addresses={})
    ctx.launched_at = time.time()


def test_a_copy_not_collected_is_removed_from_its_node_or_named_where_it_is_left(
    context: RunContext, _node_root: Path
) -> None:
    for host in ("node-1", "nocollect", "broken"):
        _plant(context, host)
    _launched(context, ["node-1", "nocollect", "broken"])
    options = outputs.CollectOptions(max_file_bytes=4096, node_timeout_s=1.0)
    lines = outputs.collect_all(context, options)
    root = _node_root / context.run_id
    # collected, or not collected but removed: nothing unmasked stays on those nodes
    assert not (root / "node-1").exists() and not (root / "nocollect").exists()
    assert "nocollect: not collected after 2 attempt(s)" in lines[3]
    assert lines[3].endswith("; its copy was removed from the node")
    # a node that answers no step at all keeps its copy, and the line says where
    assert (root / "broken" / "logs" / "lane-0.log").exists()
    assert lines[4].endswith(f"; its copy is left on the node in {root / 'broken'}")
    record = RunRecord.read(context.record_path)
    by = {o.node: o for o in record.outputs}
    assert by["nocollect"].node_copy_removed and by["nocollect"].left_on_node is None
    assert not by["broken"].node_copy_removed
    assert by["broken"].left_on_node == str(root / "broken")


def test_a_run_that_collects_nothing_still_removes_its_nodes_copies(
    context: RunContext, _node_root: Path
) -> None:
    for host in ("node-1", "node-2", "broken"):
        _plant(context, host)
    _launched(context, ["node-1", "node-2", "broken"])
    options = outputs.CollectOptions(enabled=False, node_timeout_s=1.0)
    lines = outputs.collect_all(context, options)
    root = _node_root / context.run_id
    assert sorted(p.name for p in root.iterdir()) == ["broken"]
    assert lines == [
        "outputs not collected (SLURMGATE_OUTPUTS_COLLECT is off); "
        f"left on broken in {root / 'broken'}"
    ]
    assert not context.outputs_dir.exists()


def test_the_remove_step_removes_only_this_nodes_copy(
    _node_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for host in ("a", "b"):
        node_outputs.prepare("run-1", host)
    monkeypatch.setenv("SLURMD_NODENAME", "a")
    assert node_outputs.main(["remove", "run-1"]) == 0
    assert [p.name for p in (_node_root / "run-1").iterdir()] == ["b"]
    assert node_outputs.main(["remove", "run-1"]) == 0  # nothing left: still done
    monkeypatch.setenv("SLURMD_NODENAME", "b")
    assert node_outputs.main(["remove", "run-1"]) == 0
    assert not (_node_root / "run-1").exists()  # the run's folder went with its last node
    assert node_outputs.main(["remove", ".."]) == 1

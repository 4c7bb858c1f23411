"""The allocation runtime end to end on the real local Slurm cluster; every test checks orphans."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurmgate.runtime.ledger.reaper import reap_stale_runs
from slurmgate.runtime.ledger.records import load_records
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.slurm import commands as slurm

from .conftest import EXAMPLE as EXAMPLE_PATH
from .conftest import (
    assert_no_orphans,
    example_data,
    hosts_of,
    job_gone,
    port_held,
    processes_with,
)

pytestmark = pytest.mark.slurm


@pytest.fixture(autouse=True)
def _cluster(slurm_cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # The runtime attaches when SLURM_JOB_ID is set; tests choose explicitly.
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)


def test_happy_path_on_three_nodes(runs_root: Path) -> None:
    data = example_data()
    # chat's endpoint forwards through HAProxy, pipe's through the endpoint itself
    data["deployments"][0]["endpoint_data_plane"] = "haproxy"
    spec = AllocationSpec.from_data(data)
    run = AllocationRun(spec, runs_root=runs_root, grace_s=5)
    haproxies_before = _haproxies()
    result = run.run()
    assert result.ok and result.error is None
    chat_log = next(run.run_dir.glob("[0-9][0-9]-endpoint-chat.log")).read_text()
    assert "through HAProxy" in chat_log
    # HAProxy routed the client's four completions (its counts reach the endpoint's metrics)
    routed = [
        float(line.rsplit(" ", 1)[1])
        for line in result.endpoint_metrics["chat"].splitlines()
        if line.startswith("slurmgate_backend_requests_total{")
    ]
    assert len(routed) == 2 and sum(routed) == 4
    assert _haproxies() <= haproxies_before  # HAProxy went with its endpoint step
    assert len(result.hosts) == 3 and len(set(result.hosts)) == 3
    client_log = next(run.run_dir.glob("[0-9][0-9]-client.log")).read_text()
    assert "chat: 4 completions" in client_log and "pipe: 4 completions" in client_log
    assert set(result.endpoint_metrics) == {"chat", "pipe"}
    assert all(text.strip() for text in result.endpoint_metrics.values())
    record = json.loads(Path(result.record_path).read_text())
    assert record["status"] == "succeeded" and record["owned_allocation"] is True
    serve = [s for s in record["steps"] if s["name"].startswith("serve-")]
    assert len(serve) == 2 and all(s["step_id"].startswith(f"{result.job_id}.") for s in serve)
    # The controller is off the allocation: one probe step for readiness; it reaches the
    # endpoints here, so their metrics are read without a second step.
    assert [s["name"] for s in record["steps"]].count("probe") == 1
    assert run.probe_origin == result.hosts[0]
    assert job_gone(result.job_id)
    assert_no_orphans(run.run_id)
    again = run.cleanup()  # a second cleanup is a no-op that returns the same report
    assert again is run.cleanup() and again.actions == result.cleanup


def _haproxies() -> set[int]:
    """HAProxy processes on this machine (every node of the bundled cluster is on it)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "haproxy":
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def _failing_run(
    data: dict[str, Any], runs_root: Path, phase: str | set[str]
) -> tuple[AllocationRun, str]:
    run = AllocationRun(AllocationSpec.from_data(data), runs_root=runs_root, grace_s=5)
    with pytest.raises(RunFailed) as info:
        run.run()
    phases = {phase} if isinstance(phase, str) else phase
    assert info.value.phase in phases, str(info.value)
    assert run.status == "failed" and run.cleaned
    return run, str(info.value)


def _launched(run: AllocationRun) -> list[str]:
    return [s.name for s in run.supervisor.steps if not s.name.startswith("preflight")]


def test_preflight_wrong_gpu_count_launches_nothing(
    runs_root: Path, held_allocation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = held_allocation(gpus=4)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    run, message = _failing_run(example_data(), runs_root, "preflight")
    assert "check gpu-count" in message and "4 GPUs visible" in message
    assert "node node" in message
    assert _launched(run) == []
    assert slurm.show_job(job) is not None and slurm.show_job(job).active  # not ours to cancel
    assert_no_orphans(run.run_id)


def test_preflight_busy_port_names_node_and_port(
    runs_root: Path, held_allocation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = held_allocation()
    hosts = hosts_of(job)
    with port_held(job, hosts[1], 18100):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        run, message = _failing_run(example_data(), runs_root, "preflight")
        assert f"node {hosts[1]}: check port: port 18100 is not bindable" in message
        assert _launched(run) == []
        assert_no_orphans(run.run_id)


def test_preflight_unreadable_model_path(runs_root: Path) -> None:
    data = example_data()
    data["model_path"] = "/nonexistent/slurmgate-model"
    run, message = _failing_run(data, runs_root, "preflight")
    assert "check model-path" in message and "/nonexistent/slurmgate-model" in message
    assert _launched(run) == []
    assert job_gone(run.job_id)
    assert_no_orphans(run.run_id)


def test_follower_death_fails_the_deployment_fast(runs_root: Path) -> None:
    data = example_data()
    data["client"]["command"] = ["sleep", "60"]
    data["deployments"][1]["env"] = {
        "SLURMGATE_STUB_EXIT_AFTER": "2",
        "SLURMGATE_STUB_EXIT_RANK": "1",
        "SLURMGATE_STUB_EXIT_CODE": "3",
    }
    t0 = time.monotonic()
    # The follower dies 2 s after it starts: during readiness, endpoints or client on a
    # loaded machine; whichever phase, the whole run must fail on it, fast.
    run, message = _failing_run(data, runs_root, {"readiness", "endpoints", "client"})
    assert time.monotonic() - t0 < 30
    assert "required step serve-pipe exited" in message
    pipe_log = next(run.run_dir.glob("*-serve-pipe.log")).read_text()
    # Whichever node notices first reports it: the follower's worker sees its lane exit 3, or
    # the head's worker sees rank 0 exit 1 on the broken rendezvous and srun stops the follower.
    assert re.search(
        r"rank-00001 exited with status 3|rank-00000 exited with status 1", pipe_log
    ), pipe_log
    assert job_gone(run.job_id)
    assert_no_orphans(run.run_id)


def test_readiness_timeout_fails_and_cleans_up(runs_root: Path) -> None:
    data = example_data()
    data["deployments"][0]["env"] = {"SLURMGATE_STUB_HANG": "1"}
    data["deployments"][0]["startup_timeout_s"] = 3
    data["deployments"][0]["distributed_timeout_s"] = 3
    t0 = time.monotonic()
    run, message = _failing_run(data, runs_root, "readiness")
    assert "not ready by the startup deadline" in message and "chat-replica-00000" in message
    assert time.monotonic() - t0 < 30
    assert job_gone(run.job_id)
    assert_no_orphans(run.run_id)


def _hanging_spec(tmp_path: Path) -> Path:
    data = example_data()
    data["deployments"][0]["env"] = {"SLURMGATE_STUB_HANG": "1"}
    path = tmp_path / "hang.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _controller_until(
    phase: str, runs_root: Path, spec: Path
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slurmgate.runtime.run",
            "run",
            str(spec),
            "--runs-dir",
            str(runs_root),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        records = load_records(runs_root)
        if records and records[0].phase == phase:
            time.sleep(0.5)  # well inside the phase
            return proc, records[0]
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"controller never reached {phase}")


def test_sigterm_to_the_controller_mid_readiness_cleans_up(runs_root: Path, tmp_path: Path) -> None:
    proc, record = _controller_until("readiness", runs_root, _hanging_spec(tmp_path))
    assert processes_with(record.run_id)  # lanes are up and hanging
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    assert rc == 128 + signal.SIGTERM, proc.stderr.read() if proc.stderr else ""
    assert time.monotonic() - t0 < 15
    final = load_records(runs_root)[0]
    assert final.status == "failed" and final.cleanup_complete is True
    assert "Terminated: SIGTERM" in final.error
    assert job_gone(final.job_id)
    assert_no_orphans(record.run_id)


def test_signals_during_cleanup_neither_cut_it_short_nor_repeat_it(
    runs_root: Path, tmp_path: Path
) -> None:
    data = example_data()
    data["deployments"] = data["deployments"][:1]  # one node worker: one grace to sit out
    # Lanes that never get ready and ignore SIGTERM: the worker's stop takes its full grace,
    # which leaves seconds of cleanup for the extra signals to land in.
    data["deployments"][0]["command"] = ["sh", "-c", 'trap "" TERM; exec sleep 600']
    spec = tmp_path / "stubborn.yaml"
    spec.write_text(yaml.safe_dump(data))
    proc, record = _controller_until("readiness", runs_root, spec)
    run_id = record.run_id
    deadline = time.monotonic() + 15
    while sum("sleep 600" in p for p in processes_with(run_id)) < 2:
        assert time.monotonic() < deadline, processes_with(run_id)
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not load_records(runs_root)[0].phase.startswith("cleanup"):
        assert time.monotonic() < deadline, "cleanup never started"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    assert proc.poll() is None, "a signal during cleanup must not end it early"
    rc = proc.wait(timeout=60)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert rc == 128 + signal.SIGTERM, stderr  # the first signal decides the exit status
    assert stderr.count("cleanup complete in") == 1, stderr
    final = load_records(runs_root)[0]
    assert final.status == "failed" and final.cleanup_complete is True, final
    assert job_gone(final.job_id)
    assert_no_orphans(run_id, within=15)


def test_reap_leftovers_after_a_sigkilled_controller(runs_root: Path, tmp_path: Path) -> None:
    proc, record = _controller_until("readiness", runs_root, _hanging_spec(tmp_path))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    time.sleep(0.5)
    assert processes_with(record.run_id), "a SIGKILLed controller should leave its steps"
    records = load_records(runs_root)
    assert records[0].job_id and records[0].status == "running"
    actions = reap_stale_runs(records).actions
    assert any(a.startswith(f"scancel {records[0].job_id}") for a in actions), actions
    assert job_gone(records[0].job_id)
    assert_no_orphans(record.run_id, within=15)
    assert reap_stale_runs(load_records(runs_root)).actions == []  # a second pass: nothing


def test_cleanup_during_a_long_stagger_returns_within_2s(runs_root: Path) -> None:
    data = example_data()
    data["deployments"][0]["lead_boot_standoff_s"] = 30  # replica 1 of chat waits 30.5 s
    run = AllocationRun(AllocationSpec.from_data(data), runs_root=runs_root, grace_s=5)
    try:
        run.allocate()
        run.resolve()
        run.preflight()
        run.launch()
        time.sleep(1.5)  # replica 0 is up, replica 1 is waiting out its delay
    finally:
        t0 = time.monotonic()
        report = run.cleanup()
        elapsed = time.monotonic() - t0
    assert report.complete
    # The steps' stop and the release, the part a lane waiting out its delay could hold up.
    # The node outputs' collection before the release is bounded on its own, per node
    # (SLURMGATE_OUTPUTS_NODE_TIMEOUT_S), and a loaded machine stretches its sruns.
    collect_s = run.context.timings.marks["collect"]
    assert elapsed - collect_s < 2.0, (collect_s, report.actions)
    chat_log = next(run.run_dir.glob("*-serve-chat.log")).read_text()
    assert "started lane chat-replica-00000-rank-00000" in chat_log
    assert "chat-replica-00001" not in chat_log  # the delayed lane never started
    assert job_gone(run.job_id)
    assert_no_orphans(run.run_id)


def test_salloc_that_cannot_be_granted_leaves_no_pending_job(runs_root: Path) -> None:
    # Five nodes on a four-node cluster: salloc waits, times out, and cleanup cancels by name.
    data = example_data()
    data["client"]["dedicated_node"] = True
    data["deployments"][0]["replicas"] = 4
    data["deployments"][0]["lanes_per_node"] = 2
    spec = AllocationSpec.from_data(data)
    assert spec.total_nodes == 5
    run = AllocationRun(spec, runs_root=runs_root, allocate_timeout_s=2.0)
    with pytest.raises(slurm.SlurmError, match="timed out"):
        run.run()
    assert run.cleaned and run.job_id is None
    pending = slurm.run(["squeue", "-h", "-n", run.run_id, "-o", "%i"]).stdout.strip()
    assert pending == ""


def test_deployment_env_reaches_lanes_but_never_a_command_line(
    runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"tok-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("TEST_HF_TOKEN", secret)
    data = example_data()
    data["deployments"][1]["env"] = {"HF_TOKEN": {"from_env": "TEST_HF_TOKEN"}}
    run = AllocationRun(AllocationSpec.from_data(data), runs_root=runs_root, grace_s=5)
    try:
        run.until_ready()
        in_env, in_argv = [], []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
                environ = Path(f"/proc/{entry.name}/environ").read_bytes()
            except OSError:
                continue
            if secret.encode() in cmdline:
                in_argv.append(cmdline)
            if f"HF_TOKEN={secret}".encode() in environ and b"stub_server" in cmdline:
                in_env.append(cmdline)
        assert in_argv == []
        assert len(in_env) == 2  # the pipe deployment's two ranks
    finally:
        run.finish(None)
    assert secret not in run.record_path.read_text()
    assert_no_orphans(run.run_id)


def test_runs_inside_a_batch_job_by_attaching_to_its_allocation(tmp_path: Path) -> None:
    """Production shape: the controller is the batch script of a 3-node job and attaches."""
    runs_root = tmp_path / "runs"
    out = tmp_path / "batch.out"
    job = slurm.sbatch(
        [
            "--nodes=3",
            "--gres=gpu:8",
            "--job-name=sg-test-batch",
            f"--output={out}",
            f"--chdir={tmp_path}",
            "--time=00:05:00",
            "--wrap",
            f"exec {sys.executable} -m slurmgate.runtime.run run "
            f"{EXAMPLE_PATH} --runs-dir {runs_root}",
        ]
    )
    try:
        assert job_gone(job, within=90), "the batch job did not finish"
        info = slurm.run(["scontrol", "show", "job", "-o", job], check=False).stdout
        log = out.read_text()
        assert "ExitCode=0:0" in info, log
        (record,) = load_records(runs_root)
        assert record.job_id == job and record.owned_allocation is False
        assert record.status == "succeeded" and record.cleanup_complete is True
        client_log = next((runs_root / record.run_id).glob("[0-9][0-9]-client.log"))
        assert "client ok: 8 completions" in client_log.read_text()
        assert "decision: attach to allocation" in log
        # The controller runs on the client host (the batch step is on the first node), so it
        # probes from its own process: no probe step.
        assert f"decision: probes run in the controller, which is on {record.hosts[0]}" in log
        assert "probe" not in [step.name for step in record.steps]
        assert_no_orphans(record.run_id)
    finally:
        slurm.scancel(job)

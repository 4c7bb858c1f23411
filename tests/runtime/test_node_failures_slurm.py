"""Node failures on the real cluster: a node that fails preflight is drained, left out, retried;
the reaper cancels another user's allocation whose controller died, and another host's whose
controller stopped beating; a run's heartbeat is in its allocation's comment."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.ledger.comment import ProcessIdentity, job_comment, parse_job_comment
from slurmgate.runtime.ledger.reaper import reap_stale_runs
from slurmgate.runtime.ledger.records import load_records
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.slurm import commands as slurm

from .conftest import assert_no_orphans, example_data, hosts_of, job_gone, port_held

pytestmark = pytest.mark.slurm

# One completion through the logical endpoint: the retry served for real.
CLIENT = (
    "import json, os, urllib.request\n"
    "url = json.loads(os.environ['SLURMGATE_ENDPOINTS'])['chat'] + '/v1/completions'\n"
    "body = json.dumps({'model': 'stub', 'prompt': 'hi', 'max_tokens': 2}).encode()\n"
    "req = urllib.request.Request(url, data=body, headers={'Content-Type': 'application/json'})\n"
    "assert json.loads(urllib.request.urlopen(req, timeout=20).read())['choices']\n"
    "print('client ok', flush=True)\n"
)


def _one_node_spec(client: str = CLIENT) -> AllocationSpec:
    data = example_data()
    data["name"] = "nodefail"
    data["time_limit"] = "00:03:00"
    data["client"]["command"] = ["python", "-c", client]
    chat = data["deployments"][0]
    chat.update(replicas=1, gpus_per_node=1, startup_timeout_s=30)
    data["deployments"] = [chat]
    return AllocationSpec.from_data(data)


def _node_state(node: str) -> tuple[str, str]:
    out = slurm.run(["scontrol", "show", "node", "-o", node]).stdout
    fields = dict(t.partition("=")[::2] for t in out.split() if "=" in t)
    reason = out.partition("Reason=")[2]
    return fields.get("State", ""), reason


def test_a_node_failing_preflight_is_drained_and_the_retry_runs_without_it(
    prefect_harness: None,
    runs_root: Path,
    held_allocation: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from slurmgate.flows.allocation import allocation

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("SLURMGATE_DRAIN_FAILED_NODES", "1")
    spec = _one_node_spec()
    # A listener on the client's endpoint port, on the node Slurm gives a one-node job first:
    # that node's client preflight fails its port check, the others' would pass.
    holder = held_allocation(nodes=1, gpus=0)
    (bad,) = hosts_of(holder)
    try:
        with port_held(holder, bad, spec.deployments[0].endpoint_port):
            summary = allocation(spec=spec, runs_dir=str(runs_root))
        records = {r.run_id: r for r in load_records(runs_root)}
        assert summary["retry_of"] in records, "the first attempt did not fail on its node"
        first, second = records[summary["retry_of"]], records[summary["run_id"]]
        assert (
            first.hosts == [bad]
            and first.status == "failed"
            and first.phase.endswith("(after preflight)")
        )
        failure = first.node_failure
        assert failure is not None and failure.node == bad and failure.retried
        assert failure.kind == "preflight" and "check port failed" in failure.reason
        assert failure.drain and failure.drain.startswith("drained")
        assert first.retried_as == second.run_id
        assert second.status == "succeeded" and second.retry_of == first.run_id
        assert second.excluded_nodes == [bad] and bad not in second.hosts
        assert summary["excluded_nodes"] == [bad] and summary["hosts"] == second.hosts
        state, reason = _node_state(bad)
        assert "DRAIN" in state and first.run_id in reason, (state, reason)
        for rec in (first, second):
            assert job_gone(rec.job_id)
            assert_no_orphans(rec.run_id)
    finally:
        slurm.resume_node(bad)
    assert "DRAIN" not in _node_state(bad)[0]


# A controller of another user: it asks salloc for a job with the comment a run gives it (its
# own pid and start time in place of the template's), then dies. Debian's own python3: the
# test's interpreter lives where that user cannot read.
FOREIGN_CONTROLLER = (
    "import os, socket, subprocess, sys\n"
    "start = open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]\n"
    "me = f'{socket.gethostname()}/{os.getpid()}/{start}'\n"
    "argv = [a.replace('HOST/11111/22222', me) for a in sys.argv[1:]]\n"
    "out = subprocess.run(argv, capture_output=True, text=True)\n"
    "print(out.stderr, flush=True)\n"
)


def test_the_reaper_cancels_another_users_allocation_whose_controller_died(
    runs_root: Path,
) -> None:
    if os.geteuid() != 0 or not Path("/usr/bin/python3").exists():
        pytest.skip("starts a controller as another Unix user: needs root and /usr/bin/python3")
    user = "sgreaptest"
    if subprocess.run(["id", user], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
                       check=True)  # fmt: skip
    run_id = f"sg-foreign-{os.getpid()}"
    template = job_comment(run_id, ProcessIdentity(pid=11111, started=22222, host="HOST"))
    argv = slurm.salloc_argv(nodes=1, job_name=run_id, time_limit="00:02:00", comment=template)
    out = subprocess.run(
        ["runuser", "-u", user, "--", "/usr/bin/python3", "-c", FOREIGN_CONTROLLER, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"], "SLURM_CONF": os.environ["SLURM_CONF"], "HOME": "/"},
        cwd="/",
    )
    granted = re.search(r"Granted job allocation (\d+)", out.stdout + out.stderr)
    assert granted, out.stdout + out.stderr
    job = granted.group(1)
    try:
        (queued,) = [j for j in slurm.jobs_of_all_users() if j.job_id == job]
        assert queued.user == user and queued.name == run_id
        # This user's runs root has no record of it, and its controller has exited.
        lines: list[str] = []
        live = reap_stale_runs(load_records(runs_root), info=lines.append)
        assert live.reaped == 0 and slurm.show_job(job).active  # type: ignore[union-attr]
        tally = reap_stale_runs(load_records(runs_root), info=lines.append, all_users=True)
        assert tally.reaped == 1, lines
        assert len(lines) == 1, lines
        assert lines[0].startswith(
            f"reap run={run_id} job={job} scancel {job} (allocation of user {user}; controller pid"
        ) and lines[0].endswith(f"on {socket.gethostname()} is gone)"), lines
        assert job_gone(job)
        again = reap_stale_runs(load_records(runs_root), info=lines.append, all_users=True)
        assert again.reaped == 0  # nothing left
    finally:
        slurm.scancel(job)


def _comment_of(job_id: str) -> str:
    (job,) = [j for j in slurm.jobs_of_all_users() if j.job_id == job_id]
    return job.comment


def test_a_run_beats_in_its_allocations_comment_until_its_cleanup(
    runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slurmgate.runtime.run.allocation_run import AllocationRun

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("SLURMGATE_HEARTBEAT_S", "1")
    spec = _one_node_spec("import time; time.sleep(6)")
    run = AllocationRun(spec, runs_root=runs_root, grace_s=5)
    worker = threading.Thread(target=run.run, daemon=True)
    worker.start()
    beats: set[int] = set()
    deadline = time.monotonic() + 120
    try:
        while worker.is_alive() and time.monotonic() < deadline:
            if run.job_id and run.phase == "client":
                parsed = parse_job_comment(_comment_of(run.job_id))
                assert parsed is not None and parsed.run_id == run.run_id
                assert parsed.controller == ProcessIdentity.current()
                if parsed.beat is not None:
                    beats.add(parsed.beat)
            time.sleep(0.3)
    finally:
        worker.join(timeout=60)
    assert run.status == "succeeded", run.error
    # the comment moved on while the client ran, and the beating ended with the run
    assert len(beats) >= 2, beats
    assert max(beats) - min(beats) >= 1
    assert run._heartbeat is not None and run._heartbeat.beats >= 2
    assert not any(t.name == f"heartbeat-{run.job_id}" for t in threading.enumerate())
    assert job_gone(run.job_id)
    assert_no_orphans(run.run_id)


def test_the_reaper_cancels_another_hosts_allocation_whose_heartbeat_stopped(
    runs_root: Path,
) -> None:
    # Two allocations whose comments say another host controls them: one beat an hour ago,
    # one beats now. This host cannot see either controller's process; only the beat counts.
    away = ProcessIdentity(pid=4242, started=1, host="login-elsewhere")
    now = int(time.time())
    jobs = {}
    try:
        for name, beat in (("silent", now - 3600), ("beating", now)):
            run_id = f"sg-away-{name}-{os.getpid()}"
            jobs[name] = slurm.salloc_no_shell(
                nodes=1, job_name=run_id, time_limit="00:03:00",
                comment=job_comment(run_id, away, beat),
            )  # fmt: skip
        lines: list[str] = []
        # without every user's allocations in view, nothing of theirs is touched
        assert reap_stale_runs(load_records(runs_root), info=lines.append).reaped == 0
        tally = reap_stale_runs(
            load_records(runs_root), info=lines.append, all_users=True, stale_after_s=600
        )
        assert tally.reaped == 1, lines
        (line,) = lines
        silent = jobs["silent"]
        assert line.startswith(f"reap run=sg-away-silent-{os.getpid()} job={silent} scancel")
        assert "controller pid 4242 on login-elsewhere last beat" in line, line
        assert job_gone(silent)
        assert slurm.show_job(jobs["beating"]).active  # type: ignore[union-attr]
    finally:
        for job in jobs.values():
            slurm.scancel(job)

"""The runtime's srun steps and preflight verdicts, without Slurm: argv and report checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmgate.runtime.engines import layout
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.preflight import preflight_reports
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.steps import protocol
from slurmgate.slurm import commands as slurm

from .conftest import example_data


def _flag(argv: list[str], name: str) -> str | None:
    """The value of --name=V before the `--` that starts the command; None if absent."""
    head = argv[: argv.index("--")]
    values = [a.split("=", 1)[1] for a in head if a.startswith(f"--{name}=")]
    assert len(values) <= 1, (name, head)
    return values[0] if values else None


def test_every_serve_step_is_fail_fast_with_one_task_per_node(runs_root: Path) -> None:
    run = AllocationRun(AllocationSpec.from_data(example_data()), runs_root=runs_root)
    run.job_id = "4242"
    hosts = ["n1", "n2", "n3"]
    run.layout = layout.bind(run.plan, hosts, {h: f"10.0.0.{i}" for i, h in enumerate(hosts)})
    seen = {}
    for d in run.plan.deployments:
        nodelist = run.layout.nodelist(d)
        argv = run.worker_argv(f"serve-{d.name}", "serve", nodelist, None)
        head = argv[: argv.index("--")]
        command = argv[argv.index("--") + 1 :]
        assert command[1:] == ["-m", "slurmgate.runtime.steps.node_worker", "serve", "--spec", "-"]
        # Slurm ends every node's task when one exits non-zero: the seed's fail-fast.
        assert _flag(argv, "kill-on-bad-exit") == "1", head
        n = str(len(nodelist))
        assert (_flag(argv, "nodes"), _flag(argv, "ntasks")) == (n, n), head
        assert _flag(argv, "ntasks-per-node") == "1", head
        assert _flag(argv, "nodelist") == ",".join(nodelist), head
        assert _flag(argv, "jobid") == "4242" and "--overlap" in head
        # No --exact: it would hold a node's model servers to the one CPU a task asks for.
        assert "--exact" not in head
        assert _flag(argv, "gres") is None  # the serve step keeps the job's GPUs
        seen[d.name] = nodelist
    assert seen == {"chat": ["n1"], "pipe": ["n2", "n3"]}


def test_srun_argv_keeps_the_fail_fast_flag_by_default() -> None:
    argv = slurm.srun_argv(["true"], job_id="1", nodelist=["a", "b"], step_name="s")
    assert "--kill-on-bad-exit=1" in argv[: argv.index("--")]


def _ok(host: str, cpus: int = 8, gpus: int = 8) -> str:
    return protocol.encode(protocol.PreflightPassed(host=host, cpus=cpus, gpus=gpus)) + "\n"


def test_preflight_reports_are_read_even_when_srun_joins_two_lines() -> None:
    log = _ok("n2").rstrip("\n") + _ok("n3", cpus=4) + "srun: a message\n"
    reports = preflight_reports(log, ["n2", "n3"], "preflight-pipe")
    assert reports["n3"].cpus == 4 and reports["n2"].gpus == 8


def test_a_node_that_reports_from_another_host_fails_the_preflight() -> None:
    with pytest.raises(RunFailed) as info:
        preflight_reports(_ok("n2") + _ok("elsewhere"), ["n2", "n3"], "preflight-pipe")
    message = str(info.value)
    assert info.value.phase == "preflight"
    assert "preflight-pipe: a task ran on elsewhere, which the plan does not have" in message
    assert "planned: n2, n3" in message


def test_a_node_that_does_not_report_fails_the_preflight() -> None:
    with pytest.raises(RunFailed, match="node n3 did not report its preflight"):
        preflight_reports(_ok("n2"), ["n2", "n3"], "preflight-pipe")
    with pytest.raises(RunFailed, match="2 report"):
        preflight_reports(_ok("n2") + _ok("n2"), ["n2"], "preflight-chat")

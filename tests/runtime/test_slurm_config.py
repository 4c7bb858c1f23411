"""Where Slurm calls find their configuration, the site options of a spec, and the client echo.

No cluster needed: the record is a file, the argv are rendered, and the Slurm client that runs
without a configuration fails in milliseconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmgate.runtime.engines import layout
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.client import OutputEcho
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError
from slurmgate.slurm import commands as slurm
from slurmgate.slurm.config import (
    BundledCluster,
    cluster_record_path,
    recorded_slurm_conf,
    save_cluster,
)

from .conftest import EXAMPLE, example_data

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_slurm_conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """No SLURM_CONF, and a state directory of the test's own: returns a slurm.conf path."""
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv("SLURMGATE_STATE_DIR", str(tmp_path / "state"))
    conf = tmp_path / "etc" / "slurm.conf"
    conf.parent.mkdir()
    conf.write_text("ClusterName=test\n")
    yield conf


def _record(conf: Path, started: bool = True) -> None:
    save_cluster(
        BundledCluster(
            slurm_conf=str(conf), directory=str(conf.parent.parent), started_by_up=started
        )
    )


def test_the_recorded_conf_reaches_slurm_calls_and_steps_only_when_none_is_set(
    no_slurm_conf: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert "SLURM_CONF" not in slurm.environ()
    _record(no_slurm_conf)
    assert oct(cluster_record_path().stat().st_mode & 0o777) == "0o600"
    assert slurm.environ()["SLURM_CONF"] == str(no_slurm_conf)
    # The step environments (srun's own, and the tasks') get it too.
    run = AllocationRun(AllocationSpec.from_data(example_data()), runs_root=tmp_path / "runs")
    assert run._base_env()["SLURM_CONF"] == str(no_slurm_conf)
    # A SLURM_CONF the user set always wins.
    monkeypatch.setenv("SLURM_CONF", "/site/slurm.conf")
    assert slurm.environ()["SLURM_CONF"] == "/site/slurm.conf"
    assert run._base_env()["SLURM_CONF"] == "/site/slurm.conf"


def test_a_stale_or_untrusted_record_is_ignored(no_slurm_conf: Path) -> None:
    _record(no_slurm_conf)
    cluster_record_path().chmod(0o620)  # others could have pointed it anywhere
    assert recorded_slurm_conf() is None
    cluster_record_path().chmod(0o600)
    assert recorded_slurm_conf() == str(no_slurm_conf)
    no_slurm_conf.unlink()  # the cluster's directory is gone
    assert recorded_slurm_conf() is None and "SLURM_CONF" not in slurm.environ()


def _without_a_configuration() -> None:
    if shutil.which("scontrol") is None:
        pytest.skip("the Slurm client is not installed (Debian package slurm-client)")
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("this machine has a site /etc/slurm/slurm.conf")


def test_no_configuration_is_one_line_with_the_fix(no_slurm_conf: Path) -> None:
    _without_a_configuration()
    with pytest.raises(slurm.SlurmNotConfigured) as caught:
        slurm.check_configured()
    assert str(caught.value) == slurm.NO_CONFIGURATION
    # Even a call that does not check its exit code must not read it as an empty answer.
    with pytest.raises(slurm.SlurmNotConfigured):
        slurm.list_steps("1")


def test_a_slurm_conf_naming_no_file_fails_at_once_in_one_line(
    no_slurm_conf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("scontrol") is None:
        pytest.skip("the Slurm client is not installed (Debian package slurm-client)")
    missing = no_slurm_conf.parent / "gone" / "slurm.conf"
    monkeypatch.setenv("SLURM_CONF", str(missing))
    t0 = time.monotonic()
    with pytest.raises(slurm.SlurmNotConfigured) as caught:
        slurm.check_configured(timeout=10.0)
    # Slurm itself would retry the missing file for the whole timeout.
    assert time.monotonic() - t0 < 2
    assert str(caught.value) == slurm.missing_conf_message(str(missing))
    assert str(missing) in str(caught.value) and "\n" not in str(caught.value)


def test_a_configuration_whose_controller_is_down_is_one_line_with_the_fix(
    no_slurm_conf: Path,
) -> None:
    if shutil.which("scontrol") is None:
        pytest.skip("the Slurm client is not installed (Debian package slurm-client)")
    # Port 1: nothing listens there, so the controller is down at once.
    no_slurm_conf.write_text(
        "ClusterName=test\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1\n"
        "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n"
    )
    _record(no_slurm_conf)  # what `cluster up` left, with the cluster since stopped
    t0 = time.monotonic()
    with pytest.raises(slurm.SlurmControllerDown) as caught:
        slurm.check_configured()
    assert time.monotonic() - t0 < 5
    message = str(caught.value)
    assert "is DOWN" in message and str(no_slurm_conf) in message and "\n" not in message
    assert message.endswith("start slurmctld, or the bundled cluster with `slurmgate cluster up`")


def test_allocation_run_without_a_configuration_fails_fast_in_one_line(
    no_slurm_conf: Path, tmp_path: Path
) -> None:
    _without_a_configuration()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    # Fast means before Prefect starts: Python's own import log shows that no Prefect module was
    # imported (a wall-clock bound would measure the machine's load instead).
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "slurmgate.cli", "allocation", "run",
         str(EXAMPLE)],
        capture_output=True, text=True, env=env, timeout=60, cwd=REPO,
    )  # fmt: skip
    imports = [line for line in out.stderr.splitlines() if line.startswith("import time:")]
    stderr = "".join(f"{line}\n" for line in out.stderr.splitlines() if line not in imports)
    assert out.returncode == 1, out
    assert stderr == f"error: {slurm.NO_CONFIGURATION}\n", stderr
    assert out.stdout == ""
    imported = {line.rsplit("|", 1)[-1].strip() for line in imports}
    assert "typer" in imported  # the log is there: the CLI itself was imported
    assert not {name for name in imported if name.split(".")[0] == "prefect"}


def test_reap_without_a_configuration_says_how_to_give_it_one(
    no_slurm_conf: Path, tmp_path: Path
) -> None:
    _without_a_configuration()
    record = {
        "run_id": "sg-noconf-1",
        "status": "running",
        "job_id": "4242",
        "owned_allocation": True,
        "controller_pid": 2**22 + 1,  # above pid_max: no such controller
        "controller_host": os.uname().nodename,
        "steps": [],
    }
    path = tmp_path / "runs" / "sg-noconf-1" / "record.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    cmd = [sys.executable, "-m", "slurmgate.cli", "allocation", "reap"]
    out = subprocess.run(
        [*cmd, "--runs-dir", str(path.parent.parent)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 1, out
    assert out.stderr == (
        f"error: reap stopped: {slurm.NO_CONFIGURATION}; the run records are kept for the "
        "next reap\n"
    )
    assert json.loads(path.read_text())["status"] == "running"


def test_cluster_down_leaves_a_cluster_it_did_not_start(
    no_slurm_conf: Path, tmp_path: Path
) -> None:
    """The directory named is not a running cluster: nothing here can stop the suite's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_LOCAL_DIR"] = str(tmp_path / "elsewhere")

    def down(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "slurmgate.cli", "cluster", "down", *flags],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    nothing = down()
    assert nothing.returncode == 0 and nothing.stderr == "", nothing
    assert nothing.stdout.count("\n") == 1 and "left running" in nothing.stdout
    assert "`slurmgate cluster up` recorded no cluster" in nothing.stdout
    _record(no_slurm_conf, started=False)
    theirs = down()
    assert "left running: it was already running when `slurmgate cluster up` ran" in theirs.stdout
    assert "--force" in theirs.stdout
    assert not cluster_record_path().exists()  # down forgets it either way
    _record(no_slurm_conf, started=True)
    ours = down()
    assert ours.returncode == 0 and ours.stdout == "slurm-local cluster stopped\n", ours
    assert down("--force").stdout == "slurm-local cluster stopped\n"


# -- the spec's site options --------------------------------------------------------------------


def _site_spec(**fields: object) -> AllocationSpec:
    return AllocationSpec.from_data({**example_data(), **fields})


def test_the_slurm_site_options_reach_salloc(tmp_path: Path) -> None:
    site = {
        "partition": "gpu,gpu-long",
        "account": "proj-7",
        "qos": "high",
        "reservation": "gpu-ci",
        "constraint": "mi300x&ib",
    }
    run = AllocationRun(_site_spec(slurm=site), runs_root=tmp_path)
    argv = slurm.salloc_argv(**run.salloc_request())
    assert argv[:2] == ["salloc", "--no-shell"]
    assert {
        "--partition=gpu,gpu-long",
        "--account=proj-7",
        "--qos=high",
        "--reservation=gpu-ci",
        "--constraint=mi300x&ib",
    } <= set(argv)
    assert "--nodes=3" in argv and "--time=00:10:00" in argv
    plain = slurm.salloc_argv(**AllocationRun(_site_spec(), runs_root=tmp_path).salloc_request())
    site_flags = ("--partition", "--account", "--qos", "--reservation", "--constraint")
    assert not [a for a in plain if a.startswith(site_flags)]


def test_a_run_of_a_reservation_mapped_pool_gets_the_nodes_the_controller_counted(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """A pool mapped to a reservation counts only that reservation's nodes; a run whose spec
    names it is granted those nodes at once, and one that does not would wait in the queue."""
    from slurmgate.settings.admission import PoolPartition
    from slurmgate.slurm.capacity import read_pool_capacity

    name = f"sg-ci-{os.getpid()}"
    slurm.run(
        [
            *("scontrol", "create", "reservation", f"reservationname={name}"),
            *("nodes=node[2-4]", "starttime=now", "duration=10", "users=root"),
        ]
    )
    job_id = None
    unmapped = AllocationRun(_site_spec(), runs_root=tmp_path / "plain")
    try:
        pools = {"cluster:x": PoolPartition(partition="debug", reservation=name)}
        assert read_pool_capacity(pools)["cluster:x"].usable == 3
        with pytest.raises(slurm.SlurmError):  # node1 alone is outside the reservation
            slurm.salloc_no_shell(**unmapped.salloc_request(), extra=["--immediate=2"], timeout=30)
        spec = _site_spec(slurm={"partition": "debug", "reservation": name})
        request = AllocationRun(spec, runs_root=tmp_path / "mapped").salloc_request()
        job_id = slurm.salloc_no_shell(**request, extra=["--immediate=10"], timeout=30)
        info = slurm.show_job(job_id)
        assert info is not None and info.num_nodes == 3
        assert slurm.show_hostnames(info.nodelist) == ["node2", "node3", "node4"]
    finally:
        if job_id:
            slurm.scancel(job_id)
        slurm.scancel_by_name(unmapped.run_id)
        deadline = time.monotonic() + 30
        while slurm.run(["scontrol", "delete", f"reservation={name}"], check=False).returncode:
            assert time.monotonic() < deadline, "the reservation could not be deleted"
            time.sleep(0.5)


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"slurm": {"partition": "gpu --exclusive"}}, "slurm.partition"),
        ({"slurm": {"account": "-A"}}, "slurm.account"),
        ({"slurm": {"qos": ""}}, "slurm.qos"),
        ({"slurm": {"reservation": "gpu-ci --exclusive"}}, "slurm.reservation"),
        ({"slurm": {"constraint": "-x"}}, "slurm.constraint"),
        ({"slurm": {"constraint": "a b"}}, "slurm.constraint"),
        ({"slurm": {"reservaton": "gpu-ci"}}, "slurm.reservaton"),
        ({"python": "python3"}, "python"),
        ({"python": "/opt/my env/bin/python"}, "python"),
    ],
)
def test_bad_site_options_name_the_field_and_the_fix(fields: dict[str, object], where: str) -> None:
    with pytest.raises(SpecError) as caught:
        _site_spec(**fields)
    field, message, fix = caught.value.problems[0]
    assert field == where, caught.value
    assert message and fix


@pytest.mark.parametrize("path", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_spec_is_valid(path: Path) -> None:
    spec = AllocationSpec.from_yaml(path)
    if path.name == "site-vllm.yaml":  # the template for a real site uses the site fields
        assert spec.python and spec.slurm.partition and spec.slurm.account and spec.slurm.qos


def test_the_spec_python_runs_every_node_side_step(tmp_path: Path) -> None:
    python = "/shared/venvs/slurmgate/bin/python"
    run = AllocationRun(_site_spec(python=python), runs_root=tmp_path)
    run.job_id = "4242"
    hosts = ["n1", "n2", "n3"]
    run.layout = layout.bind(run.plan, hosts, {h: f"10.0.0.{i}" for i, h in enumerate(hosts)})
    argv = run.worker_argv("preflight-chat", "preflight", ["n1"], None)
    assert argv[argv.index("--") + 1 :][:3] == [python, "-m", "slurmgate.runtime.steps.node_worker"]
    # The lanes' own `python -m ...` commands find the same interpreter first on PATH.
    assert run._base_env()["PATH"].split(os.pathsep)[0] == "/shared/venvs/slurmgate/bin"
    default = AllocationRun(_site_spec(), runs_root=tmp_path)
    assert default.python == sys.executable


def test_an_interpreter_that_cannot_run_names_the_python_field(tmp_path: Path) -> None:
    run = AllocationRun(_site_spec(python="/nowhere/bin/python"), runs_root=tmp_path)
    log = (
        "srun: error: node1: task 0: Exited with exit code 2\n"
        "slurmstepd-node1: error: execve(): /nowhere/bin/python: No such file or directory\n"
    )
    problem = run.interpreter_problem(log)
    assert problem is not None and problem.startswith("python: /nowhere/bin/python cannot run")
    assert "node1" in problem and "No such file or directory" in problem and "fix:" in problem
    assert run.interpreter_problem("SLURMGATE-PREFLIGHT host=node1 check=gpus: x") is None
    bare = (
        "/usr/bin/python3: Error while finding module specification for "
        "'slurmgate.runtime.steps.node_worker' (ModuleNotFoundError: No module named 'slurmgate')\n"
    )
    problem = run.interpreter_problem(bare)
    assert problem is not None and problem.startswith("python: /nowhere/bin/python has no slurm")


# -- the client's output ------------------------------------------------------------------------


def test_the_echo_copies_whole_lines_as_they_come_then_only_the_tail(tmp_path: Path) -> None:
    path = tmp_path / "client.log"
    seen: list[str] = []
    echo = OutputEcho(path, seen.append, limit=3, tail=2)
    echo.poll()  # no file yet
    with path.open("ab") as fh:
        fh.write(b"one\ntw")
        fh.flush()
        echo.poll()
        assert seen == ["one"]
        fh.write(b"o\nbar 10%\rbar 100%\n")
        fh.flush()
        echo.poll()
        assert seen == ["one", "two", "bar 100%"]
        fh.write(b"a\nb\nc\nd\nno newline")
    echo.finish()
    assert seen[3:] == ["... 3 line(s) left out, the last 2:", "d", "no newline"]

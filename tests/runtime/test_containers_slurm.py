"""A deployment in Slurm's own OCI containers (`srun --container=BUNDLE`), on the bundled cluster.

The bundle is made here: `runc spec`'s config without network and UTS namespaces (the task
keeps its node's address and name, as on a GPU site's nodes) and a rootfs of read-only bind
mounts of this machine's system directories. Debian's runc runs it through the cluster's
oci.conf; the lane inside serves the stub, and the endpoint reaches it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.slurm import commands as slurm
from slurmgate.testbed.demo import processes_with_env

from .conftest import REPO, hosts_of
from .test_mpi_world_slurm import ask_client

pytestmark = pytest.mark.slurm

SYSTEM_DIRS = ("usr", "bin", "lib", "lib64", "sbin", "etc")

ASK = ask_client("box")


def _cluster_dir() -> Path:
    return Path(os.environ["SLURM_CONF"]).parent.parent


def _runc_list() -> list[Any]:
    out = subprocess.run(
        ["runc", "--root", str(_cluster_dir() / "runc"), "list", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.strip()
    return json.loads(out) if out and out != "null" else []


def make_bundle(where: Path) -> Path:
    """A bundle as `runc spec` makes it, keeping the node's network and name."""
    assert (_cluster_dir() / "etc" / "oci.conf").is_file(), (
        "the bundled cluster has no oci.conf: install Debian's runc (scripts/setup.sh does) and "
        "restart it"
    )
    where.mkdir(parents=True)
    subprocess.run(["runc", "spec"], cwd=where, check=True, timeout=30)
    config = json.loads((where / "config.json").read_text())
    config["process"]["terminal"] = False
    config["linux"]["namespaces"] = [
        n for n in config["linux"]["namespaces"] if n["type"] not in ("network", "uts")
    ]
    config.pop("hostname", None)
    for d in SYSTEM_DIRS:
        config["mounts"].append(
            {"destination": f"/{d}", "type": "bind", "source": f"/{d}", "options": ["rbind", "ro"]}
        )
        (where / "rootfs" / d).mkdir(parents=True)
    config["root"] = {"path": "rootfs", "readonly": True}
    (where / "config.json").write_text(json.dumps(config))
    return where


def _python_mounts() -> list[str]:
    """The project's Python at its own path inside: its venv's interpreter is a link into it."""
    base = Path(sys.base_prefix).resolve()
    if base.parts[1] in SYSTEM_DIRS:
        return []
    return [f"{base}:{base}:ro"]


def _spec(name: str, bundle: Path, setup: Path, client: str) -> AllocationSpec:
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": name,
            "gpus_per_node": 2,
            "time_limit": "00:05:00",
            "client": {"command": [sys.executable, "-c", client], "dedicated_node": True},
            "deployments": [
                {
                    "name": "box",
                    "command": [sys.executable, "-m", "slurmgate.testbed.stub_server"],
                    "replicas": 2,
                    "nodes_per_replica": 1,
                    "tensor_parallel": 2,
                    "base_port": 18900,
                    "endpoint_port": 17900,
                    "startup_timeout_s": 60,
                    "distributed_timeout_s": 30,
                    "lead_boot_standoff_s": 0,
                    "container": {
                        "image": str(bundle),
                        # the project's Python and code at the same path inside, a private
                        # /tmp for the lanes, and the setup script's folder
                        # the tmpfs first: the project may live under /tmp (a CI clone)
                        "mounts": [
                            "tmpfs:/tmp",
                            f"{REPO}:{REPO}:ro",
                            *_python_mounts(),
                            f"{setup.parent}:/setup:ro",
                        ],
                        "setup_script": f"/setup/{setup.name}",
                        "workdir": "/tmp",
                    },
                }
            ],
        },
        source="test",
    )


def _setup_script(tmp_path: Path, body: str) -> Path:
    setup = tmp_path / "setup" / "prepare.sh"
    setup.parent.mkdir()
    setup.write_text(body)
    return setup


def _left(run: AllocationRun, job: str) -> None:
    assert not [s for s in slurm.list_steps(job) if s.name.startswith(run.run_id)]
    deadline = time.monotonic() + 10
    while (_runc_list() or processes_with_env("SLURMGATE_RUN_ID", run.run_id)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert _runc_list() == []
    assert processes_with_env("SLURMGATE_RUN_ID", run.run_id) == []


def test_lanes_serve_from_an_oci_bundle_in_their_own_mount_namespace(
    tmp_path: Path, runs_root: Path, held_allocation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = held_allocation(nodes=3, gpus=8)
    hosts = hosts_of(job)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    bundle = make_bundle(tmp_path / "bundle")
    setup = _setup_script(
        tmp_path, 'echo "setup ran on $(hostname) in $(pwd)"; touch /tmp/prepared\n'
    )
    seen: dict[int, str] = {}

    def log(line: str) -> None:
        # while the lanes serve, note each one's mount namespace beside slurmd's
        if line.startswith("readiness: ") and not seen:
            for pid in processes_with_env("SLURMGATE_RUN_ID", run.run_id):
                try:
                    seen[pid] = os.readlink(f"/proc/{pid}/ns/mnt")
                except OSError:
                    continue

    run = AllocationRun(_spec("oci", bundle, setup, ASK), runs_root=runs_root, log=log)
    run.run()
    assert run.status == "succeeded"
    step_log = next(run.run_dir.glob("*-serve-box.log")).read_text()
    # the setup script ran in each serving node's container, its output in the step's log
    ran = set(re.findall(r"setup ran on (\S+) in /tmp", step_log))
    assert ran == set(hosts[1:]), step_log[-3000:]
    # the lanes' logs, written in the containers, were collected from the nodes
    collected = sorted((run.run_dir / "outputs").glob("*/logs/*.log"))
    assert {p.parent.parent.name for p in collected} == set(hosts[1:]), collected
    client_log = sorted(run.run_dir.glob("*-client.log"))[-1].read_text()
    assert "client: 3 completions through" in client_log
    # the serve step's srun named the run's bundle, whose rootfs is the image's
    made = json.loads((run.run_dir / "oci" / "box" / "config.json").read_text())
    # its rootfs binds the image's top level, read-only as the image's root is
    assert made["root"] == {"path": "rootfs", "readonly": True}
    binds = [m for m in made["mounts"] if m["type"] == "bind"]
    first_usr = next(m for m in binds if m["destination"] == "/usr")
    assert first_usr["source"] == str(bundle / "rootfs" / "usr")
    assert "ro" in first_usr["options"]
    binds = {m["destination"]: m for m in binds}
    assert binds["/slurmgate/slurmgate"]["options"] == ["rbind", "ro"]
    assert {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": []} in made[
        "mounts"
    ]
    slurmd_ns = {
        os.readlink(f"/proc/{pid}/ns/mnt")
        for pid in map(int, subprocess.run(["pgrep", "-x", "slurmd"], capture_output=True,
                                           text=True, check=False).stdout.split())
    }  # fmt: skip
    assert slurmd_ns and seen
    inside = {ns for ns in seen.values()} - slurmd_ns
    assert inside, (seen, slurmd_ns)
    _left(run, job)


def test_a_failing_setup_script_fails_the_run_naming_the_node(
    tmp_path: Path, runs_root: Path, held_allocation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = held_allocation(nodes=3, gpus=8)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    bundle = make_bundle(tmp_path / "bundle")
    setup = _setup_script(tmp_path, "echo 'no wheel for this image' >&2; exit 3\n")
    run = AllocationRun(_spec("oci-bad", bundle, setup, ASK), runs_root=runs_root)
    with pytest.raises(RunFailed) as info:
        run.run()
    message = str(info.value)
    assert "setup-script" in message and "exited with status 3" in message, message[-2000:]
    step_log = next(run.run_dir.glob("*-serve-box.log")).read_text()
    assert "no wheel for this image" in step_log
    _left(run, job)

"""Several Slurm clusters per controller, on the real thing: the bundled cluster is the
controller's own (pool a), a second bundled cluster runs beside it with its own state
directory, ports, munge and node names (pool b, `slurm_conf`), and a third cluster's
slurmrestd does not exist (pool c). Each pool's capacity comes from its own cluster, and the
unreachable one fails open alone: its pool counts runners only, with one warning naming it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmgate.admission.tick import reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.testbed.emulator.testing import running_emulator

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "slurm-local"
# The second cluster: 2 nodes in uts mode (no network namespaces), nothing shared with the
# first (scripts/slurm-local/start.sh's knobs).
SECOND = {
    "SLURM_LOCAL_DIR": "/tmp/slurmgate-second-cluster",
    "SLURM_LOCAL_NET_TAG": "sgsecond",
    "SLURM_LOCAL_NODES": "2",
    "SLURM_LOCAL_NODE_PREFIX": "bnode",
    "SLURM_LOCAL_CLUSTER": "second",
    "SLURM_LOCAL_MODE": "uts",
    "SLURM_LOCAL_CTLD_PORT": "16917",
    "SLURM_LOCAL_SLURMD_PORT_BASE": "17300",
    "SLURM_LOCAL_GPUS": "0",
}


class Warnings:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: object) -> None:
        return None

    def warning(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args if args else msg)


@pytest.fixture
def second_cluster(slurm_cluster: dict[str, str]) -> Iterator[str]:
    """A second bundled cluster beside the first; its slurm.conf. Stopped afterwards."""
    env = {**os.environ, **SECOND}
    env.pop("SLURM_CONF", None)
    started = subprocess.run(
        [str(SCRIPTS / "start.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    if started.returncode != 0:
        pytest.fail(f"the second cluster did not start: {started.stderr[-2000:]}")
    try:
        yield f"{SECOND['SLURM_LOCAL_DIR']}/etc/slurm.conf"
    finally:
        subprocess.run(
            [str(SCRIPTS / "stop.sh")], env=env, capture_output=True, text=True, timeout=120
        )


async def test_each_pool_reads_its_own_cluster_and_an_unreachable_one_fails_open_alone(
    second_cluster: str, tmp_path: Path
) -> None:
    conf = {**os.environ, "SLURM_CONF": second_cluster}
    drain = ["scontrol", "update", "nodename=bnode2", "state=drain", "reason=org-test"]
    subprocess.run(drain, env=conf, check=True, capture_output=True, timeout=30)
    settings = AdmissionSettings(
        PRIORITY_SCHEDULER_ENABLED=True,
        NODE_SLOT_SCHEDULER_ENABLED=True,
        orphan_grace_s=0,
        slurm_clusters={
            "second": {"slurm_conf": second_cluster},
            "gone": {"slurmrestd_url": f"unix:{tmp_path}/no-such.sock"},
        },
        pool_partitions={
            "a": "debug",
            "b": {"partition": "debug", "cluster": "second"},
            "c": {"partition": "debug", "cluster": "gone"},
        },
    )

    def labels(pool: str, nodes: int, token: str) -> list[str]:
        gate = [f"nodes:{nodes}", f"ci-job-1.000-{token}", "ci-attempt-1"]
        return ["self-hosted", f"cluster:{pool}", *gate]

    with running_emulator({"a": 4, "b": 2, "c": 2}) as emu:
        wide_a = emu.admin.add_job(labels("a", 4, "wa"), 600)["id"]
        wide_b = emu.admin.add_job(labels("b", 2, "wb"), 600)["id"]
        wide_c = emu.admin.add_job(labels("c", 2, "wc"), 600)["id"]
        log = Warnings()
        async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), emu.token) as gh:
            report = await reconcile_tick(direct_steps(gh, settings=settings), settings, log=log)
    admitted = {a.job_id for a in report.decisions.admit}
    # a: the controller's own cluster has its 4 nodes; b: the second cluster drained one of
    # its 2 nodes; c: no answer, so its 2 runners decide (fail-open, this pool alone)
    assert admitted == {wide_a, wide_c}
    [blocked] = report.decisions.blocked
    assert blocked.job_id == wide_b and blocked.reason.value == "no-free-capacity"
    assert (
        "Slurm can give 1 in partition debug now (1 node drained in partition debug: bnode2)"
        in blocked.detail
    )
    board = {row["pool"]: row["slurm"] for row in report.decisions.board_rows()}
    assert board["cluster:a"] == "4/4 nodes usable in partition debug"
    assert board["cluster:b"].startswith("1/2 nodes usable in partition debug")
    assert board["cluster:c"] == ""  # runner-only
    [warning] = log.lines  # once, though the tick read twice (after its releases: none here)
    assert warning.startswith("slurm capacity of cluster gone unread (SlurmError: `slurmrestd GET")
    assert warning.endswith("its pools (cluster:c) count runners only this tick")

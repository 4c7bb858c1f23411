"""A run's outputs on the real local Slurm cluster: every node's lane logs and the client's
results arrive in the run's directory before the release, with a planted secret masked."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from slurmgate.runtime.ledger.records import RunRecord
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.spec.allocation import AllocationSpec

from .conftest import assert_no_orphans, example_data, job_gone

pytestmark = pytest.mark.slurm

# The lane prints its token twice (as a variable, and bare) before it serves: the first is a
# credential's shape, the second only the run's own secret values can mask.
LANE = 'echo "lane starts: HF_TOKEN=$HF_TOKEN bare=$HF_TOKEN"; exec "$@"'
CLIENT = (
    "import os\n"
    "where = os.environ['SLURMGATE_RESULTS_DIR']\n"
    # the variable's name is put together here: a spec's command may not carry a credential
    "name = 'AWS_SECRET_' + 'ACCESS_KEY'\n"
    "open(os.path.join(where, 'result.txt'), 'w').write(\n"
    "    'score 0.93\\n' + name + '=' + os.environ['SG_TEST_STORAGE_KEY'] + '\\n')\n"
    "print('client wrote its results', flush=True)\n"
)


@pytest.fixture(autouse=True)
def _cluster(slurm_cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # an owned allocation
    monkeypatch.delenv("SLURM_JOBID", raising=False)


def test_logs_from_all_four_nodes_arrive_redacted_before_the_release(
    runs_root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    planted = "planted-" + secrets.token_hex(12)
    storage_key = "sg" + secrets.token_hex(18)
    monkeypatch.setenv("SG_TEST_PLANTED_TOKEN", planted)
    monkeypatch.setenv("SG_TEST_STORAGE_KEY", storage_key)
    monkeypatch.setenv("SLURMGATE_NODE_OUTPUTS_ROOT", str(tmp_path / "node-outputs"))
    data = example_data()
    # the client on a node of its own: three lane nodes and the client's, four in all
    data["client"] = {
        "command": ["python", "-c", CLIENT],
        "dedicated_node": True,
        "env": {"SG_TEST_STORAGE_KEY": {"from_env": "SG_TEST_STORAGE_KEY"}},
    }
    for deployment in data["deployments"]:
        deployment["command"] = ["sh", "-c", LANE, "lane", *deployment["command"]]
        deployment["env"] = {
            **deployment.get("env", {}),
            "HF_TOKEN": {"from_env": "SG_TEST_PLANTED_TOKEN"},
        }
    run = AllocationRun(AllocationSpec.from_data(data), runs_root=runs_root, grace_s=5)
    result = run.run()
    assert result.ok, result.error
    hosts = result.hosts
    assert len(set(hosts)) == 4, hosts

    record = RunRecord.read(run.record_path)
    by_node = {o.node: o for o in record.outputs}
    assert set(hosts) <= set(by_node), by_node
    assert all(by_node[h].status == "collected" for h in hosts), record.outputs
    assert record.outputs_dir == str(run.context.outputs_dir)
    lane_logs = sorted(run.context.outputs_dir.glob("*/logs/*.log"))
    lane_nodes = {p.parent.parent.name for p in lane_logs}
    assert lane_nodes == set(hosts) - {run.layout.client_host}, lane_logs  # type: ignore[union-attr]
    for log in lane_logs:
        text = log.read_text()
        assert "lane starts: HF_TOKEN=*** bare=***" in text, text[:2000]
        assert planted not in text
    results = (run.context.outputs_dir / "client" / "results" / "result.txt").read_text()
    assert results == "score 0.93\nAWS_SECRET_ACCESS_KEY=***\n"
    steps = list((run.context.outputs_dir / "steps").glob("*.log"))
    assert steps and all(planted not in p.read_text() for p in steps)
    # nothing of the secret anywhere under outputs/, and the nodes' own copies are gone
    for path in run.context.outputs_dir.rglob("*"):
        if path.is_file():
            data_bytes = path.read_bytes()
            assert planted.encode() not in data_bytes and storage_key.encode() not in data_bytes
    assert not (tmp_path / "node-outputs" / run.run_id).exists()
    # collected inside the allocation: the collect steps ran in the job, before the release
    actions = json.dumps(result.cleanup)
    assert actions.index("collected") < actions.index(f"scancel {result.job_id}"), actions
    assert job_gone(result.job_id)
    assert_no_orphans(run.run_id)


def test_a_run_that_collects_nothing_leaves_no_copy_on_its_nodes(
    runs_root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SLURMGATE_NODE_OUTPUTS_ROOT", str(tmp_path / "node-outputs"))
    monkeypatch.setenv("SLURMGATE_OUTPUTS_COLLECT", "0")
    run = AllocationRun(AllocationSpec.from_data(example_data()), runs_root=runs_root, grace_s=5)
    result = run.run()
    assert result.ok, result.error
    assert not run.context.outputs_dir.exists()
    # the lanes wrote their node-local logs, and the remove steps took them away
    assert (tmp_path / "node-outputs").is_dir()
    assert not (tmp_path / "node-outputs" / run.run_id).exists()
    assert job_gone(result.job_id)
    assert_no_orphans(run.run_id)

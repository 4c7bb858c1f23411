"""Mooncake's master and metadata server for real on the cluster, as a deployment's services.

A one-node deployment with `mooncake`: the run starts the real `mooncake_master` and
`mooncake_http_metadata_server` (`.venv-mooncake`) on the client node, on loopback (every lane
runs there); its lane reads MOONCAKE_MASTER and the store's JSON at MOONCAKE_CONFIG_PATH, puts
and gets a value through the store from Python, then serves as the stub engine. The client
reads the master's metrics, which count the put. Nothing is left after cleanup, and no
listener of the run's services binds every address in the node's namespace; the store
client's own two listeners (Mooncake binds them on every address, README) are the only
wildcard ones, and they are the lane's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.spec.allocation import AllocationSpec

from .conftest import REPO, assert_no_orphans, job_gone
from .listeners import ListenerWatch, kind_of, unlisted

pytestmark = pytest.mark.slurm

MOONCAKE_BIN = REPO / ".venv-mooncake" / "bin"
METRICS = 18882
WILDCARD = ("0.0.0.0", "*", "::")

# The lane: a store client as vLLM's connector sets it up (the JSON at MOONCAKE_CONFIG_PATH),
# one put and get, then the stub engine in its place (exec: the client and its listeners go).
LANE = r"""# mooncake-store-client
import json, os, sys
from mooncake.store import MooncakeDistributedStore
config = json.load(open(os.environ["MOONCAKE_CONFIG_PATH"]))
assert config["master_server_address"] == os.environ["MOONCAKE_MASTER"], config
store = MooncakeDistributedStore()
assert store.setup(config["local_hostname"], config["metadata_server"], 64 << 20, 16 << 20,
                   config["protocol"], "", config["master_server_address"]) == 0
value = b"slurmgate" * 1000
assert store.put("slurmgate-key", value) == 0 and store.get("slurmgate-key") == value
print("MOONCAKE round trip " + json.dumps(config), flush=True)
store.close()
os.execv(sys.argv[1], sys.argv[1:])
"""

CLIENT = r"""
import json, re, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:%(metrics)d/metrics", timeout=5).read().decode()
metrics = {m[1]: float(m[2]) for m in re.finditer(r"^(master_[a-z_]+) ([0-9.e+]+)$", text, re.M)}
print("RESULT " + json.dumps(metrics), flush=True)
"""


def mooncake_spec() -> AllocationSpec:
    stub = [sys.executable, "-m", "slurmgate.testbed.stub_server", "--model", "stub"]
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "kv",
            "gpus_per_node": 8,
            "time_limit": "00:03:00",
            "client": {"command": ["python", "-c", CLIENT % {"metrics": METRICS}]},
            "deployments": [
                {
                    "name": "kv",
                    "engine": "custom",
                    "command": [str(MOONCAKE_BIN / "python"), "-c", LANE, *stub],
                    "roles": {"agg": {}},
                    "mooncake": {
                        "store_config": {"protocol": "tcp"},
                        "master_command": [str(MOONCAKE_BIN / "mooncake_master")],
                        "master_args": ["-rpc_thread_num=2"],
                        "metadata_command": [str(MOONCAKE_BIN / "mooncake_http_metadata_server")],
                        "master_port": 18880,
                        "metadata_port": 18881,
                        "metrics_port": METRICS,
                    },
                    "base_port": 18870,
                    "side_base_port": 18890,
                    "endpoint_port": 17870,
                    "startup_timeout_s": 60,
                    "lead_boot_standoff_s": 0,
                    "rank_launch_stagger_s": 0,
                }
            ],
        },
        source="test",
    )


def test_a_lane_puts_and_gets_through_the_runs_mooncake(
    slurm_cluster: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not (MOONCAKE_BIN / "mooncake_master").exists():
        pytest.skip(
            "no Mooncake venv (.venv-mooncake): scripts/setup.sh with SLURMGATE_WITH_MOONCAKE=1"
        )
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    spec = mooncake_spec()
    watch = ListenerWatch()
    run = AllocationRun(spec, runs_root=tmp_path / "runs", grace_s=5)
    try:
        with watch:
            run.run()
    finally:
        assert_no_orphans(run.run_id)
    assert run.cleaned and job_gone(run.job_id)
    assert run.layout is not None
    logs = {p.name.split("-", 1)[1]: p.read_text() for p in run.run_dir.glob("[0-9][0-9]-*.log")}
    serve = logs["serve-kv.log"]
    line = next((x for x in serve.splitlines() if "MOONCAKE round trip " in x), None)
    assert line is not None, serve[-3000:]
    config: dict[str, Any] = json.loads(line.split("MOONCAKE round trip ", 1)[1])
    assert config["master_server_address"] == "127.0.0.1:18880", config
    assert config["metadata_server"] == "http://127.0.0.1:18881/metadata", config
    client = logs["client.log"]
    result = next((x for x in client.splitlines() if x.startswith("RESULT ")), None)
    assert result is not None, client[-3000:]
    metrics: dict[str, float] = json.loads(result[len("RESULT ") :])
    assert metrics["master_put_start_requests_total"] >= 1, metrics
    assert metrics["master_get_replica_list_requests_total"] >= 1, metrics
    if not watch.namespaces:
        pytest.skip("listeners: the bundled cluster runs without a namespace per node")
    # the store client's own listeners (every address, Mooncake's choice) are the lane's
    store_client = [x for x in watch.new if "mooncake-store-client" in x.process]
    assert all(x.address in WILDCARD for x in store_client), store_client
    services = [x for x in watch.new if x not in store_client]
    assert not [x for x in services if x.address in WILDCARD], services
    kinds = {kind_of(spec, run.layout, x) for x in services}
    assert {"mooncake-master", "mooncake-metrics", "mooncake-metadata", "lane"} <= kinds, kinds
    problems = [p for p in unlisted(watch, spec, run.layout) if "mooncake-store-client" not in p]
    assert not problems, "\n".join(problems)

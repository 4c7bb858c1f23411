"""Mooncake's master and metadata server as a deployment's service lanes, and what workers get.

The rendering (argv, the workers' variables and JSON, the refusal across hosts) is checked as
the runtime renders it; then the real `mooncake_master` and `mooncake_http_metadata_server`
(the `.venv-mooncake` that scripts/setup.sh builds) run with that argv on this machine, a
store client puts and gets through them from Python, the master's metrics count it, and
neither service listens on any address but the one it was given. No Slurm.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from slurmgate.runtime.engines import layout, mooncake, service_lanes
from slurmgate.runtime.engines.roles import LANE_DIR
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError
from slurmgate.runtime.spec.mooncake import MooncakeSpec
from slurmgate.testbed.localproc import free_port, stop_group

from .conftest import assert_no_orphans

REPO = Path(__file__).resolve().parents[2]
MOONCAKE_BIN = REPO / ".venv-mooncake" / "bin"
HOST = "127.0.0.1"


def _spec(gpus: int, mooncake_data: dict[str, Any]) -> AllocationSpec:
    return AllocationSpec.from_data(
        {
            "name": "a",
            "client": {"command": ["true"]},
            "gpus_per_node": 4,
            "deployments": [
                {
                    "name": "kv",
                    "engine": "vllm",
                    "command": ["vllm", "serve", "/model"],
                    "roles": {"agg": {"tensor_parallel": gpus}},
                    "mooncake": mooncake_data,
                }
            ],
        }
    )


def _bound(spec: AllocationSpec, addresses: list[str]) -> layout.Layout:
    plan = layout.plan(spec)
    hosts = [f"n{i}" for i in range(plan.total_nodes)]
    return layout.bind(plan, hosts, dict(zip(hosts, addresses, strict=True)))


def test_one_node_store_listens_on_loopback_and_workers_get_its_json() -> None:
    spec = _spec(4, {"store_config": {"protocol": "tcp", "global_segment_size": "1GB"}})
    lay = _bound(spec, ["10.0.0.1"])
    (d,) = lay.plan.deployments
    launches = service_lanes.service_launches(spec.deployments[0], lay, d)
    names = [s.plan.name for s in launches]
    assert names == ["mooncake-master", "mooncake-metadata"]
    master, metadata = (s.argv for s in launches)
    assert master[0] == "mooncake_master"
    assert "-rpc_address=127.0.0.1" in master and "-rpc_port=8700" in master
    assert "-metrics_host=127.0.0.1" in master and "-metrics_port=8702" in master
    assert "-enable_http_metadata_server=false" in master
    assert metadata == ["mooncake_http_metadata_server", "--host", "127.0.0.1", "--port", "8701"]
    assert launches[0].plan.ports == (8700, 8702) and launches[1].plan.ports == (8701,)
    env, files = service_lanes.mooncake_lane(spec.deployments[0], lay, d, "10.0.0.1")
    assert env == {
        "MOONCAKE_MASTER": "127.0.0.1:8700",
        "MOONCAKE_TE_META_DATA_SERVER": "http://127.0.0.1:8701/metadata",
        "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.1",
        "MOONCAKE_CONFIG_PATH": f"{LANE_DIR}/mooncake.json",
    }
    assert json.loads(files["mooncake.json"]) == {
        "global_segment_size": "1GB",
        "local_hostname": "10.0.0.1",
        "master_server_address": "127.0.0.1:8700",
        "metadata_server": "http://127.0.0.1:8701/metadata",
        "protocol": "tcp",
    }


def test_across_hosts_is_refused_unless_the_spec_accepts_it() -> None:
    with pytest.raises(SpecError, match=r"deployments\[0\]\.mooncake\.across_hosts"):
        _spec(8, {})
    spec = _spec(8, {"across_hosts": True, "store_config": {"metadata_server": "P2PHANDSHAKE"}})
    lay = _bound(spec, ["10.0.0.1", "10.0.0.2"])
    (d,) = lay.plan.deployments
    master, metadata = (s.argv for s in service_lanes.service_launches(spec.deployments[0], lay, d))
    assert "-rpc_address=10.0.0.1" in master and "-metrics_host=127.0.0.1" in master
    assert metadata[metadata.index("--host") + 1] == "10.0.0.1"
    env, files = service_lanes.mooncake_lane(spec.deployments[0], lay, d, "10.0.0.2")
    assert env["MOONCAKE_MASTER"] == "10.0.0.1:8700"
    config = json.loads(files["mooncake.json"])
    # the recipe's P2PHANDSHAKE is kept; the master is always the run's
    assert config["metadata_server"] == "P2PHANDSHAKE"
    assert config["master_server_address"] == "10.0.0.1:8700"
    assert config["local_hostname"] == "10.0.0.2"


def test_the_master_address_and_a_clashing_port_are_named_errors() -> None:
    with pytest.raises(ValueError, match=r"mooncake\.store_config.*master_server_address"):
        MooncakeSpec.model_validate({"store_config": {"master_server_address": "h:1"}})
    with pytest.raises(SpecError, match=r"deployments\[0\]\.mooncake\.mooncake-metadata"):
        _spec(4, {"metadata_port": 8700})


def _listening(pid: int) -> set[tuple[str, int]]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        if f"pid={pid}," in line:
            address, _, port = line.split()[3].rpartition(":")
            found.add((address.strip("[]"), int(port)))
    return found


def _metrics(port: int) -> dict[str, float]:
    text = httpx.get(f"http://{HOST}:{port}/metrics", timeout=5).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(master_[a-z_]+) ([0-9.e+]+)$", text, re.M)}


PUT_GET = """
import sys
from mooncake.store import MooncakeDistributedStore
local, metadata, master = sys.argv[1:4]
store = MooncakeDistributedStore()
assert store.setup(local, metadata, 64 << 20, 16 << 20, "tcp", "", master) == 0
value = b"slurmgate" * 1000
assert store.put("slurmgate-key", value) == 0
assert store.get("slurmgate-key") == value
print("round trip", flush=True)
sys.stdin.read()  # hold the store (and its segment) until the test has read the metrics
store.close()
"""


@pytest.mark.skipif(
    not (MOONCAKE_BIN / "mooncake_master").exists(),
    reason="Mooncake is not installed: SLURMGATE_WITH_MOONCAKE=1 scripts/setup.sh makes "
    ".venv-mooncake (scripts/test.sh does)",
)
def test_real_master_serves_a_put_and_get_on_its_own_address(tmp_path: Path) -> None:
    ports = mooncake.ports(free_port(), free_port(), free_port())
    master_argv = mooncake.master_argv(
        [str(MOONCAKE_BIN / "mooncake_master")], HOST, ports, ["-rpc_thread_num=2"]
    )
    metadata_argv = mooncake.metadata_argv(
        [str(MOONCAKE_BIN / "mooncake_http_metadata_server")], HOST, ports
    )
    procs: list[subprocess.Popen[Any]] = []
    try:
        for argv, name in ((master_argv, "master"), (metadata_argv, "metadata")):
            log = (tmp_path / f"{name}.log").open("w")
            procs.append(subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True))
        deadline = time.monotonic() + 30
        health = f"http://{HOST}:{ports['mooncake_metrics']}/health"
        while True:
            try:
                if mooncake.master_ready(httpx.get(health, timeout=1).json()):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "master.log").read_text()[-2000:]
            time.sleep(0.1)
        before = _metrics(ports["mooncake_metrics"])
        client = subprocess.Popen(
            [
                str(MOONCAKE_BIN / "python"),
                "-c",
                PUT_GET,
                HOST,
                mooncake.metadata_url(HOST, ports),
                mooncake.master_url(HOST, ports),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "client.log").open("w"),
            text=True,
            start_new_session=True,
        )
        procs.append(client)
        assert client.stdout is not None
        line = client.stdout.readline()
        assert line == "round trip\n", (tmp_path / "client.log").read_text()[-2000:]
        after = _metrics(ports["mooncake_metrics"])
        assert (
            after["master_put_start_requests_total"]
            == before["master_put_start_requests_total"] + 1
        )
        assert after["master_key_count"] == before["master_key_count"] + 1
        assert after["master_active_clients"] == 1
        assert after["master_allocated_bytes"] >= 9000
        # the master and the metadata server listen only where they were told
        master_ports = _listening(procs[0].pid)
        assert master_ports == {
            (HOST, ports["mooncake_master"]),
            (HOST, ports["mooncake_metrics"]),
        }
        assert _listening(procs[1].pid) == {(HOST, ports["mooncake_metadata"])}
        client.communicate("", timeout=30)
        assert client.returncode == 0
    finally:
        for proc in procs:
            stop_group(proc)
    assert_no_orphans(f"-rpc_port={ports['mooncake_master']}")
    assert_no_orphans(f"--port {ports['mooncake_metadata']}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

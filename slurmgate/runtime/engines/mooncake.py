"""Mooncake's store services beside the workers: the master's and metadata server's argv, the JSON.

A deployment with `mooncake` (srt-slurm's `backend.mooncake_kv_store`) gets two service lanes
on the client node, started before its workers: `mooncake_master` (the store's master: RPC
port, and its metrics and /health on loopback) with its built-in HTTP metadata server off, and
Mooncake's own `mooncake_http_metadata_server`, which honours `--host` where the master's
built-in one binds 0.0.0.0 whatever its host flag says (mooncake-transfer-engine 0.3.13.post1,
measured). Every worker lane then gets what srt-slurm gives a vLLM worker: MOONCAKE_MASTER,
MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_LOCAL_HOSTNAME and MOONCAKE_CONFIG_PATH, a JSON file in
the lane's private directory (the recipe's store_config, the master's address forced). Neither
listener authenticates its clients: Mooncake has no such option. Pure; standard library only.

Sources: https://kvcache-ai.github.io/Mooncake/ (master flags, `/metrics`, `/health`); srt-slurm
`backends/vllm.py` (`get_mooncake_worker_env`, `build_mooncake_store_config`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from slurmgate.runtime.engines.roles import LANE_DIR

MASTER = "mooncake-master"
METADATA = "mooncake-metadata"
SERVICES = (MASTER, METADATA)
MASTER_COMMAND = ("mooncake_master",)
METADATA_COMMAND = ("mooncake_http_metadata_server",)
CONFIG_FILE = "mooncake.json"
LOOPBACK = "127.0.0.1"
# The port each service is probed on (a key of `ports`) and the path: the master's /health
# answers on its metrics listener, which stays on loopback; the metadata server has no health
# path (its one route answers 400 without a key, 404 for an unknown one), so its lane counts
# as up when the master does and its process is alive (the supervisor's fail-fast).
READINESS = {MASTER: ("mooncake_metrics", "/health")}


def ports(master_port: int, metadata_port: int, metrics_port: int) -> dict[str, int]:
    return {
        "mooncake_master": master_port,
        "mooncake_metadata": metadata_port,
        "mooncake_metrics": metrics_port,
    }


OWNED = {MASTER: ("mooncake_master", "mooncake_metrics"), METADATA: ("mooncake_metadata",)}
"""The ports each service lane opens, as keys of `ports`."""


def master_url(host: str, p: Mapping[str, int]) -> str:
    return f"{host}:{p['mooncake_master']}"


def metadata_url(host: str, p: Mapping[str, int]) -> str:
    return f"http://{host}:{p['mooncake_metadata']}/metadata"


def master_argv(
    command: Sequence[str], bind_host: str, p: Mapping[str, int], args: Sequence[str] = ()
) -> list[str]:
    """The master on `bind_host`, its metrics and /health on loopback, its built-in metadata
    server off (that one binds every address), then the spec's own flags."""
    return [
        *command,
        f"-rpc_address={bind_host}",
        f"-rpc_port={p['mooncake_master']}",
        f"-metrics_host={LOOPBACK}",
        f"-metrics_port={p['mooncake_metrics']}",
        "-enable_metric_reporting=true",
        "-enable_http_metadata_server=false",
        *args,
    ]


def metadata_argv(command: Sequence[str], bind_host: str, p: Mapping[str, int]) -> list[str]:
    return [*command, "--host", bind_host, "--port", str(p["mooncake_metadata"])]


def store_config(
    config: Mapping[str, Any], services_host: str, p: Mapping[str, int], local_host: str
) -> str:
    """The JSON vLLM's MooncakeStoreConnector reads (`MooncakeStoreConfig.load_from_env`): the
    spec's keys as given, the master's address forced (as srt-slurm does), the metadata server
    and the lane's own address unless the spec names them (P2PHANDSHAKE keeps the workers'
    handshake peer to peer)."""
    out: dict[str, Any] = {
        "local_hostname": local_host,
        "metadata_server": metadata_url(services_host, p),
        **config,
        "master_server_address": master_url(services_host, p),
    }
    return json.dumps(out, indent=1, sort_keys=True)


def worker_env(services_host: str, p: Mapping[str, int], local_host: str) -> dict[str, str]:
    """A worker lane's variables: where the master and metadata server are, its own address,
    and its config file (a path under LANE_DIR, which the node worker fills in)."""
    return {
        "MOONCAKE_MASTER": master_url(services_host, p),
        "MOONCAKE_TE_META_DATA_SERVER": metadata_url(services_host, p),
        "MOONCAKE_LOCAL_HOSTNAME": local_host,
        "MOONCAKE_CONFIG_PATH": f"{LANE_DIR}/{CONFIG_FILE}",
    }


def master_ready(body: Any) -> bool:
    """The master's /health: {"status": "ok", "service_ready": true}."""
    return isinstance(body, dict) and body.get("service_ready") is True

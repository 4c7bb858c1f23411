"""The field's own routers and frontends, and the services they need: argv and readiness rules.

A deployment may name a frontend (`DeploymentSpec.frontend`) that the runtime starts on the
client node in front of its workers, like any lane: Dynamo's frontend (with the etcd and NATS
it needs, as service lanes of their own), sglang-router or vllm-router in PD mode, or
`trtllm-serve disaggregated`. Everything here is pure: what each one runs (given the workers'
URLs), which ports it opens and when it counts as ready (a rule over the JSON it answers).
Standard library only.

Sources:
- Dynamo: https://docs.nvidia.com/dynamo/latest/ (`python -m dynamo.frontend --http-port`,
  `ETCD_ENDPOINTS`, `NATS_SERVER`, `DYN_REQUEST_PLANE`); its `/health` lists `instances`
  (srt-slurm `core/health.py`: entries with endpoint `generate`, component `prefill` for
  prefill, `backend`/`decode`/`tensorrt_llm` for decode).
- sglang-router: https://docs.sglang.ai/advanced_features/router.html (`--pd-disaggregation`,
  `--prefill URL BOOTSTRAP_PORT`, `--decode URL`, `--worker-urls`); `GET /workers` answers
  `stats.{prefill_count, decode_count, regular_count}` (sglang-router 0.3.2, measured).
- vllm-router: https://github.com/vllm-project/router (`--vllm-pd-disaggregation`, `--prefill`,
  `--decode`, `--worker-urls`), same `/workers` stats shape.
- trtllm-serve disaggregated: https://nvidia.github.io/TensorRT-LLM/features/disagg-serving.html
  (`trtllm-serve disaggregated -c CONFIG`, `context_servers` and `generation_servers` URLs).
- etcd: https://etcd.io/docs/v3.5/op-guide/configuration/ (`GET /health` answers
  `{"health":"true"}`); NATS: https://docs.nats.io/running-a-nats-service/nats_admin/monitoring
  (`-m PORT`, `GET /healthz`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from slurmgate.runtime.engines.roles import LANE_DIR

FrontendName = Literal["dynamo", "sglang-router", "vllm-router", "trtllm-serve"]
RequestPlane = Literal["tcp", "nats", "http"]
DiscoveryName = Literal["etcd", "file"]

# Dynamo's /health components that count for each role (srt-slurm core/health.py).
DYNAMO_COMPONENTS = {"prefill": ("prefill",), "decode": ("decode", "backend", "tensorrt_llm")}


@dataclass(frozen=True)
class FrontendProfile:
    """One frontend: its default command, the engines it fronts, and its readiness path."""

    name: FrontendName
    summary: str
    docs: tuple[str, ...]
    command: tuple[str, ...]
    engines: tuple[str, ...]
    readiness_path: str
    pd_only: bool = False  # it fronts prefill and decode workers only (no agg)
    services: tuple[str, ...] = ()  # the service lanes it needs, started before it


FRONTENDS: dict[str, FrontendProfile] = {
    p.name: p
    for p in (
        FrontendProfile(
            name="dynamo",
            summary="Dynamo's OpenAI frontend, which finds its workers in etcd",
            docs=("https://docs.nvidia.com/dynamo/latest/",),
            command=("python3", "-m", "dynamo.frontend"),
            engines=("dynamo-sglang", "dynamo-vllm", "dynamo-trtllm"),
            readiness_path="/health",
            services=("etcd", "nats"),
        ),
        FrontendProfile(
            name="sglang-router",
            summary="SGLang's router (sglang-router), in PD mode for prefill and decode",
            docs=("https://docs.sglang.ai/advanced_features/router.html",),
            command=("python3", "-m", "sglang_router.launch_router"),
            engines=("sglang", "custom"),
            readiness_path="/workers",
        ),
        FrontendProfile(
            name="vllm-router",
            summary="vLLM's router (vllm-router), in PD mode for prefill and decode",
            docs=("https://github.com/vllm-project/router",),
            command=("vllm-router",),
            engines=("vllm", "custom"),
            readiness_path="/workers",
        ),
        FrontendProfile(
            name="trtllm-serve",
            summary="TensorRT-LLM's disaggregated server (`trtllm-serve disaggregated`)",
            docs=("https://nvidia.github.io/TensorRT-LLM/features/disagg-serving.html",),
            command=("trtllm-serve", "disaggregated"),
            engines=("trtllm",),
            readiness_path="/health",
            pd_only=True,
        ),
    )
}


@dataclass(frozen=True)
class Workers:
    """What a frontend is told of the workers: URLs per role, and prefill bootstrap ports."""

    prefill: tuple[tuple[str, int | None], ...] = ()
    decode: tuple[str, ...] = ()
    agg: tuple[str, ...] = ()


def frontend_argv(
    name: str,
    command: Sequence[str],
    args: Sequence[str],
    bind_host: str,
    port: int,
    workers: Workers,
) -> list[str]:
    """The frontend's argv: its command, the workers it routes to, where it listens, its args."""
    argv = list(command)
    if name == "dynamo":
        # Dynamo finds the workers itself (etcd); srt-slurm passes only the port, and the
        # frontend then listens on every address: it gets the node's.
        argv += ["--http-host", bind_host, "--http-port", str(port)]
    elif name == "sglang-router":
        if workers.agg:
            argv += ["--worker-urls", *workers.agg]
        else:
            argv.append("--pd-disaggregation")
            for url, bootstrap in workers.prefill:
                argv += ["--prefill", url, *([str(bootstrap)] if bootstrap is not None else [])]
            for url in workers.decode:
                argv += ["--decode", url]
        argv += ["--host", bind_host, "--port", str(port)]
        # Its Prometheus server listens on 0.0.0.0:29000 unless told, without auth; nothing of
        # the run scrapes it, so it listens on loopback, beside the router's port.
        argv += ["--prometheus-host", LOOPBACK, "--prometheus-port", str(port + 1)]
    elif name == "vllm-router":
        if workers.agg:
            argv += ["--worker-urls", *workers.agg]
        else:
            argv.append("--vllm-pd-disaggregation")
            for url, _ in workers.prefill:
                argv += ["--prefill", url]
            for url in workers.decode:
                argv += ["--decode", url]
        argv += ["--host", bind_host, "--port", str(port)]
    elif name == "trtllm-serve":
        argv += ["-c", f"{LANE_DIR}/{TRTLLM_DISAGG_FILE}"]
    else:
        raise ValueError(f"unknown frontend {name!r}")
    return [*argv, *args]


TRTLLM_DISAGG_FILE = "disagg.yaml"


def frontend_ports(name: str, port: int) -> tuple[int, ...]:
    """Every port the frontend opens: its HTTP port, and beside it sglang-router's metrics or
    Dynamo's response-stream server (`DYN_TCP_RESPONSE_STREAM_PORT`), where workers stream
    their answers back."""
    return (port, port + 1) if name in ("sglang-router", "dynamo") else (port,)


def trtllm_disagg_config(bind_host: str, port: int, workers: Workers) -> str:
    """`trtllm-serve disaggregated`'s config: where it listens and its two server lists."""

    def hostport(url: str) -> str:
        return url.removeprefix("http://")

    config = {
        "hostname": bind_host,
        "port": port,
        "backend": "pytorch",
        "context_servers": {
            "num_instances": len(workers.prefill),
            "urls": [hostport(url) for url, _ in workers.prefill],
        },
        "generation_servers": {
            "num_instances": len(workers.decode),
            "urls": [hostport(url) for url in workers.decode],
        },
    }
    return json.dumps(config, indent=1)


def frontend_files(name: str, bind_host: str, port: int, workers: Workers) -> dict[str, str]:
    """Files the frontend reads, by name under LANE_DIR."""
    if name == "trtllm-serve":
        return {TRTLLM_DISAGG_FILE: trtllm_disagg_config(bind_host, port, workers)}
    return {}


def frontend_env(
    name: str,
    services_host: str,
    ports: Mapping[str, int],
    plane: str,
    *,
    tls: bool = False,
    discovery: str = "etcd",
) -> dict[str, str]:
    """What the frontend (and, for Dynamo, every worker) needs to find the services: their
    URLs only, never a secret (with `tls`, each lane's `client_auth_env` names its files).

    Dynamo's event plane is the NATS lane: with ZMQ in direct mode every worker's publishers
    would bind 0.0.0.0 (docs/dynamo-mocker.md). Dynamo 1.6.1 speaks TLS to NATS only when the
    URL's scheme is `tls://` (it refuses NATS_TLS_* with `nats://`)."""
    if name != "dynamo":
        return {}
    scheme = "https" if tls else "http"
    found = (
        {"DYN_DISCOVERY_BACKEND": "file"}  # DYN_FILE_KV: the run's directory, `run.discovery`
        if discovery == "file"
        else {"ETCD_ENDPOINTS": f"{scheme}://{services_host}:{ports['etcd']}"}
    )
    return {
        **found,
        "NATS_SERVER": f"{'tls' if tls else 'nats'}://{services_host}:{ports['nats']}",
        "DYN_REQUEST_PLANE": plane,
        "DYN_EVENT_PLANE": "nats",
    }


# Every service lane binds loopback when the deployment runs on the client host alone; else
# etcd and NATS listen on the node's address and admit only clients holding a certificate of
# the run's own CA (mutual TLS), which each lane reads from these files under LANE_DIR.
LOOPBACK = "127.0.0.1"
CA_FILE = "service-ca.pem"
SERVER_CERT_FILE = "service-server.pem"
SERVER_KEY_FILE = "service-server.key"
CLIENT_CERT_FILE = "service-client.pem"
CLIENT_KEY_FILE = "service-client.key"
NATS_CONFIG_FILE = "nats.conf"


@dataclass(frozen=True)
class ServicePems:
    """A run's TLS material for etcd and NATS, PEM text: its CA, the servers', a client's."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def server_files(self) -> dict[str, str]:
        return {
            CA_FILE: self.ca_cert,
            SERVER_CERT_FILE: self.server_cert,
            SERVER_KEY_FILE: self.server_key,
        }

    def client_files(self) -> dict[str, str]:
        return {
            CA_FILE: self.ca_cert,
            CLIENT_CERT_FILE: self.client_cert,
            CLIENT_KEY_FILE: self.client_key,
        }


def client_auth_env() -> dict[str, str]:
    """Where a Dynamo lane's NATS client finds the run's client certificate: paths under
    LANE_DIR, which the node worker fills in (the keys stay in the lane's 0600 files)."""
    ca, cert, key = (f"{LANE_DIR}/{n}" for n in (CA_FILE, CLIENT_CERT_FILE, CLIENT_KEY_FILE))
    return {
        "NATS_TLS_CA_CERT_PATH": ca,
        "NATS_TLS_CLIENT_CERT_PATH": cert,
        "NATS_TLS_CLIENT_KEY_PATH": key,
    }


def client_auth_env_files() -> dict[str, str]:
    """The variables a Dynamo lane's etcd client reads its certificate from, each to the file
    of the lane's directory that holds its text: Dynamo 1.6.1 reads ETCD_AUTH_CA,
    ETCD_AUTH_CLIENT_CERT and ETCD_AUTH_CLIENT_KEY as PEM text, not paths
    (`Certificate::from_pem(env)`; given paths it never connects), and has no file option.
    The node worker starts the lane through `lane_launcher`, which reads the files and sets the
    variables inside the lane's own process before it runs Dynamo's module: the key is in that
    process's memory, never in exec's environment (/proc/PID/environ), argv, the step's
    environment, a spec or a record."""
    return {
        "ETCD_AUTH_CA": CA_FILE,
        "ETCD_AUTH_CLIENT_CERT": CLIENT_CERT_FILE,
        "ETCD_AUTH_CLIENT_KEY": CLIENT_KEY_FILE,
    }


def service_argv(
    name: str,
    command: Sequence[str],
    bind_host: str,
    ports: Mapping[str, int],
    *,
    tls: bool = False,
) -> list[str]:
    """etcd or NATS as srt-slurm's head node runs them, listening on `bind_host` (loopback, or
    the node's address with `tls`), with their data under the lane's own directory.

    etcd's peer listener serves a cluster of one: it stays on loopback. With `tls` its client
    listener asks every client for a certificate of the run's CA, and its /health answers on
    loopback (same port number) for the readiness probe, which runs on this node. NATS reads
    its listeners from its config file (`nats_config`; its monitor on loopback) and, with
    `tls`, verifies every client's certificate against the run's CA.
    """
    argv = list(command)
    if name == "etcd":
        scheme = "https" if tls else "http"
        client = f"{scheme}://{bind_host}:{ports['etcd']}"
        peer = f"http://{LOOPBACK}:{ports['etcd_peer']}"
        argv += [
            "--name",
            "slurmgate",
            "--data-dir",
            f"{LANE_DIR}/etcd",
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"slurmgate={peer}",
        ]
        if tls:
            argv += [
                "--client-cert-auth",
                "--trusted-ca-file",
                f"{LANE_DIR}/{CA_FILE}",
                "--cert-file",
                f"{LANE_DIR}/{SERVER_CERT_FILE}",
                "--key-file",
                f"{LANE_DIR}/{SERVER_KEY_FILE}",
                "--listen-metrics-urls",
                f"http://{LOOPBACK}:{ports['etcd']}",
            ]
        return argv
    if name == "nats":
        argv += ["-c", f"{LANE_DIR}/{NATS_CONFIG_FILE}", "-js", "-sd", f"{LANE_DIR}/nats"]
        if tls:
            argv += [
                "--tlsverify",
                "--tlscert",
                f"{LANE_DIR}/{SERVER_CERT_FILE}",
                "--tlskey",
                f"{LANE_DIR}/{SERVER_KEY_FILE}",
                "--tlscacert",
                f"{LANE_DIR}/{CA_FILE}",
            ]
        return argv
    raise ValueError(f"unknown service {name!r}")


def nats_config(bind_host: str, ports: Mapping[str, int]) -> str:
    """nats-server's config: its client listener, and its monitor on loopback (no flag of
    nats-server's sets the monitor's host apart from the client listener's)."""
    monitor = f"{LOOPBACK}:{ports['nats_monitor']}"
    lines = [
        f"host: {json.dumps(bind_host)}",
        f"port: {ports['nats']}",
        f"http: {json.dumps(monitor)}",
    ]
    return "\n".join(lines) + "\n"


def service_files(
    name: str, bind_host: str, ports: Mapping[str, int], pems: ServicePems | None
) -> dict[str, str]:
    """Files a service lane reads under LANE_DIR: NATS's config, and with TLS (`pems`) the CA
    and the server's certificate and key."""
    files = pems.server_files() if pems is not None else {}
    if name == "nats":
        files[NATS_CONFIG_FILE] = nats_config(bind_host, ports)
    return files


SERVICE_READINESS = {"etcd": ("etcd", "/health"), "nats": ("nats_monitor", "/healthz")}
"""Per service: the port it is probed on (a key of the service ports) and the path; NATS's
monitor always, and etcd's /health with TLS, answer on loopback (`service_probe_host`)."""


def service_probe_host(name: str, bind_host: str) -> str:
    """Where a service's readiness is asked, from its own node: the frontend on its address,
    etcd and NATS on loopback (their plain-HTTP health listeners bind only there)."""
    return bind_host if name == "frontend" else LOOPBACK


def service_ready(name: str, status: int, body: Any) -> bool:
    """etcd answers {"health": "true"}; NATS's monitor answers /healthz with 200."""
    if status != 200:
        return False
    if name == "etcd":
        return isinstance(body, dict) and body.get("health") in ("true", True)
    return True


def ready_counts(name: str, body: Any) -> dict[str, int]:
    """Workers a frontend's readiness answer lists, per role (prefill, decode, agg)."""
    counts = {"prefill": 0, "decode": 0, "agg": 0}
    if not isinstance(body, dict):
        return counts
    if name == "dynamo":
        for instance in body.get("instances") or []:
            if not isinstance(instance, dict) or instance.get("endpoint") != "generate":
                continue
            component = instance.get("component")
            for role, names in DYNAMO_COMPONENTS.items():
                if component in names:
                    counts[role] += 1
        counts["agg"] = counts["decode"]
        return counts
    stats = body.get("stats")
    if isinstance(stats, dict):
        counts["prefill"] = _count(stats.get("prefill_count"))
        counts["decode"] = _count(stats.get("decode_count")) + _count(stats.get("regular_count"))
        counts["agg"] = _count(stats.get("regular_count"))
    return counts


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def frontend_ready(name: str, status: int, body: Any, expected: Mapping[str, int]) -> bool:
    """Ready when the answer is 200 and lists at least the expected workers of each role
    (trtllm-serve disaggregated: 200 alone, as srt-slurm checks it)."""
    if status != 200:
        return False
    if name == "trtllm-serve":
        return True
    counts = ready_counts(name, body)
    return all(counts[role] >= n for role, n in expected.items())

"""Dynamo's mocker engine and its frontend on one bind address: their argv and env, pure.

Dynamo's mocker (`python -m dynamo.mocker`) is a real Dynamo worker whose engine is simulated:
it registers in discovery, serves the frontend over the TCP request plane and answers with
random tokens, on a CPU and without weights, so a deployment's Dynamo wiring runs without a
GPU. Measured with ai-dynamo 1.6.1 (docs/dynamo-mocker.md), every listener a Dynamo process
opens, and what sets its host and port:

- frontend: its HTTP port (`--http-host`, `--http-port`), and its response-stream server, to
  which workers stream answers (DYN_TCP_RESPONSE_STREAM_HOST, DYN_TCP_RESPONSE_STREAM_PORT;
  without a host it binds the machine's outside address, without a port an OS-assigned one).
- worker: its system server, /health, /live, /metrics and the model files the frontend fetches
  (DYN_SYSTEM_HOST, default 0.0.0.0; DYN_SYSTEM_PORT, off when unset, and read as a signed
  16-bit number: a port above 32767 stops the worker at start), and its TCP request-plane
  server (DYN_TCP_RPC_HOST, default the outside address; DYN_TCP_RPC_PORT, default OS-assigned).
- worker, event plane in ZMQ's direct mode: one PUB socket per topic (three for a prefill or a
  decode mocker, four for agg) bound to 0.0.0.0 on an OS-assigned port; no variable moves the
  bind, DYN_EVENT_PLANE_HOST only sets the address advertised in discovery. In broker mode
  (DYN_ZMQ_BROKER_URL) publishers and subscribers connect to a broker's XSUB and XPUB sockets
  instead and no Dynamo process listens for the event plane: `ZmqBroker` here.

Without etcd or NATS, discovery is a directory (DYN_DISCOVERY_BACKEND=file, DYN_FILE_KV);
with etcd, ETCD_ENDPOINTS. Entries are removed on a graceful stop; a killed worker's stay until
they expire (about 13 s in a directory, etcd's 30 s lease). Sources:
https://docs.nvidia.com/dynamo/ (request plane, event plane, health checks) and ai-dynamo 1.6.1
on PyPI.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from slurmgate.errors import InputError

MockerRole = Literal["prefill", "decode", "agg"]
MOCKER_ROLES: tuple[MockerRole, ...] = ("prefill", "decode", "agg")
MOCKER_MODULE = "dynamo.mocker"
FRONTEND_MODULE = "dynamo.frontend"


@dataclass(frozen=True)
class FileDiscovery:
    """Discovery in a directory every process of the deployment can read and write."""

    root: str


@dataclass(frozen=True)
class EtcdDiscovery:
    """Discovery in etcd: its client URLs (`http://host:port`)."""

    endpoints: tuple[str, ...]


Discovery = FileDiscovery | EtcdDiscovery


@dataclass(frozen=True)
class ZmqBroker:
    """An event-plane broker's sockets: publishers connect to `xsub`, subscribers to `xpub`
    (`tcp://host:port` each)."""

    xsub: str
    xpub: str


@dataclass(frozen=True)
class MockerOptions:
    """The mocker's simulation knobs; None leaves Dynamo's default."""

    max_num_seqs: int | None = None
    speedup_ratio: float | None = None  # 0 removes the simulated delays
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    startup_time: float | None = None  # seconds before it registers
    data_parallel_size: int | None = None


@dataclass(frozen=True)
class Launch:
    """One Dynamo process: its argv and the environment it needs on top of the caller's."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


def _check_host(bind_host: str) -> None:
    try:
        address = ipaddress.ip_address(bind_host)
    except ValueError:
        raise InputError(f"bind_host {bind_host!r}: give an IP address (e.g. 127.0.0.1)") from None
    if address.is_unspecified:
        # every address here is also advertised in discovery, where 0.0.0.0 reaches nobody
        raise InputError(
            f"bind_host {bind_host!r}: Dynamo advertises it to the other processes; give the"
            " address they reach this node on (e.g. 127.0.0.1, or the node's own address)"
        )


def _check_port(name: str, port: int | None, top: int = 65535) -> None:
    if port is not None and not 0 < port <= top:
        raise InputError(f"{name} {port}: give a TCP port between 1 and {top}")


# Dynamo 1.6.1 reads DYN_SYSTEM_PORT as an i16 ("invalid value unsigned int `40000`, expected
# i16"), so the system port must sit below Linux's ephemeral range, which starts at 32768.
SYSTEM_PORT_MAX = 32767


def bind_env(bind_host: str) -> dict[str, str]:
    """`bind_host` for every listener of a Dynamo process whose host a variable sets (and as
    the event plane's advertised address)."""
    _check_host(bind_host)
    return {
        "DYN_TCP_RPC_HOST": bind_host,
        "DYN_TCP_RESPONSE_STREAM_HOST": bind_host,
        "DYN_SYSTEM_HOST": bind_host,
        "DYN_EVENT_PLANE_HOST": bind_host,
        # the model is a local directory: a hub lookup could only fail or stall
        "HF_HUB_OFFLINE": "1",
    }


def dynamo_env(
    bind_host: str, discovery: Discovery, *, broker: ZmqBroker | None = None
) -> dict[str, str]:
    """What every Dynamo process of the deployment needs: where discovery is, the TCP request
    plane and ZMQ event plane (no NATS), and `bind_host` for every listener (`bind_env`)."""
    env = {"DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", **bind_env(bind_host)}
    if isinstance(discovery, FileDiscovery):
        if not discovery.root:
            raise InputError("file discovery needs a directory (DYN_FILE_KV)")
        env |= {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": discovery.root}
    else:
        if not discovery.endpoints:
            raise InputError("etcd discovery needs at least one endpoint (http://host:port)")
        env |= {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": ",".join(discovery.endpoints)}
    if broker is not None:
        env["DYN_ZMQ_BROKER_URL"] = f"xsub={broker.xsub},xpub={broker.xpub}"
    return env


def mocker_launch(
    role: MockerRole,
    model_dir: str,
    model_name: str,
    system_port: int,
    bind_host: str,
    discovery: Discovery,
    *,
    python: str = "python3",
    rpc_port: int | None = None,
    broker: ZmqBroker | None = None,
    options: MockerOptions = MockerOptions(),
) -> Launch:
    """A mocker worker in `role`, serving `model_name` with `model_dir`'s config and tokenizer,
    its /health and /metrics on `bind_host:system_port`, its request plane on `rpc_port`
    (OS-assigned when None)."""
    if role not in MOCKER_ROLES:
        raise InputError(f"mocker role {role!r}: one of {', '.join(MOCKER_ROLES)}")
    _check_port("system_port", system_port, SYSTEM_PORT_MAX)
    _check_port("rpc_port", rpc_port)
    argv = [python, "-m", MOCKER_MODULE, "--model-path", model_dir, "--model-name", model_name]
    argv += ["--disaggregation-mode", role]
    flags = (
        ("--max-num-seqs", options.max_num_seqs),
        ("--speedup-ratio", options.speedup_ratio),
        ("--num-gpu-blocks-override", options.num_gpu_blocks),
        ("--block-size", options.block_size),
        ("--startup-time", options.startup_time),
        ("--data-parallel-size", options.data_parallel_size),
    )
    for flag, value in flags:
        if value is not None:
            argv += [flag, str(value)]
    env = dynamo_env(bind_host, discovery, broker=broker)
    env |= worker_ports_env(system_port, rpc_port)
    return Launch(tuple(argv), env)


def worker_ports_env(system_port: int, rpc_port: int | None) -> dict[str, str]:
    """A mocker worker's status server port and request-plane port (OS-assigned when None)."""
    _check_port("system_port", system_port, SYSTEM_PORT_MAX)
    _check_port("rpc_port", rpc_port)
    env = {"DYN_SYSTEM_PORT": str(system_port)}
    # /health follows the endpoint's status with it; without, it answers "notready" (503) for
    # good. Dynamo 1.6.1 logs that the variable is deprecated and unused, yet it is what works.
    env["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"] = json.dumps(["generate"])
    if rpc_port is not None:
        env["DYN_TCP_RPC_PORT"] = str(rpc_port)
    return env


def stand_in_argv(
    command: Sequence[str], role: str, model_dir: str, model_name: str, args: Sequence[str]
) -> list[str]:
    """A deployment's role worker as a mocker: its command (the mocker's head, with any
    --model-path or --model-name of its own), the model and role, then the role's args."""
    if role not in MOCKER_ROLES:
        raise InputError(f"mocker role {role!r}: one of {', '.join(MOCKER_ROLES)}")
    argv = list(command)
    if "--model-path" not in argv:
        argv += ["--model-path", model_dir]
    if "--model-name" not in argv:
        argv += ["--model-name", model_name]
    return [*argv, "--disaggregation-mode", role, *args]


def command_model_dir(command: Sequence[str]) -> str | None:
    """The model directory a mocker command names (--model-path), if it names one."""
    argv = list(command)
    if "--model-path" in argv[:-1]:
        return argv[argv.index("--model-path") + 1]
    return None


def command_python(command: Sequence[str]) -> str:
    """The interpreter of a `PYTHON -m dynamo.mocker` command (the Dynamo venv's)."""
    if len(command) >= 3 and command[1] == "-m":
        return command[0]
    raise InputError(
        "command: a dynamo-mocker stand-in without --model-path runs as [PYTHON, -m, "
        "dynamo.mocker, …] so the run can write its tiny model with that Python; give "
        "--model-path DIR, or start the command with the Dynamo venv's python -m"
    )


def frontend_launch(
    http_port: int,
    bind_host: str,
    discovery: Discovery,
    *,
    python: str = "python3",
    response_port: int | None = None,
    migration_limit: int | None = None,
    broker: ZmqBroker | None = None,
) -> Launch:
    """Dynamo's OpenAI frontend on `bind_host:http_port` (its /metrics there too), its
    response-stream server on `response_port` (OS-assigned when None); with `migration_limit`
    a request whose worker fails moves to another that many times."""
    _check_port("http_port", http_port)
    _check_port("response_port", response_port)
    argv = [python, "-m", FRONTEND_MODULE, "--http-host", bind_host, "--http-port", str(http_port)]
    if migration_limit is not None:
        if migration_limit < 0:
            raise InputError(f"migration_limit {migration_limit}: 0 or more")
        argv += ["--migration-limit", str(migration_limit)]
    env = dynamo_env(bind_host, discovery, broker=broker)
    if response_port is not None:
        env["DYN_TCP_RESPONSE_STREAM_PORT"] = str(response_port)
    return Launch(tuple(argv), env)


SERVED_METRIC = "dynamo_component_requests_total"


def served_requests(metrics: str) -> float | None:
    """The requests a Dynamo worker's generate endpoint served, from its /metrics text (the
    sum over its series); None when the text has none."""
    total = None
    for line in metrics.splitlines():
        if line.startswith(SERVED_METRIC + "{") and 'dynamo_endpoint="generate"' in line:
            try:
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return total

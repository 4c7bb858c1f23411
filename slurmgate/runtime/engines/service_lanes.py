"""Service lanes at launch: argv, env and files of etcd, NATS, Mooncake's and the frontend.

Where they listen: loopback when every lane of the deployment runs on the client host (or
every node is this machine); else the client node's address, etcd and NATS with mutual TLS
(the run's certificates), Mooncake's master and metadata server only when the spec's
`mooncake.across_hosts` accepts them without authentication (Mooncake has none).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from slurmgate.errors import InputError
from slurmgate.runtime.engines import frontends, mocker, mooncake
from slurmgate.runtime.engines.layout import DeploymentPlan, Layout, ServicePlan
from slurmgate.runtime.engines.shapes import DeploymentShape


class MooncakeAcrossHosts(InputError):
    """Mooncake's services would answer other hosts unauthenticated, and the spec said no."""


def frontend_workers(lay: Layout, d: DeploymentPlan) -> frontends.Workers:
    """The workers a frontend routes to, by role, with the prefill bootstrap ports."""
    return frontends.Workers(
        prefill=tuple(lay.prefill_bootstraps(d)),
        decode=tuple(lay.role_head_urls(d, "decode")),
        agg=tuple(lay.role_head_urls(d, "agg")),
    )


@dataclass(frozen=True)
class ServiceLaunch:
    """What the runtime starts for one service lane: argv, env and the files it reads."""

    plan: ServicePlan
    argv: list[str]
    env: dict[str, str]
    files: dict[str, str]
    env_files: dict[str, str] = field(default_factory=dict)


def services_local(lay: Layout, d: DeploymentPlan) -> bool:
    """Every lane of the deployment runs on the client host (or every node is this machine:
    the client node's address is loopback): its etcd and NATS need answer no other host, so
    they listen on loopback; else on the node's address, with mutual TLS."""
    if all(node == lay.plan.client_node for node in d.node_indices):
        return True
    address = lay.address(lay.plan.client_node)
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address == "localhost"


def has_services(spec: DeploymentShape) -> bool:
    """The deployment has a service lane before its workers: etcd, NATS or Mooncake's."""
    return bool(spec.frontend is not None and spec.frontend.services) or spec.mooncake is not None


def services_tls(spec: DeploymentShape, lay: Layout, d: DeploymentPlan) -> bool:
    """The deployment has etcd and NATS, and nodes besides the client host reach them."""
    has_services = spec.frontend is not None and bool(spec.frontend.services)
    return has_services and not services_local(lay, d)


def services_host(lay: Layout, d: DeploymentPlan) -> str:
    """The address etcd, NATS and Mooncake's listen on, and their clients reach them at."""
    return frontends.LOOPBACK if services_local(lay, d) else lay.address(lay.plan.client_node)


def service_launches(
    spec: DeploymentShape,
    lay: Layout,
    d: DeploymentPlan,
    pems: frontends.ServicePems | None = None,
) -> list[ServiceLaunch]:
    """Every service lane of a deployment, in start order (etcd, NATS, Mooncake's, then the
    frontend): the frontend on the client node's address, the others on `services_host`,
    etcd and NATS with the run's certificates (`pems`) when `services_tls`."""
    f = spec.frontend
    host = lay.address(lay.plan.client_node)
    bind = services_host(lay, d)
    tls = services_tls(spec, lay, d)
    if tls and pems is None:
        raise ValueError(
            f"{d.name}: etcd and NATS serve other nodes: they need the run's certificates"
        )
    pems = pems if tls else None
    out = []
    for service in d.services:
        env_files: dict[str, str] = {}
        env: dict[str, str] = {}
        files: dict[str, str] = {}
        if service.name in mooncake.SERVICES:
            argv = mooncake_argv(spec, lay, d, service.name)
        elif service.name == "frontend":
            assert f is not None
            workers = frontend_workers(lay, d)
            argv = frontends.frontend_argv(f.type, f.argv_head, f.args, host, f.port, workers)
            env = {**service_env(spec, lay), **dynamo_frontend_env(spec, host), **f.env}
            files = frontends.frontend_files(f.type, host, f.port, workers)
            if pems is not None:
                env |= frontends.client_auth_env()
                env_files = frontends.client_auth_env_files()
                files |= pems.client_files()
        else:
            assert f is not None
            command = f.etcd_command if service.name == "etcd" else f.nats_command
            ports = f.service_ports
            argv = frontends.service_argv(service.name, command, bind, ports, tls=tls)
            files = frontends.service_files(service.name, bind, ports, pems)
        out.append(ServiceLaunch(service, argv, env, files, env_files))
    return out


def mooncake_host(spec: DeploymentShape, lay: Layout, d: DeploymentPlan) -> str:
    """Where Mooncake's master and metadata server listen: `services_host`, the client node's
    address only when the spec accepts them unauthenticated across hosts."""
    assert spec.mooncake is not None
    if not services_local(lay, d) and not spec.mooncake.across_hosts:
        raise MooncakeAcrossHosts(
            f"deployments[{d.index}].mooncake: workers of {d.name} run on nodes besides the "
            "client node, so Mooncake's master and metadata server would listen on its address, "
            "where neither authenticates its clients (Mooncake has no option for it) — set "
            "mooncake.across_hosts: true if the site accepts that (the nodes' network is "
            "trusted), or run the deployment on the client node alone"
        )
    return services_host(lay, d)


def mooncake_argv(spec: DeploymentShape, lay: Layout, d: DeploymentPlan, name: str) -> list[str]:
    m = spec.mooncake
    assert m is not None
    bind = mooncake_host(spec, lay, d)
    if name == mooncake.MASTER:
        return mooncake.master_argv(m.master_command, bind, m.ports, m.master_args)
    return mooncake.metadata_argv(m.metadata_command, bind, m.ports)


def mooncake_lane(
    spec: DeploymentShape, lay: Layout, d: DeploymentPlan, address: str
) -> tuple[dict[str, str], dict[str, str]]:
    """A worker lane's Mooncake variables and its store JSON (by file name under LANE_DIR),
    with `address` its node's; nothing without `mooncake`."""
    m = spec.mooncake
    if m is None:
        return {}, {}
    host = mooncake_host(spec, lay, d)
    config = mooncake.store_config(m.store_config, host, m.ports, address)
    return mooncake.worker_env(host, m.ports, address), {mooncake.CONFIG_FILE: config}


def dynamo_frontend_env(spec: DeploymentShape, bind_host: str) -> dict[str, str]:
    """Dynamo's frontend binds its response-stream server on the client node's address, on
    the port after its HTTP port (unset, it takes the machine's outside address and any
    port); other frontends need nothing. Only a stand-in's stays off the model hub: its
    model is a local directory, a real deployment's may be a hub id."""
    f = spec.frontend
    if f is None or f.type != "dynamo":
        return {}
    env = {**mocker.bind_env(bind_host), "DYN_TCP_RESPONSE_STREAM_PORT": str(f.port + 1)}
    if spec.stand_in is None:
        del env["HF_HUB_OFFLINE"]
    return env


def service_env(spec: DeploymentShape, lay: Layout) -> dict[str, str]:
    """What the frontend and every worker of the deployment need to find etcd and NATS
    (Dynamo): their URLs, the same for all, so it belongs in the deployment's step environment
    (the certificates' paths are each lane's: `frontends.client_auth_env`)."""
    if spec.frontend is None:
        return {}
    d = next(p for p in lay.plan.deployments if p.name == spec.name)
    return frontends.frontend_env(
        spec.frontend.type,
        services_host(lay, d),
        spec.frontend.service_ports,
        spec.frontend.request_plane,
        tls=services_tls(spec, lay, d),
        discovery=spec.frontend.discovery,
    )

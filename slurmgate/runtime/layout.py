"""Pure layout maths: which node runs what, on which GPUs and ports, with which rank and delay."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from slurmgate.errors import InputError
from slurmgate.runtime import engines


class DeploymentShape(Protocol):
    """What the layout reads of one deployment (`spec.DeploymentSpec` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def command(self) -> Sequence[str]: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def pipeline_parallel(self) -> int: ...
    @property
    def data_parallel(self) -> int: ...
    @property
    def gpus_per_lane(self) -> int: ...
    @property
    def replicas(self) -> int: ...
    @property
    def nodes_per_replica(self) -> int: ...
    @property
    def base_port(self) -> int: ...
    @property
    def rendezvous_base_port(self) -> int: ...
    @property
    def endpoint_port(self) -> int: ...
    @property
    def lead_boot_standoff_s(self) -> float: ...
    @property
    def rank_launch_stagger_s(self) -> float: ...
    @property
    def distributed_timeout_s(self) -> float: ...
    @property
    def enable_expert_parallel(self) -> bool: ...
    def lanes_for(self, node_gpus: int) -> int: ...
    def nodes_for(self, node_gpus: int) -> int: ...
    def used_gpus_per_node(self, node_gpus: int) -> int: ...


class ClientShape(Protocol):
    @property
    def dedicated_node(self) -> bool: ...


class AllocationShape(Protocol):
    """What the layout reads of an allocation (`spec.AllocationSpec` is one); the layout maths
    depends on these fields only, so the spec can check its ports with it."""

    @property
    def gpus_per_node(self) -> int: ...
    @property
    def client(self) -> ClientShape: ...
    @property
    def deployments(self) -> Sequence[DeploymentShape]: ...


@dataclass(frozen=True)
class LanePlan:
    """One model-server process: replica `replica`, pipeline rank `rank`, on lane slot `slot`."""

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

    @property
    def process_id(self) -> str:
        return f"{self.deployment}-replica-{self.replica:05d}-rank-{self.rank:05d}"


@dataclass(frozen=True)
class NodePlan:
    """What one deployment runs on one allocation node; `position` is its SLURM_PROCID."""

    deployment: str
    node: int
    position: int
    lanes: tuple[LanePlan, ...]

    @property
    def ports(self) -> tuple[int, ...]:
        ports = {p for lane in self.lanes for p in (lane.port,) if p is not None}
        ports |= {
            lane.rendezvous_port + i
            for lane in self.lanes
            if lane.rendezvous_port is not None and lane.rank == 0
            for i in range(lane.rendezvous_span)
        }
        return tuple(sorted(ports))


@dataclass(frozen=True)
class DeploymentPlan:
    """A deployment's nodes (in srun task order) and its lane heads."""

    name: str
    index: int
    nodes: tuple[NodePlan, ...]
    endpoint_port: int
    gpus_per_node: int

    @property
    def node_indices(self) -> tuple[int, ...]:
        return tuple(n.node for n in self.nodes)

    @property
    def heads(self) -> tuple[LanePlan, ...]:
        return tuple(lane for n in self.nodes for lane in n.lanes if lane.rank == 0)


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
            )
        )
        start += d.nodes_for(spec.gpus_per_node)
    return AllocationPlan(total_nodes=start, client_node=0, deployments=tuple(deployments))


def _deployment_nodes(d: DeploymentShape, node_gpus: int, start: int) -> tuple[NodePlan, ...]:
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
    for d in p.deployments:
        claim(p.client_node, d.endpoint_port, f"deployments[{d.index}].endpoint_port")
    return problems


def lane_argv(
    spec: DeploymentShape, lane: LanePlan, master_addr: str, *, bind_host: str
) -> list[str]:
    """The server argv: the spec's command plus the flags the layout decides, in the words of
    the deployment's engine (`engines.EngineProfile.lane_argv`)."""
    return engines.profile(spec.engine).lane_argv(spec, lane, master_addr, bind_host)


def describe(layout: Layout) -> list[dict[str, str]]:
    """One row per lane, for tables and logs."""
    rows: list[dict[str, str]] = []
    for d in layout.plan.deployments:
        for n in d.nodes:
            for lane in n.lanes:
                rows.append(
                    {
                        "deployment": d.name,
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

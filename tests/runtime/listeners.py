"""Every listening socket in the bundled nodes' network namespaces during a run, checked
against the README's table of the listeners a run opens."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from slurmgate.runtime.engines import service_lanes
from slurmgate.runtime.engines.layout import LanePlan, Layout
from slurmgate.runtime.spec.allocation import AllocationSpec

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.5  # how often ListenerWatch looks
# Appended to a quick client's code in a test that watches listeners: a client done within one
# poll let the run's endpoint start and stop between two polls, unseen.
HOLD_FOR_LISTENER_WATCH = f"\nimport time\ntime.sleep({3 * POLL_S:g})\n"
ROW = re.compile(r"^\| `(?P<key>[a-z-]+)` \| (?P<on>[^|]+) \| (?P<binds>[^|]+) \|")


def readme_listeners() -> dict[str, str]:
    """The README's table: listener key to what it says the listener binds."""
    text = (REPO / "README.md").read_text()
    table = text.split("**Listeners a run opens.**", 1)[1].split("\n\n**", 1)[0]
    return {m["key"]: m["binds"].strip() for line in table.splitlines() if (m := ROW.match(line))}


@dataclass(frozen=True)
class Listener:
    """One listening socket: the node namespace it is in, its address, port and owner."""

    namespace: str
    node_address: str
    proto: str
    address: str
    port: int
    process: str


def _namespaces() -> list[str]:
    listed = Path(os.environ["SLURM_CONF"]).parents[1] / "run" / "netns.list"
    if not listed.is_file():
        return []
    return [line.split()[0] for line in listed.read_text().splitlines() if line.strip()]


def _in_namespace(namespace: str, *argv: str) -> str:
    return subprocess.run(
        ["nsenter", f"--net=/run/netns/{namespace}", *argv],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout


def _owner(process: str) -> str:
    """`users:(("python",pid=12,fd=5))` -> that process's command line, shortened."""
    pid = re.search(r"pid=(\d+)", process)
    if pid is None:
        return process
    try:
        cmdline = Path(f"/proc/{pid[1]}/cmdline").read_bytes()
    except OSError:
        return process
    return " ".join(cmdline.replace(b"\0", b" ").decode(errors="replace").split())[:200]


def snapshot(namespace: str, node_address: str) -> set[Listener]:
    """The TCP and UDP sockets listening in one node's namespace now."""
    found = set()
    for line in _in_namespace(namespace, "ss", "-Hlntup").splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        address, _, port = fields[4].rpartition(":")
        process = _owner(" ".join(fields[6:]))
        found.add(
            Listener(namespace, node_address, fields[0], address.strip("[]"), int(port), process)
        )
    return found


class ListenerWatch:
    """Polls every node namespace while a run runs; `new` is what appeared after it began."""

    def __init__(self, every_s: float = POLL_S) -> None:
        self.every_s = every_s
        self.namespaces = {
            ns: _in_namespace(ns, "ip", "-4", "-o", "addr", "show", "eth0").split()[3].split("/")[0]
            for ns in _namespaces()
        }
        self.before: set[tuple[str, str, str, int]] = set()
        self.seen: set[Listener] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _all(self) -> set[Listener]:
        return {x for ns, addr in self.namespaces.items() for x in snapshot(ns, addr)}

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            self.seen |= self._all()

    def __enter__(self) -> ListenerWatch:
        # A listener is the same one across polls by its socket, not by its owner's name.
        self.before = {self._key(x) for x in self._all()}
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    @staticmethod
    def _key(x: Listener) -> tuple[str, str, str, int]:
        return (x.namespace, x.proto, x.address, x.port)

    @property
    def new(self) -> list[Listener]:
        """Each listener that appeared, once per owner it was seen with; a sighting with no
        owner (`ss` lists a socket whose process is exiting: a zombie's cmdline reads empty)
        only when no poll named that socket's owner."""
        named = {self._key(x) for x in self.seen if x.process}
        return sorted(
            (
                x
                for x in self.seen
                if self._key(x) not in self.before and (x.process or self._key(x) not in named)
            ),
            key=lambda x: (x.namespace, x.port, x.address),
        )


def _lane_port(lane: LanePlan, port: int) -> str | None:
    """Which of a lane's ports `port` is, if any."""
    head = lane.rank == 0
    rendezvous = lane.rendezvous_port if head else None
    ranges = {
        "lane": (lane.port, 1),
        "bootstrap": (lane.bootstrap_port if head else None, 1),
        "rendezvous": (rendezvous, lane.rendezvous_span),
        "side": (lane.side_port, lane.side_span),
    }
    for kind, (first, span) in ranges.items():
        if first is not None and first <= port < first + span:
            return kind
    return None


def kind_of(spec: AllocationSpec, lay: Layout, x: Listener) -> str | None:
    """Which of the README's listeners this socket is, by the run's layout; None: not one."""
    node = next((i for i in range(lay.plan.total_nodes) if lay.address(i) == x.node_address), None)
    if node is None:
        return None
    loopback = ipaddress.ip_address(x.address).is_loopback if x.address[0].isdigit() else False
    for d, d_spec in zip(lay.plan.deployments, spec.deployments, strict=True):
        if node == lay.plan.client_node and x.port == d.endpoint_port:
            return "endpoint"
        for n in d.nodes:
            if n.node != node:
                continue
            for lane in n.lanes:
                kind = _lane_port(lane, x.port)
                if kind is not None:
                    return kind
        m = d_spec.mooncake
        if m is not None and node == lay.plan.client_node:
            named = {
                "mooncake_master": "mooncake-master",
                "mooncake_metrics": "mooncake-metrics",
                "mooncake_metadata": "mooncake-metadata",
            }
            for key, kind in named.items():
                if x.port == m.ports[key]:
                    return kind
        worlds = [w for w in d.mpi_worlds() if node in w.nodes]
        owner = x.process
        if worlds and x.port >= 1024 and (not owner or "python" in owner or "slurmstepd" in owner):
            # a rank's Open MPI transport, or Slurm's pmix plugin: ephemeral ports (`ss` names
            # no owner for a socket whose process is exiting as it looks)
            return "mpi"
        f = d_spec.frontend
        if f is None or node != lay.plan.client_node:
            continue
        ports = f.service_ports
        tls = service_lanes.services_tls(d_spec, lay, d)
        if x.port == f.port:
            return "frontend"
        if x.port == f.port + 1 and f.type == "sglang-router":
            return "frontend-metrics"
        if x.port == f.port + 1 and f.type == "dynamo":
            return "frontend-response-stream"
        if x.port == ports["etcd"]:
            return "etcd-health" if loopback and tls else "etcd"
        named = {"etcd_peer": "etcd-peer", "nats": "nats", "nats_monitor": "nats-monitor"}
        for key, kind in named.items():
            if x.port == ports[key]:
                return kind
    return None


def unlisted(watch: ListenerWatch, spec: AllocationSpec, lay: Layout) -> list[str]:
    """Each listener the run opened that the README's table does not name, or that binds
    another address than the table says: one line each, with its owner."""
    table = readme_listeners()
    client_address = lay.address(lay.plan.client_node)
    problems = []
    for x in watch.new:
        where = f"{x.proto} {x.address}:{x.port} on {x.node_address} by {x.process}"
        kind = kind_of(spec, lay, x)
        if kind is None or kind not in table:
            problems.append(f"not in the README's table: {where}")
            continue
        binds = table[kind]
        loopback = x.address in ("127.0.0.1", "::1")
        ok = (
            (x.address in ("0.0.0.0", "::", "*") and "every address" in binds)
            or (loopback and "loopback" in binds)
            or (x.address == x.node_address and "node address" in binds)
            or (x.address == x.node_address == client_address and "client host address" in binds)
        )
        if not ok:
            problems.append(f"{kind} binds {x.address}, the README says {binds!r}: {where}")
    return problems

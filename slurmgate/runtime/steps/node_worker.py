"""One srun task per node (or per MPI rank): preflight the node, or start and supervise lanes."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from slurmgate.errors import ExternalError, InputError
from slurmgate.runtime.engines.roles import LANE_DIR
from slurmgate.runtime.steps import in_container, lane_launcher, outputs, protocol
from slurmgate.settings import handed
from slurmgate.slurm.jobenv import slurm_variable

MAX_SPEC_BYTES = 64 * 1024
EXIT_PREFLIGHT = 70
# The human lines of a preflight and of a lane's exit; the controller reads `protocol`'s lines.
PREFLIGHT_OK = "SLURMGATE-PREFLIGHT-OK"
LANE_EXIT = "SLURMGATE-LANE-EXIT"
EXIT_SPAWN = 71
POLL_S = 0.1
MAX_LANE_FILES = 8
# One writer at a time on the step's output: the worker's own lines and the lanes' lines.
_OUTPUT_LOCK = threading.Lock()


class WorkerSpecError(InputError):
    """The --spec payload is malformed."""


@dataclass(frozen=True)
class LaneSpec:
    id: str
    argv: list[str]
    gpus: list[int]
    delay_s: float
    env: dict[str, str]
    # Files written into the lane's directory before it starts, by plain name (an engine's
    # YAML); the argv names them under LANE_DIR.
    files: dict[str, str] = field(default_factory=dict)
    # Variables whose value is the text of one of the lane's files: for a program that takes a
    # certificate's PEM only in its environment (Dynamo's etcd client). The lane, a Python
    # program, starts through `lane_launcher`, which sets them inside its process: the text is
    # never in exec's environment or argv.
    env_files: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.env_files and lane_launcher.split_python(self.argv) is None:
            raise WorkerSpecError(
                f"lane {self.id}: its certificate's variables ({', '.join(self.env_files)}) "
                "are set inside a Python program only, started as PYTHON [OPTIONS] -m MODULE, "
                f"-c CODE or SCRIPT; {(self.argv or [''])[0]!r} does not start one: start the "
                "command with the Python interpreter (python3 -m dynamo.frontend)"
            )


@dataclass(frozen=True)
class NodeSpec:
    host: str
    ports: list[int]
    lanes: list[LaneSpec]
    # The node's cluster address: lanes bind it, never every interface.
    address: str = ""


@dataclass(frozen=True)
class WorkerSpec:
    """What every task of one step needs; task SLURM_PROCID runs nodes[SLURM_PROCID]."""

    run_id: str
    name: str
    gpus_per_node: int
    model_path: str | None
    grace_s: float
    nodes: list[NodeSpec]
    # Absolute model paths the deployment's command loads, as its engine profile reads them
    # (`--model /models/x`): checked like model_path, so a missing checkpoint fails preflight.
    model_paths: list[str] = field(default_factory=list)
    # Files every lane of the step gets in its directory besides its own (the run's client
    # certificate for etcd and NATS): sent once, not once per lane, to keep the spec small.
    shared_files: dict[str, str] = field(default_factory=dict)
    # Files the controller wrote in a directory every node must share (Dynamo's file
    # discovery), with their text: preflight reads each back, or the node does not share it.
    shared_tokens: dict[str, str] = field(default_factory=dict)
    # The container the serve step's workers run in; preflight checks its paths on the node.
    container: in_container.ContainerNeeds | None = None

    def checked_paths(self) -> list[str]:
        """Every model path preflight checks, each once, the spec's own first."""
        return list(dict.fromkeys(p for p in [self.model_path, *self.model_paths] if p))

    def to_json(self) -> dict[str, Any]:
        return {
            "v": 1,
            "run_id": self.run_id,
            "name": self.name,
            "gpus_per_node": self.gpus_per_node,
            "model_path": self.model_path,
            "model_paths": self.model_paths,
            **({"shared_files": self.shared_files} if self.shared_files else {}),
            **({"shared_tokens": self.shared_tokens} if self.shared_tokens else {}),
            **({"container": self.container.to_json()} if self.container else {}),
            "grace_s": self.grace_s,
            "nodes": [
                {
                    "host": n.host,
                    "address": n.address,
                    "ports": n.ports,
                    "lanes": [
                        {
                            "id": lane.id,
                            "argv": lane.argv,
                            "gpus": lane.gpus,
                            "delay_s": lane.delay_s,
                            "env": lane.env,
                            **({"files": lane.files} if lane.files else {}),
                            **({"env_files": lane.env_files} if lane.env_files else {}),
                        }
                        for lane in n.lanes
                    ],
                }
                for n in self.nodes
            ],
        }

    def encode(self) -> str:
        raw = json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True).encode()
        text = base64.urlsafe_b64encode(raw).decode().rstrip("=")
        if len(text) > MAX_SPEC_BYTES:
            raise WorkerSpecError(f"worker spec is {len(text)} bytes, over {MAX_SPEC_BYTES}")
        return text

    @classmethod
    def decode(cls, text: str) -> WorkerSpec:
        if len(text) > MAX_SPEC_BYTES:
            raise WorkerSpecError(f"--spec is {len(text)} bytes, over {MAX_SPEC_BYTES}")
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
            data = json.loads(raw)
        except (ValueError, TypeError) as exc:
            raise WorkerSpecError(f"--spec is not base64url JSON: {exc}") from None
        return cls.from_json(data)

    @classmethod
    def from_json(cls, data: Any) -> WorkerSpec:
        _keys(
            data,
            {"v", "run_id", "name", "gpus_per_node", "model_path", "grace_s", "nodes"},
            optional=frozenset({"model_paths", "shared_files", "shared_tokens", "container"}),
        )
        if data["v"] != 1:
            raise WorkerSpecError(f"spec version {data['v']!r} is not supported")
        nodes = []
        for n in _typed(data["nodes"], list, "nodes"):
            _keys(n, {"host", "address", "ports", "lanes"})
            lanes = []
            seen_gpus: set[int] = set()
            for lane in _typed(n["lanes"], list, "lanes"):
                _keys(
                    lane,
                    {"id", "argv", "gpus", "delay_s", "env"},
                    frozenset({"files", "env_files"}),
                )
                gpus = [_typed(g, int, "gpus[]") for g in _typed(lane["gpus"], list, "gpus")]
                for g in gpus:
                    if g in seen_gpus or not 0 <= g < int(data["gpus_per_node"]):
                        raise WorkerSpecError(
                            f"lane {lane['id']}: GPU {g} is shared or out of range"
                        )
                    seen_gpus.add(g)
                argv = [_typed(a, str, "argv[]") for a in _typed(lane["argv"], list, "argv")]
                if not argv:
                    raise WorkerSpecError(f"lane {lane['id']}: empty argv")
                lanes.append(
                    LaneSpec(
                        id=_typed(lane["id"], str, "id"),
                        argv=argv,
                        gpus=gpus,
                        delay_s=float(lane["delay_s"]),
                        env={str(k): str(v) for k, v in _typed(lane["env"], dict, "env").items()},
                        files=_files(lane.get("files", {}), str(lane["id"])),
                        env_files=_env_files(lane.get("env_files", {}), str(lane["id"])),
                    )
                )
            ports = sorted({_typed(p, int, "ports[]") for p in _typed(n["ports"], list, "ports")})
            nodes.append(
                NodeSpec(
                    host=_typed(n["host"], str, "host"),
                    ports=ports,
                    lanes=lanes,
                    address=_typed(n["address"], str, "address"),
                )
            )
        if len({n.host for n in nodes}) != len(nodes):
            raise WorkerSpecError("hosts in the spec are not unique")
        return cls(
            run_id=_typed(data["run_id"], str, "run_id"),
            name=_typed(data["name"], str, "name"),
            gpus_per_node=_typed(data["gpus_per_node"], int, "gpus_per_node"),
            model_path=data["model_path"],
            grace_s=float(data["grace_s"]),
            nodes=nodes,
            model_paths=[
                _typed(p, str, "model_paths[]")
                for p in _typed(data.get("model_paths", []), list, "model_paths")
            ],
            shared_files=_files(data.get("shared_files", {}), "every lane"),
            shared_tokens={
                _typed(k, str, "shared_tokens"): _typed(v, str, "shared_tokens[]")
                for k, v in _typed(data.get("shared_tokens", {}), dict, "shared_tokens").items()
            },
            container=_container(data.get("container")),
        )


def _container(value: Any) -> in_container.ContainerNeeds | None:
    if value is None:
        return None
    try:
        return in_container.ContainerNeeds.from_json(value)
    except in_container.ContainerSpecError as exc:
        raise WorkerSpecError(str(exc)) from None


def _keys(obj: Any, expected: set[str], optional: frozenset[str] = frozenset()) -> None:
    if not isinstance(obj, dict) or not expected <= set(obj) <= expected | optional:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise WorkerSpecError(f"expected keys {sorted(expected)}, got {got}")


def _env_files(value: Any, lane: str) -> dict[str, str]:
    """A lane's variables read from its files: each names a file as `_files` allows."""
    named = _files(value, lane)
    for name in named.values():
        if "/" in name or name.startswith(".") or not name:
            raise WorkerSpecError(f"lane {lane}: env_files names {name!r}, not a plain file")
    return named


def _files(value: Any, lane: str) -> dict[str, str]:
    """A lane's files: a few, each a plain file name (no directory, no dot file) and text."""
    files = _typed(value, dict, "files")
    if len(files) > MAX_LANE_FILES:
        raise WorkerSpecError(f"lane {lane}: {len(files)} files, over {MAX_LANE_FILES}")
    for name, text in files.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise WorkerSpecError(f"lane {lane}: file name {name!r} is not a plain file name")
        _typed(text, str, "files[]")
    return dict(files)


def _typed(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WorkerSpecError(f"{what} must be {kind.__name__}")
    return value


class PreflightFailed(ExternalError):
    """A node check failed; `check` names it."""

    def __init__(self, host: str, check: str, message: str) -> None:
        self.host = host
        self.check = check
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        return f"preflight failed on node {self.host}: check {self.check}: {self.message}"


def visible_gpus(env: dict[str, str] | None = None) -> list[str]:
    e = handed.PROCESS_ENVIRONMENT if env is None else env
    value = e.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not value or value == "NoDevFiles":
        return []
    return [v.strip() for v in value.split(",") if v.strip()]


def node_name() -> str:
    """This node as Slurm names it: SLURMD_NODENAME under srun, else the short hostname.

    Slurm's NodeName may differ from the hostname, and the plan's hosts are NodeNames.
    """
    return slurm_variable("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def select_node(spec: WorkerSpec) -> NodeSpec:
    """Pick this task's node by SLURM_PROCID and check identity against the plan."""
    here = node_name()
    if (
        spec.container
        and spec.container.without_task_variables
        and not slurm_variable("SLURM_PROCID")
    ):
        # Slurm's OCI container: no task variables inside, the node's hostname instead
        index = in_container.task_index([n.host for n in spec.nodes], here)
        if index is None:
            raise PreflightFailed(here, "identity", f"{here} is not a node of the plan")
        return spec.nodes[index]
    try:
        procid = int(slurm_variable("SLURM_PROCID") or "")
        ntasks = int(slurm_variable("SLURM_NTASKS") or "")
    except (KeyError, ValueError):
        raise PreflightFailed(
            here, "identity", "SLURM_PROCID/SLURM_NTASKS not set: run under srun"
        ) from None
    if ntasks != len(spec.nodes):
        raise PreflightFailed(
            here, "ntasks", f"SLURM_NTASKS={ntasks} but the plan has {len(spec.nodes)} nodes"
        )
    if not 0 <= procid < len(spec.nodes):
        raise PreflightFailed(here, "identity", f"SLURM_PROCID={procid} is outside the plan")
    node = spec.nodes[procid]
    if node.host != here:
        raise PreflightFailed(
            here,
            "hostname",
            f"task {procid} runs on {here} but the plan puts it on {node.host}: "
            "check that the allocation's node names are the hosts' SLURMD_NODENAME",
        )
    return node


def preflight(spec: WorkerSpec, *, on_host: bool = False) -> NodeSpec:
    """Identity, GPU count, bindable ports and model path; raises PreflightFailed.

    `on_host`: the preflight step, on the node itself, of a step whose serve step runs in a
    container: the container's image, bundle and mount sources are checked here, and its model
    paths (paths inside the container) by the serve step's own preflight in there."""
    node = select_node(spec)
    if spec.container and on_host:
        # the container mounts the run's outputs folder from the node: it must exist there
        outputs.prepare(spec.run_id, node.host)
        missing = in_container.missing_host_path(spec.container)
        if missing is not None:
            raise PreflightFailed(
                node.host,
                "container",
                f"{missing} does not exist on the node (the container's image, bundle or "
                "a mount's source)",
            )
    gpus = visible_gpus()
    if len(set(gpus)) != len(gpus):
        raise PreflightFailed(
            node.host,
            "gpu-list",
            f"CUDA_VISIBLE_DEVICES={handed.handed('CUDA_VISIBLE_DEVICES') or ''!r} lists a GPU "
            "twice: two lanes would share it",
        )
    # A superset is fine (the seed accepts it too): lanes take the first GPUs of the list.
    if len(gpus) < spec.gpus_per_node:
        raise PreflightFailed(
            node.host,
            "gpu-count",
            f"{len(gpus)} GPUs visible (CUDA_VISIBLE_DEVICES="
            f"{handed.handed('CUDA_VISIBLE_DEVICES') or ''!r}) but the plan needs "
            f"{spec.gpus_per_node}",
        )
    for port in node.ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # As servers bind: TIME_WAIT leftovers of a previous run are fine, a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            # The address the lanes will bind: a listener there (or on every interface) is a
            # conflict, one on another interface is not.
            sock.bind((node.address or node.host, port))
        except OSError as exc:
            raise PreflightFailed(
                node.host, "port", f"port {port} is not bindable: {exc.strerror}"
            ) from None
        finally:
            sock.close()
    for path in [] if spec.container and on_host else spec.checked_paths():
        if not os.path.exists(path):
            raise PreflightFailed(node.host, "model-path", f"{path} does not exist")
        mode = os.R_OK | (os.X_OK if os.path.isdir(path) else 0)
        if not os.access(path, mode):
            raise PreflightFailed(node.host, "model-path", f"{path} is not readable")
    for path, token in spec.shared_tokens.items():
        try:
            with open(path) as f:
                seen = f.read()
        except OSError as exc:
            seen = f"unreadable ({exc.strerror})"
        if seen != token:
            raise PreflightFailed(
                node.host,
                "shared-dir",
                f"frontend.discovery_dir: {os.path.dirname(path)} is not shared with this node "
                f"(the token the controller wrote there reads {seen[:40]!r} here); give a "
                "directory on a filesystem every node mounts",
            )
    return node


class Lanes:
    """This node's lane processes, each in its own session."""

    def __init__(self, grace_s: float, shared_files: dict[str, str] | None = None) -> None:
        self.grace_s = grace_s
        self.shared_files = dict(shared_files or {})
        self.procs: list[tuple[LaneSpec, subprocess.Popen[bytes]]] = []
        self.started: dict[str, float] = {}  # lane id -> when it started (monotonic)
        self.dirs: list[str] = []

    def lane_dir(self, lane: LaneSpec, run_id: str) -> str:
        """A fresh private directory for the lane (LANE_DIR in its argv and env), with its
        files in it, each 0600: an engine's YAML, the data of etcd and NATS, the run's service
        certificates and keys. Removed when the lanes stop."""
        path = tempfile.mkdtemp(prefix=f"slurmgate-{run_id}-{lane.id}-")
        self.dirs.append(path)
        for name, text in {**self.shared_files, **lane.files}.items():
            fd = os.open(os.path.join(path, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        return path

    def scratch_dir(self) -> str:
        """A fresh private TMPDIR for a lane, removed when the lanes stop: what an engine leaves
        in its temporary directory (vLLM's rendezvous file, Dynamo's logging configs) goes
        with the run. Its name is short: engines put Unix sockets in it (108 bytes at most)."""
        path = tempfile.mkdtemp(prefix="sg-tmp-")
        self.dirs.append(path)
        return path

    def launched(self, argv: list[str], where: str, env_files: dict[str, str]) -> list[str]:
        """`argv` started through `lane_launcher`, copied into the lane's directory `where`,
        which sets each variable to the text of its file there inside the lane's process."""
        paths = [(var, os.path.join(where, name)) for var, name in env_files.items()]
        for _, path in paths:
            os.stat(path)  # a missing file fails the lane's start, not its program
        launcher = os.path.join(where, lane_launcher.FILE_NAME)
        with open(lane_launcher.__file__, "rb") as src:
            source = src.read()
        fd = os.open(launcher, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(source)
        wrapped = lane_launcher.launcher_argv(argv, launcher, paths)
        assert wrapped is not None  # LaneSpec refuses any other command
        return wrapped

    def spawn(self, lane: LaneSpec, visible: list[str], run_id: str) -> None:
        env = handed.inherited()
        env.update(lane.env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[g] for g in lane.gpus)
        env["SLURMGATE_RUN_ID"] = run_id
        env["SLURMGATE_RUN_LANE"] = lane.id
        argv = lane.argv
        files = lane.files or self.shared_files
        if files or lane.env_files or any(LANE_DIR in a for a in [*argv, *lane.env.values()]):
            where = self.lane_dir(lane, run_id)
            argv = [a.replace(LANE_DIR, where) for a in argv]
            # A lane's env may name its files too (the paths of its certificates).
            env.update({k: v.replace(LANE_DIR, where) for k, v in lane.env.items()})
            if lane.env_files:
                argv = self.launched(argv, where, lane.env_files)
        if "TMPDIR" not in lane.env:
            env["TMPDIR"] = self.scratch_dir()
        # The lane's output goes to the step (the controller's step log) and to a node-local
        # log that outlives the lane, which the run collects from every node before cleanup.
        logs_dir, results_dir = outputs.prepare(run_id, node_name())
        for name, value in ((handed.RESULTS_DIR, results_dir), (handed.LOGS_DIR, logs_dir)):
            if name not in lane.env:
                env[name] = value
        log = outputs.open_log(logs_dir, lane.id)
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        except OSError:
            log.close()
            raise
        assert proc.stdout is not None
        outputs.tee(proc.stdout, _write_output, log)
        self.procs.append((lane, proc))
        self.started[lane.id] = time.monotonic()
        _say(f"started lane {lane.id} pid {proc.pid} gpus {env['CUDA_VISIBLE_DEVICES'] or '-'}")
        _tell(protocol.LaneStarted(host=node_name(), lane=lane.id))

    def first_exit(self) -> tuple[LaneSpec, int] | None:
        for lane, proc in self.procs:
            rc = proc.poll()
            if rc is not None:
                return lane, rc
        return None

    def stop(self) -> None:
        """TERM every lane's group, a bounded grace, then KILL."""
        for _, proc in self.procs:
            _killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(_group_alive(p.pid) for _, p in self.procs):
            for _, p in self.procs:
                p.poll()
            time.sleep(0.05)
        for lane, proc in self.procs:
            if _group_alive(proc.pid):
                _say(f"lane {lane.id} ignored SIGTERM for {self.grace_s:g} s: SIGKILL")
                _killpg(proc.pid, signal.SIGKILL)
        for _, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)


def serve(spec: WorkerSpec, stop: threading.Event, stop_signal: list[int]) -> int:
    """Start the node's lanes after their delays; exit as soon as one exits or a stop arrives."""
    node = preflight(spec)
    if spec.container:
        failed = in_container.run_setup_script(spec.container, _say)
        if failed is not None:
            raise PreflightFailed(node.host, "setup-script", failed)
    return supervise(spec, node.lanes, stop, stop_signal)


def rank_lane(spec: WorkerSpec) -> LaneSpec:
    """This task's lane in an MPI world (`rank` mode, several tasks per node): its node's one
    lane, named by the task's rank so that an exit names the rank that died."""
    here = node_name()
    rank = slurm_variable("SLURM_PROCID") or ""
    if not (rank.isascii() and rank.isdigit()):
        raise PreflightFailed(here, "identity", "SLURM_PROCID is not set: run under srun")
    node = next((n for n in spec.nodes if n.host == here), None)
    if node is None:
        raise PreflightFailed(
            here, "identity", f"rank {rank} runs on {here}, a node the MPI world's plan lacks"
        )
    if len(node.lanes) != 1:
        raise PreflightFailed(
            here, "lanes", f"an MPI rank runs 1 lane, the plan has {len(node.lanes)}"
        )
    lane = node.lanes[0]
    return dataclasses.replace(lane, id=f"{lane.id}-mpi-rank-{int(rank):05d}")


def supervise(
    spec: WorkerSpec, node_lanes: list[LaneSpec], stop: threading.Event, stop_signal: list[int]
) -> int:
    """Start `node_lanes` after their delays; exit as soon as one exits or a stop arrives."""
    visible = visible_gpus()
    lanes = Lanes(spec.grace_s, spec.shared_files)
    order = sorted(node_lanes, key=lambda lane: lane.delay_s)
    t0 = time.monotonic()
    pending = list(order)
    try:
        while True:
            while pending and time.monotonic() - t0 >= pending[0].delay_s and not stop.is_set():
                lane = pending.pop(0)
                try:
                    lanes.spawn(lane, visible, spec.run_id)
                except OSError as exc:
                    _say(f"lane {lane.id} failed to start ({lane.argv[0]}): {exc.strerror}")
                    _tell(protocol.LaneSpawnFailed(node_name(), lane.id, str(exc.strerror)))
                    return EXIT_SPAWN
            if stop.is_set():
                _say("stop requested: stopping lanes")
                return 128 + (stop_signal[0] if stop_signal else signal.SIGTERM)
            exited = lanes.first_exit()
            if exited is not None:
                lane, rc = exited
                # How long it ran tells a crash of the node's from a command that cannot start.
                uptime = time.monotonic() - lanes.started[lane.id]
                _say(f"lane {lane.id} exited with status {rc} after {uptime:.1f} s: "
                     "stopping the node")  # fmt: skip
                _line(f"{LANE_EXIT} host={node_name()} lane={lane.id} status={rc}")
                _tell(protocol.LaneExited(node_name(), lane.id, rc, uptime))
                if rc == 0:
                    return 1  # a server lane must never end on its own
                return 128 - rc if rc < 0 else rc
            stop.wait(POLL_S)
    finally:
        lanes.stop()


def _say(message: str) -> None:
    _line(f"[node-worker {node_name()}] {message}")


def _line(text: str) -> None:
    """One write per line: srun interleaves the tasks' output, split writes come apart."""
    _write_output((text + "\n").encode())


def _write_output(line: bytes) -> None:
    """One whole line onto the step's output (stderr), never between another writer's bytes."""
    with _OUTPUT_LOCK:
        sys.stderr.flush()
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()


def _tell(message: protocol.Message) -> None:
    """The controller's copy of an event, beside the human line: one machine line."""
    _line(protocol.encode(message))


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    from slurmgate.runtime.procs import group_alive

    return group_alive(pgid)


def _read_spec_text(arg: str) -> str:
    """`-` reads the spec from stdin (how the runtime sends it: argv is public in /proc)."""
    if arg != "-":
        return arg
    return sys.stdin.read(MAX_SPEC_BYTES + 1).strip()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[0] not in {"preflight", "serve", "rank"} or args[1] != "--spec":
        print(
            "usage: python -m slurmgate.runtime.steps.node_worker {preflight|serve|rank} "
            "--spec {-|B64}",
            file=sys.stderr,
        )
        return 64
    try:
        spec = WorkerSpec.decode(_read_spec_text(args[2]))
    except WorkerSpecError as exc:
        print(f"node-worker: bad --spec: {exc}", file=sys.stderr)
        return 64
    stop = threading.Event()
    stop_signal: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not stop_signal:
            stop_signal.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args[0] != "preflight" and spec.container and spec.container.without_task_variables:
        # Slurm's OCI container: the step holds the node's GPUs, the container shows them all
        handed.hand_down(handed.VISIBLE_DEVICES, in_container.container_gpus(spec.gpus_per_node))
    try:
        if args[0] == "preflight":
            preflight(spec, on_host=True)
            # The controller checks every planned node reported, from the node it planned.
            cpus = slurm_variable("SLURM_CPUS_ON_NODE") or "0"
            _line(f"{PREFLIGHT_OK} host={node_name()} cpus={cpus} gpus={len(visible_gpus())}")
            if cpus.isascii() and cpus.isdigit():
                _tell(protocol.PreflightPassed(node_name(), int(cpus), len(visible_gpus())))
            return 0
        if args[0] == "rank":
            return supervise(spec, [rank_lane(spec)], stop, stop_signal)
        return serve(spec, stop, stop_signal)
    except PreflightFailed as exc:
        _line(f"SLURMGATE-PREFLIGHT host={exc.host} check={exc.check}: {exc.message}")
        _tell(protocol.PreflightCheckFailed(exc.host, exc.check, exc.message))
        return EXIT_PREFLIGHT


if __name__ == "__main__":
    sys.exit(main())

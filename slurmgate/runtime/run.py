"""One allocation run: allocate, preflight, launch, readiness, endpoints, client, cleanup."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from slurmgate.errors import ExternalError, InputError
from slurmgate.runtime import engines, readiness, slurm
from slurmgate.runtime import layout as layout_mod
from slurmgate.runtime.credentials import RunCredentials, SecretResolver
from slurmgate.runtime.endpoint.config import TOKEN_ENV, EndpointConfig
from slurmgate.runtime.hooks import HookInvocation, HookRunner, run_plain
from slurmgate.runtime.node_worker import PREFLIGHT_OK, NodeSpec, WorkerSpec, node_name
from slurmgate.runtime.probe_step import HELLO_TIMEOUT_S, ProbeChannel, ProbeStepFailed
from slurmgate.runtime.records import (
    RECORD_NAME,
    HookOutcome,
    RunRecord,
    RunStatus,
    StepRecord,
    controller_identity,
    default_runs_root,
)
from slurmgate.runtime.spec import AllocationSpec, DeploymentSpec
from slurmgate.runtime.stepenv import step_env
from slurmgate.runtime.supervisor import (
    DEFER,
    CleanupFailed,
    CleanupReport,
    StepFailed,
    Supervisor,
)

PREFLIGHT_TIMEOUT_S = 120.0
ENDPOINT_STARTUP_S = 60.0
METRICS_HELLO_TIMEOUT_S = 15.0  # the metrics step after the client: optional, so bounded tighter
DIRECT_METRICS_TIMEOUT_S = 2.0
# The seed gives its client 32 CPUs; an allocation that holds fewer on the client node gets
# them all (a step cannot ask for more than the job holds there).
SEED_CLIENT_CPUS = 32
# The client's output is copied into the run's log line by line up to this many lines, then
# only its last lines: a benchmark that prints per request must not flood the Prefect log.
CLIENT_ECHO_LINES = 400
CLIENT_ECHO_TAIL_LINES = 20
CLIENT_ECHO_LINE_CHARS = 2000
_PREFLIGHT_LINE = re.compile(
    r"SLURMGATE-PREFLIGHT host=(\S+) check=(\S+): (.*?)(?:srun: .*)?$", re.M
)
# What slurmstepd says when a task's program cannot be executed, and Python without slurmgate.
_EXEC_FAILED = re.compile(
    r"slurmstepd(?:-(?P<node>[^:\s]+))?: error: execve\(\): (?P<path>[^:]+): (?P<reason>[^\n]*)"
)
_NO_SLURMGATE = re.compile(r"No module named '?slurmgate")
# Not anchored: srun may run two tasks' lines together.
_PREFLIGHT_OK_LINE = re.compile(rf"{PREFLIGHT_OK} host=(\S+?) cpus=(\d+) gpus=(\d+)")


@dataclass(frozen=True)
class NodeReport:
    """What a node's preflight task reported: the node it ran on, its CPUs and GPUs."""

    host: str
    cpus: int
    gpus: int


def preflight_reports(log: str, planned: list[str], step: str) -> dict[str, NodeReport]:
    """Every planned node reported from itself, once: else RunFailed naming the node."""
    reports = [
        NodeReport(host=h, cpus=int(c), gpus=int(g)) for h, c, g in _PREFLIGHT_OK_LINE.findall(log)
    ]
    stray = [r.host for r in reports if r.host not in planned]
    if stray:
        raise RunFailed(
            "preflight",
            f"{step}: a task ran on {stray[0]}, which the plan does not have "
            f"(planned: {', '.join(planned)}); the node's SLURMD_NODENAME must be its name in "
            "the allocation",
        )
    by_host = {r.host: r for r in reports}
    missing = [h for h in planned if h not in by_host]
    if missing or len(reports) != len(planned):
        raise RunFailed(
            "preflight",
            f"{step}: node {missing[0] if missing else planned[0]} did not report its preflight "
            f"({len(reports)} report(s) for {len(planned)} node(s))",
        )
    return by_host


def controller_on(host: str) -> bool:
    """Whether this process runs on `host` (e.g. inside the allocation, on its first node)."""
    return node_name() == host


class OutputEcho:
    """Copy a step's log to `emit` as it grows: whole lines, bounded (the run's log, which
    `emit` is, redacts them).

    A line rewritten with carriage returns (a progress bar) shows as its last state. Past
    `limit` lines only the last `tail` are kept, and `finish` logs them with a count of the
    lines it left out.
    """

    def __init__(
        self,
        path: Path,
        emit: Callable[[str], None],
        *,
        limit: int = CLIENT_ECHO_LINES,
        tail: int = CLIENT_ECHO_TAIL_LINES,
    ) -> None:
        self.path = path
        self.emit = emit
        self.limit = limit
        self.offset = 0
        self.partial = b""
        self.echoed = 0
        self.skipped = 0
        self.held: collections.deque[str] = collections.deque(maxlen=tail)

    def poll(self) -> None:
        """Emit the whole lines written since the last poll."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read(1 << 20)
        except OSError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            self._line(line)

    def finish(self) -> None:
        """Emit what is left: a last line without a newline, and the held tail."""
        self.poll()
        if self.partial:
            self._line(self.partial)
            self.partial = b""
        if self.held:
            if self.skipped:
                self.emit(f"... {self.skipped} line(s) left out, the last {len(self.held)}:")
            while self.held:
                self.emit(self.held.popleft())

    def _line(self, raw: bytes) -> None:
        text = raw.decode(errors="replace").rstrip("\r").rsplit("\r", 1)[-1]
        text = text[:CLIENT_ECHO_LINE_CHARS]
        if self.echoed < self.limit:
            self.echoed += 1
            self.emit(text)
            return
        if len(self.held) == self.held.maxlen:
            self.skipped += 1
        self.held.append(text)


class RunFailed(ExternalError):
    """A phase of the run failed; `phase` names it."""

    def __init__(self, phase: str, message: str) -> None:
        self.phase = phase
        super().__init__(f"{phase}: {message}")


# The client's reports directory (on the run's own directory): `slurmgate loadgen --chat` writes
# its JSON report there, and the allocation flow publishes what it finds as artifacts.
CLIENT_REPORTS_ENV = "SLURMGATE_RUN_REPORTS_DIR"


def new_run_id(name: str) -> str:
    return f"sg-{name[:20]}-{secrets.token_hex(4)}"


def env_name(deployment: str) -> str:
    """SLURMGATE_ENDPOINT_<NAME>: the client's variable for a deployment's endpoint URL."""
    return "SLURMGATE_ENDPOINT_" + re.sub(r"[^A-Z0-9]", "_", deployment.upper())


@dataclass
class RunResult:
    """What a finished run reports."""

    run_id: str
    ok: bool
    error: str | None
    job_id: str | None
    hosts: list[str]
    timings: dict[str, float]
    endpoint_metrics: dict[str, str]
    cleanup: list[str]
    record_path: str
    hooks: dict[str, str] = field(default_factory=dict)  # hook name -> what it did, in words
    hooks_failed: list[str] = field(default_factory=list)  # hooks that did not succeed


@dataclass
class _Timings:
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str, t0: float) -> None:
        self.marks[name] = round(time.monotonic() - t0, 4)


class AllocationRun:
    """One run of an allocation spec; every phase is a method, cleanup has exactly one owner."""

    def __init__(
        self,
        spec: AllocationSpec,
        *,
        runs_root: Path | None = None,
        run_id: str | None = None,
        grace_s: float = 10.0,
        poll_s: float = 0.1,
        python: str | None = None,
        allocate_timeout_s: float = 300.0,
        log: Callable[[str], None] | None = None,
        on_progress: Callable[[str, int, int], None] | None = None,
        resolve_secret: SecretResolver | None = None,
        hook_runner: HookRunner | None = None,
    ) -> None:
        self.spec = spec
        # Resolved here, on the client host, before anything starts: an unknown reference
        # fails the run with nothing to clean up. The values live only in this process.
        self.credentials = RunCredentials.resolve(spec, resolve_secret)
        self.redact = self.credentials.redactor()
        self.run_id = run_id or new_run_id(spec.name)
        self.run_dir = (runs_root or default_runs_root()) / self.run_id
        self.python = python or spec.python or sys.executable
        self.allocate_timeout_s = allocate_timeout_s
        self.poll_s = poll_s
        self.grace_s = grace_s
        self._log = log or (lambda m: print(f"[slurmgate] {m}", file=sys.stderr, flush=True))
        self._on_progress = on_progress
        self.plan = layout_mod.plan(spec)
        self.job_id: str | None = None
        self.owned_allocation = False
        self.layout: layout_mod.Layout | None = None
        self.phase = "new"
        self.status = RunStatus.RUNNING
        self.error: str | None = None
        self.endpoint_metrics: dict[str, str] = {}
        self.t0 = time.monotonic()
        self.timings = _Timings()
        self.supervisor = Supervisor(
            self.run_dir,
            grace_s=grace_s,
            poll_s=0.1,
            on_change=lambda _s: self.save(),
            redact=self.redact,
        )
        self.client_cpus: int | None = spec.client.cpus
        self.probe_origin: str | None = None
        self._prober: readiness.Prober | None = None
        self._close_prober: Callable[[], None] = lambda: None
        self._cleanup_lock = threading.RLock()
        self._cleanup_state = "open"
        self._cleanup_report: CleanupReport | None = None
        # Site hooks run on this host; without a runner from the Prefect layer, the core's own.
        self._hook_runner = hook_runner or (
            lambda invocation: run_plain(invocation, lambda line: self.log(line))
        )
        self.hooks: dict[str, HookOutcome] = {}
        self.save()

    # -- bookkeeping -----------------------------------------------------------------------

    def log(self, message: str) -> None:
        self._log(self.redact(message))

    @property
    def record_path(self) -> Path:
        return self.run_dir / RECORD_NAME

    @property
    def client_reports_dir(self) -> Path:
        return self.run_dir / "client-reports"

    def record(self) -> RunRecord:
        report = getattr(self, "_cleanup_report", None)
        return RunRecord(
            run_id=self.run_id,
            name=self.spec.name,
            job_id=self.job_id,
            owned_allocation=self.owned_allocation,
            hosts=list(self.layout.hosts) if self.layout else [],
            phase=self.phase,
            status=self.status,
            error=self.redact(self.error) if self.error else None,
            **controller_identity(),
            cleanup_complete=report.complete if report else None,
            hooks=dict(getattr(self, "hooks", {})),
            steps=(
                [StepRecord(**step) for step in self.supervisor.records()]
                if hasattr(self, "supervisor")
                else []
            ),
        )

    def save(self) -> None:
        if self.run_dir.exists():
            self.record().write(self.record_path)

    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.save()
        self.log(f"phase {phase}")

    def _base_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """An allow-list of the controller's environment (no credentials, no Slurm step
        shape), then what the runtime and the spec set for this step."""
        bindir = str(Path(self.python).parent)
        named = {
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
            "SLURMGATE_RUN_ID": self.run_id,
            "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1"),
        }
        # slurm.environ adds the SLURM_CONF `slurmgate cluster up` recorded, when none is set:
        # srun needs it, and so does a step that runs Slurm commands itself.
        return step_env(slurm.environ(), {**named, **(extra or {})})

    def _step_name(self, role: str) -> str:
        return f"{self.run_id}-{role}"

    # -- phases ----------------------------------------------------------------------------

    def allocate(self) -> str:
        """Attach to SLURM_JOB_ID, or salloc one that this run owns and always cancels."""
        self._enter("allocate")
        t0 = time.monotonic()
        attached = slurm.current_job_id()
        if attached:
            self.job_id = attached
            self.log(f"decision: attach to allocation {attached} (SLURM_JOB_ID is set)")
        else:
            site = self.spec.slurm
            options = "".join(
                f", {name} {value}"
                for name, value in (
                    ("partition", site.partition),
                    ("account", site.account),
                    ("qos", site.qos),
                    ("reservation", site.reservation),
                    ("constraint", site.constraint),
                )
                if value
            )
            self.log(
                f"decision: no SLURM_JOB_ID, salloc {self.plan.total_nodes} node(s) "
                f"with gpu:{self.spec.gpus_per_node}{options}"
            )
            self.owned_allocation = True  # before the call: a late grant is still ours to cancel
            self.save()
            # wall-clock instants, so a caller can line the grant up with events outside the
            # run (the CI job's dispatch to its runner, in the demo)
            self.timings.marks["salloc_asked_at_epoch"] = time.time()
            self.job_id = slurm.salloc_no_shell(
                **self.salloc_request(), timeout=self.allocate_timeout_s
            )
            self.timings.marks["allocated_at_epoch"] = time.time()
        self.supervisor.job_id = self.job_id
        self.timings.mark("allocated", t0)
        self.save()
        return self.job_id

    def salloc_request(self) -> dict[str, Any]:
        """What `allocate` asks Slurm for when the run owns its allocation (`salloc_argv`)."""
        return {
            "nodes": self.plan.total_nodes,
            "job_name": self.run_id,
            "gpus_per_node": self.spec.gpus_per_node,
            "time_limit": self.spec.time_limit,
            "partition": self.spec.slurm.partition,
            "account": self.spec.slurm.account,
            "qos": self.spec.slurm.qos,
            "reservation": self.spec.slurm.reservation,
            "constraint": self.spec.slurm.constraint,
        }

    def resolve(self) -> layout_mod.Layout:
        """Hosts in allocation order → a bound layout; the node count must match the plan."""
        self._enter("resolve")
        assert self.job_id
        info = slurm.show_job(self.job_id)
        if info is None or not info.nodelist:
            raise RunFailed("resolve", f"allocation {self.job_id} is not running")
        hosts = slurm.show_hostnames(info.nodelist)
        addresses = slurm.node_addresses(hosts)
        try:
            self.layout = layout_mod.bind(self.plan, hosts, addresses)
        except layout_mod.LayoutError as exc:
            raise RunFailed("resolve", str(exc)) from None
        for row in layout_mod.describe(self.layout):
            self.log(
                "decision: lane {deployment} replica {replica} rank {rank} on {node} "
                "gpus {gpus} port {port} rendezvous {rendezvous} delay {delay_s}s".format(**row)
            )
        self.log(f"decision: client and endpoints on {self.layout.client_host}")
        self.save()
        return self.layout

    def _worker_spec(self, d: layout_mod.DeploymentPlan) -> WorkerSpec:
        assert self.layout
        dspec = self.spec.deployments[d.index]
        nodes = []
        for n in d.nodes:
            lanes = []
            address = self.layout.address(n.node)
            for lane in n.lanes:
                master = self.layout.address(lane.rendezvous_node)
                argv = layout_mod.lane_argv(dspec, lane, master, bind_host=address)
                # The deployment's env travels in the step's environment, never in argv
                # (argv is world-readable in /proc and may hold tokens); a lane's own env is
                # only what its engine needs per node (the address it advertises).
                env = engines.profile(dspec.engine).lane_env(address, dspec.env)
                lanes.append(layout_lane(lane, argv, env))
            nodes.append(
                NodeSpec(
                    host=self.layout.host(n.node), ports=list(n.ports), lanes=lanes, address=address
                )
            )
        return WorkerSpec(
            run_id=self.run_id,
            name=d.name,
            gpus_per_node=self.spec.gpus_per_node,
            model_path=self.spec.model_path,
            grace_s=min(self.grace_s, 10.0),
            nodes=nodes,
            model_paths=_command_model_paths(dspec),
        )

    def _client_worker_spec(self) -> WorkerSpec:
        assert self.layout
        ports = sorted(d.endpoint_port for d in self.plan.deployments)
        return WorkerSpec(
            run_id=self.run_id,
            name="client",
            gpus_per_node=0,
            model_path=None,
            grace_s=1.0,
            nodes=[
                NodeSpec(
                    host=self.layout.client_host,
                    ports=ports,
                    lanes=[],
                    address=self.layout.address(self.plan.client_node),
                )
            ],
        )

    def worker_argv(self, name: str, mode: str, nodelist: list[str], gres: str | None) -> list[str]:
        """The srun of one node-worker step: one task per listed node, fail-fast.

        The serve steps of `launch` are exactly this with mode `serve` and the job's GPUs.
        """
        argv = [self.python, "-m", "slurmgate.runtime.node_worker", mode, "--spec", "-"]
        return slurm.srun_argv(
            argv,
            job_id=self.job_id or "",
            nodelist=nodelist,
            step_name=self._step_name(name),
            gres=gres,
            extra=["--input=all"],
        )

    def _start_workers(
        self, name: str, mode: str, ws: WorkerSpec, nodelist: list[str], **step: Any
    ) -> Any:
        """One node-worker srun; its spec goes through stdin (to every task), never argv: the
        lanes' commands are the user's and argv is public in /proc."""
        gres = step.pop("gres")
        return self.supervisor.start(
            name,
            self.worker_argv(name, mode, nodelist, gres),
            step_name=self._step_name(name),
            stdin_data=ws.encode().encode(),
            **step,
        )

    def run_hook(self, name: str, extra: dict[str, str] | None = None) -> HookOutcome | None:
        """Run the spec's hook `name` on this host under its guard (None when unset)."""
        hook = self.spec.hooks.named().get(name)
        if hook is None:
            return None
        named = {"SLURMGATE_HOOK": name, "SLURMGATE_RUN_DIR": str(self.run_dir)}
        if self.job_id:
            named["SLURM_JOB_ID"] = self.job_id
        if self.layout:
            named["SLURMGATE_HOSTS"] = ",".join(self.layout.hosts)
            named["SLURMGATE_CLIENT_HOST"] = self.layout.client_host
        env = self._base_env({**named, **(extra or {}), **self.credentials.hook_env[name]})
        invocation = HookInvocation(
            name, self.run_dir, list(hook.commands), env, hook.timeout_s,
            secrets=sorted(self.credentials.secret_values),
        )  # fmt: skip
        self.log(f"hook {name}: {len(hook.commands)} command(s), {hook.timeout_s:g} s at most")
        try:
            self._hook_runner(invocation)
        except Exception as exc:  # the runner itself failed: the outcome file says the rest
            self.log(f"hook {name}: its runner failed: {type(exc).__name__}: {exc}")
        outcome = self.hooks[name] = invocation.outcome()
        self.save()
        self.log(f"hook {name} {outcome.describe()}; its output: {invocation.log_path}")
        if not outcome.ok and name == "prolog":
            raise RunFailed(
                "prolog",
                f"the prolog {outcome.describe()}; nothing was launched. Its output "
                f"({invocation.log_path}) ends:\n{self.redact(invocation.log_tail())}",
            )
        return outcome

    def prolog(self) -> None:
        """The site's prolog, once the hosts are known and before the preflight: a failure
        stops the run before anything is launched."""
        if "prolog" in self.spec.hooks.named():
            self._enter("prolog")
            self.run_hook("prolog")

    def epilog(self) -> None:
        """The site's epilog, after cleanup: its failure is reported, never raised."""
        if "epilog" not in self.spec.hooks.named() or "epilog" in self.hooks:
            return
        outcome = "failed" if self.error else "succeeded"
        if self._cleanup_report is not None and not self._cleanup_report.complete:
            outcome = "cleanup-failed"
        self.run_hook("epilog", {"SLURMGATE_RUN_OUTCOME": outcome})

    def preflight(self) -> None:
        """Client (zero GPU) first, then every node of every deployment; nothing heavy starts."""
        self._enter("preflight")
        assert self.layout and self.job_id
        t0 = time.monotonic()
        client = self._start_workers(
            "preflight-client",
            "preflight",
            self._client_worker_spec(),
            [self.layout.client_host],
            gres="none",
            env=self._base_env(),
            required=False,
        )
        (report,) = self._expect_ok(client, [self.layout.client_host]).values()
        if self.client_cpus is None:
            self.client_cpus = max(1, min(SEED_CLIENT_CPUS, report.cpus))
            self.log(
                f"decision: the client gets {self.client_cpus} CPU(s): the allocation holds "
                f"{report.cpus} on {report.host}, the default asks for up to {SEED_CLIENT_CPUS}"
            )
        steps = []
        for d in self.plan.deployments:
            steps.append(
                (
                    d,
                    self._start_workers(
                        f"preflight-{d.name}",
                        "preflight",
                        self._worker_spec(d),
                        self.layout.nodelist(d),
                        gres=None,
                        env=self._base_env(self.credentials.deployment_env[d.index]),
                        required=False,
                    ),
                )
            )
        for d, step in steps:
            self._expect_ok(step, self.layout.nodelist(d))
        self.timings.mark("preflight_done", t0)
        self.log(f"preflight passed on {len(self.layout.hosts)} node(s)")

    def _expect_ok(self, step: Any, planned: list[str]) -> dict[str, NodeReport]:
        """The preflight step passed, and each planned node reported from itself."""
        rc = self.supervisor.wait(step, timeout=PREFLIGHT_TIMEOUT_S)
        tail = step.log_tail(4000 + 200 * len(planned))
        if rc == 0:
            return preflight_reports(tail, planned, step.name)
        problem = self.interpreter_problem(tail)
        if problem:
            raise RunFailed("preflight", problem)
        found = _PREFLIGHT_LINE.findall(tail)
        if found:
            host, check, message = found[0]
            raise RunFailed("preflight", f"node {host}: check {check}: {message}")
        raise RunFailed("preflight", f"{step.name} exited {rc}: {tail.strip()[-600:]}")

    def interpreter_problem(self, log: str) -> str | None:
        """The node-side interpreter could not run, or has no slurmgate: a message naming
        the spec's `python` field and the fix; None for any other failure."""
        exec_failed = _EXEC_FAILED.search(log)
        if exec_failed and exec_failed.group("path") == self.python:
            node = exec_failed.group("node") or "a node"
            cause = f"cannot run on {node} ({exec_failed.group('reason').strip()})"
        elif _NO_SLURMGATE.search(log):
            cause = "has no slurmgate package on the nodes"
        else:
            return None
        if self.spec.python:
            return (
                f"python: {self.python} {cause} — fix: set the spec's `python` to an "
                "interpreter with slurmgate installed at that path on every node"
            )
        return (
            f"python: the controller's interpreter {self.python} {cause} — fix: install the "
            "same environment at the same path on the compute nodes, or set the spec's "
            "`python` to one that is there"
        )

    def launch(self) -> None:
        """One coordinated srun per deployment, one node worker per node, fail-fast."""
        self._enter("launch")
        assert self.layout and self.job_id
        self.launched_at = time.monotonic()
        for d in self.plan.deployments:
            nodelist = self.layout.nodelist(d)
            self.log(f"decision: launch {d.name} as one srun on {','.join(nodelist)}")
            self._start_workers(
                f"serve-{d.name}",
                "serve",
                self._worker_spec(d),
                nodelist,
                gres=None,
                env=self._base_env(self.credentials.deployment_env[d.index]),
                required=True,
            )
        self.supervisor.resolve_step_ids(timeout=3.0)
        self.save()

    def wait_ready(self) -> float:
        """Poll every lane head until ready; a dead step fails at once, a deadline fails late."""
        self._enter("readiness")
        assert self.layout
        targets: list[readiness.Target] = []
        for d in self.plan.deployments:
            dspec = self.spec.deployments[d.index]
            models, lists_model = engines.profile(dspec.engine).models_probe(dspec.command)
            for lane, url in zip(d.heads, self.layout.head_urls(d), strict=True):
                targets.append(
                    readiness.Target(
                        name=lane.process_id,
                        base_url=url,
                        path=dspec.readiness_path,
                        deadline=self.launched_at + lane.delay_s + dspec.startup_timeout_s,
                        needed=dspec.ready_probes,
                        models=models,
                        lists_model=lists_model,
                    )
                )
        probe_timeout = min(d.probe_timeout_s for d in self.spec.deployments)

        def progress(ready: int, total: int) -> None:
            self.log(f"readiness: {ready}/{total} lane heads ready")
            if self._on_progress:
                self._on_progress("lanes", ready, total)

        # The probe step lives through the endpoints' start too: bound it by both.
        last = max(t.deadline for t in targets) - time.monotonic()
        try:
            prober = self.open_prober(last + ENDPOINT_STARTUP_S + 60.0)
            seconds = readiness.wait_ready(
                targets,
                probe_timeout=probe_timeout,
                poll_s=self.poll_s,
                check_alive=self.supervisor.check_required,
                on_progress=progress,
                prober=prober,
            )
        except (readiness.ReadinessTimeout, StepFailed, ProbeStepFailed) as exc:
            raise RunFailed("readiness", str(exc)) from None
        self.timings.mark("lanes_ready", self.launched_at)
        self.timings.mark("lanes_ready_since_start", self.t0)
        self.timings.marks["lanes_ready_at_epoch"] = time.time()
        return seconds

    def start_endpoints(self) -> None:
        """One logical endpoint step per deployment on the client host; wait for /health 200."""
        self._enter("endpoints")
        assert self.layout and self.job_id
        targets = []
        for d in self.plan.deployments:
            dspec = self.spec.deployments[d.index]
            config = EndpointConfig(
                name=d.name,
                host=self.layout.address(self.plan.client_node),
                port=d.endpoint_port,
                backends=self.layout.head_urls(d),
                max_waiting=dspec.backpressure.max_waiting_requests,
                retry_after=dspec.backpressure.retry_after_s,
                backend_health_path=dspec.readiness_path,
                queue_waiting_metric=engines.profile(dspec.engine).queue.waiting,
                queue_running_metric=engines.profile(dspec.engine).queue.running,
            )
            argv = [self.python, "-m", "slurmgate.runtime.endpoint", *config.argv()]
            self.supervisor.start(
                f"endpoint-{d.name}",
                slurm.srun_argv(
                    argv,
                    job_id=self.job_id,
                    nodelist=[self.layout.client_host],
                    step_name=self._step_name(f"endpoint-{d.name}"),
                    gres="none",
                ),
                env=self._base_env(self._token_env()),
                step_name=self._step_name(f"endpoint-{d.name}"),
                required=True,
            )
            targets.append(
                readiness.Target(
                    name=f"endpoint {d.name}",
                    base_url=self.layout.endpoint_url(d),
                    deadline=time.monotonic() + ENDPOINT_STARTUP_S,
                    models=False,
                )
            )
        self.supervisor.resolve_step_ids(timeout=3.0)
        try:
            readiness.wait_ready(
                targets,
                probe_timeout=1.0,
                poll_s=0.1,
                check_alive=self.supervisor.check_required,
                prober=self.open_prober(ENDPOINT_STARTUP_S + 60.0),
            )
        except (readiness.ReadinessTimeout, StepFailed, ProbeStepFailed) as exc:
            raise RunFailed("endpoints", str(exc)) from None
        finally:
            self.shut_prober()
        for d in self.plan.deployments:
            self.log(f"endpoint {d.name} ready at {self.layout.endpoint_url(d)}")

    def _token_env(self) -> dict[str, str]:
        token = self.credentials.endpoint_token
        # The endpoints read it from there (never argv), and so does the client.
        return {TOKEN_ENV: token} if token else {}

    def client_env(self) -> dict[str, str]:
        assert self.layout
        urls = {d.name: self.layout.endpoint_url(d) for d in self.plan.deployments}
        env = {env_name(name): url for name, url in urls.items()}
        env["SLURMGATE_ENDPOINTS"] = json.dumps(urls, sort_keys=True)
        env["OPENAI_BASE_URL"] = next(iter(urls.values())) + "/v1"
        env[CLIENT_REPORTS_ENV] = str(self.client_reports_dir)
        env.update(self.credentials.client_env)
        env.update(self._token_env())
        return env

    def run_client(self) -> int:
        """The client step on the client host; the run fails if it fails or a server dies."""
        self._enter("client")
        assert self.layout and self.job_id
        step = self.supervisor.start(
            "client",
            slurm.srun_argv(
                list(self.spec.client.command),
                job_id=self.job_id,
                nodelist=[self.layout.client_host],
                step_name=self._step_name("client"),
                gres="none",
                cpus_per_task=self.client_cpus,
            ),
            env=self._base_env(self.client_env()),
            step_name=self._step_name("client"),
            required=False,
        )
        # Its output reaches the run's log (the console and Prefect) as it comes; the whole
        # of it stays in the step's log file.
        echo = OutputEcho(step.log_path, lambda line: self.log(f"client| {line}"))
        try:
            rc = self.supervisor.wait(step, on_poll=echo.poll)
        except StepFailed as exc:
            raise RunFailed("client", f"{exc}; its output: {step.log_path}") from None
        finally:
            echo.finish()
        if rc != 0:
            raise RunFailed(
                "client",
                f"client exited {rc}; its output: {step.log_path}, which ends:\n"
                + step.log_tail(600),
            )
        self.log(f"client succeeded; its output: {step.log_path}")
        return rc

    def collect_endpoint_metrics(self) -> dict[str, str]:
        """The endpoints' Prometheus text, fetched before they stop.

        Straight from this process first, with a short timeout: after the client the numbers
        are optional, and a new probe step costs an srun, which a slow or stuck slurmctld can
        hold up for its whole start-up budget. Only endpoints this process cannot reach are
        read through a probe step on the client host.
        """
        if not self.layout:
            return {}
        token = self.credentials.endpoint_token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        urls = {d.name: self.layout.endpoint_url(d) + "/metrics" for d in self.plan.deployments}
        with httpx.Client(trust_env=False) as http:
            direct = readiness.LocalProber(http)
            for name, url in urls.items():
                text = direct.fetch(url, headers, DIRECT_METRICS_TIMEOUT_S)
                if text is not None:
                    self.endpoint_metrics[name] = text
        missing = {name: url for name, url in urls.items() if name not in self.endpoint_metrics}
        if not missing:
            return self.endpoint_metrics
        try:
            prober = self.open_prober(60.0, hello_timeout_s=METRICS_HELLO_TIMEOUT_S)
            for name, url in missing.items():
                text = prober.fetch(url, headers, 2.0)
                if text is not None:
                    self.endpoint_metrics[name] = text
        except (StepFailed, ProbeStepFailed) as exc:
            self.log(f"endpoint metrics not collected: {exc}")
        finally:
            self.shut_prober()
        return self.endpoint_metrics

    # -- where probes run ------------------------------------------------------------------

    def open_prober(
        self, lifetime_s: float, hello_timeout_s: float = HELLO_TIMEOUT_S
    ) -> readiness.Prober:
        """Probes from the client host: in this process when it runs there, else one
        long-lived step there (reused until `shut_prober`), bounded by `lifetime_s`."""
        if self._prober is not None:
            return self._prober
        assert self.layout and self.job_id
        client_host = self.layout.client_host
        if controller_on(client_host):
            http = httpx.Client(trust_env=False)
            self._prober, self._close_prober = readiness.LocalProber(http), http.close
            if self.probe_origin is None:
                self.log(f"decision: probes run in the controller, which is on {client_host}")
            self.probe_origin = client_host
            return self._prober
        minutes = max(1, math.ceil(lifetime_s / 60.0))
        name = "probe"
        step = self.supervisor.start(
            name,
            slurm.srun_argv(
                [self.python, "-m", "slurmgate.runtime.probe_step"],
                job_id=self.job_id,
                nodelist=[client_host],
                step_name=self._step_name(name),
                gres="none",
                extra=[f"--time={minutes}"],
            ),
            env=self._base_env(),
            step_name=self._step_name(name),
            required=False,
            pipes=True,
        )
        assert step.popen.stdin is not None and step.popen.stdout is not None

        def describe() -> str:
            step.popen.poll()
            return f"status {step.returncode()}; log tail: {step.log_tail(600).strip()}"

        channel = ProbeChannel(step.popen.stdin, step.popen.stdout, describe)

        def close() -> None:
            channel.close()
            if step.popen.stdout is not None:
                step.popen.stdout.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                step.popen.wait(timeout=5.0)

        self._prober, self._close_prober = channel, close
        origin = channel.hello(hello_timeout_s)
        if origin != client_host:
            raise ProbeStepFailed(
                f"the probe step ran on {origin}, not on the client host {client_host}"
            )
        if self.probe_origin is None:
            self.log(
                f"decision: probes run on the client host {origin} in one step for "
                f"{minutes} min at most (the controller is on {node_name()})"
            )
        self.probe_origin = origin
        return self._prober

    def shut_prober(self) -> None:
        """Close the probe step's input (it exits) or the in-process client; idempotent."""
        close, self._close_prober = self._close_prober, lambda: None
        self._prober = None
        close()

    # -- cleanup ---------------------------------------------------------------------------

    @property
    def cleaned(self) -> bool:
        return self._cleanup_state == "closed"

    def cleanup(self) -> CleanupReport:
        """Stop every step (reverse order), release an owned allocation, verify. Exactly once."""
        if self._cleanup_state == "cleaning":
            return self._cleanup_report or CleanupReport()
        # Signals wait until the allocation is released too; the first is re-raised after.
        with DEFER.hold(), self._cleanup_lock:
            if self._cleanup_state == "closed" and self._cleanup_report is not None:
                return self._cleanup_report
            self._cleanup_state = "cleaning"
            prev_phase = self.phase
            self.phase = f"cleanup (after {prev_phase})"
            self.save()
            t0 = time.monotonic()
            report = self.supervisor.cleanup()
            self._cleanup_report = report
            try:
                if self.owned_allocation and not self.job_id:
                    # salloc failed or timed out: a request may still be pending under our name.
                    slurm.scancel_by_name(self.run_id)
                    report.actions.append(f"scancel --name={self.run_id} (no job id granted)")
                if self.job_id and self.owned_allocation:
                    self._release(report)
                elif self.job_id:
                    self._verify_steps_gone(report)
            except slurm.SlurmError as exc:
                # Unverified is not clean: the record must stay reapable and the run must fail.
                where = f"allocation {self.job_id}" if self.job_id else f"job name {self.run_id}"
                report.survivors.append(f"{where}: cleanup not verified: {exc}")
            finally:
                self.timings.mark("cleanup", t0)
                self._cleanup_state = "closed"
                self.status = RunStatus.CLEAN if report.complete else RunStatus.CLEANUP_FAILED
                self.save()
            for action in report.actions:
                self.log(f"cleanup: {action}")
            self.log(
                f"cleanup {'complete' if report.complete else 'FAILED'} in {report.seconds:.2f} s"
            )
            self.epilog()  # bounded by its timeout; signals still wait
            return report

    def _release(self, report: CleanupReport) -> None:
        assert self.job_id
        try:
            slurm.scancel(self.job_id)
            report.actions.append(f"scancel {self.job_id} (owned allocation)")
        except slurm.SlurmError as exc:
            report.survivors.append(f"allocation {self.job_id}: {exc}")
            return
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = slurm.show_job(self.job_id)
            if info is None or info.state not in {"RUNNING", "PENDING", "CONFIGURING"}:
                report.actions.append(
                    f"allocation {self.job_id} {info.state if info else 'gone'} "
                    f"after {time.monotonic() - deadline + 20:.2f} s"
                )
                return
            time.sleep(0.1)
        report.survivors.append(f"allocation {self.job_id} still running 20 s after scancel")

    def _verify_steps_gone(self, report: CleanupReport) -> None:
        assert self.job_id
        deadline = time.monotonic() + 10
        while True:
            mine = [s for s in slurm.list_steps(self.job_id) if s.name.startswith(self.run_id)]
            if not mine:
                return
            if time.monotonic() >= deadline:
                report.survivors += [f"step {s.step_id} ({s.name})" for s in mine]
                return
            for s in mine:
                with contextlib.suppress(slurm.SlurmError):
                    slurm.scancel(s.step_id)
            time.sleep(0.2)

    # -- the whole run ---------------------------------------------------------------------

    def until_ready(self) -> float:
        """Allocate, resolve, preflight and launch, then wait for every lane; its seconds."""
        self.allocate()
        self.resolve()
        self.prolog()
        self.preflight()
        self.launch()
        return self.wait_ready()

    def run(self) -> RunResult:
        """Every phase in order; cleanup on every path; a failed cleanup fails the run."""
        failure: BaseException | None = None
        try:
            self.until_ready()
            self.start_endpoints()
            self.run_client()
            self.collect_endpoint_metrics()
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self.finish(failure)
        return self.result()

    def note_failure(self, failure: BaseException) -> None:
        """Record the first failure and the phase it hit (before cleanup moves the phase)."""
        if self.error is None:
            self.error = self.redact(f"{type(failure).__name__}: {failure}")
            self.log(f"run failed in phase {self.phase}: {self.error}")
            self.save()

    def finish(self, failure: BaseException | None) -> None:
        """Cleanup, then settle the status; raises CleanupFailed if cleanup was incomplete."""
        with DEFER.hold():
            if failure is not None:
                self.note_failure(failure)
            report = self.cleanup()
            if not report.complete:
                self.status = RunStatus.CLEANUP_FAILED
            else:
                self.status = RunStatus.FAILED if self.error else RunStatus.SUCCEEDED
            self.save()
        if not report.complete:
            raise CleanupFailed("cleanup left survivors: " + "; ".join(report.survivors))

    def result(self) -> RunResult:
        return RunResult(
            run_id=self.run_id,
            ok=self.status == RunStatus.SUCCEEDED,
            error=self.error,
            job_id=self.job_id,
            hosts=list(self.layout.hosts) if self.layout else [],
            timings=dict(self.timings.marks),
            endpoint_metrics=dict(self.endpoint_metrics),
            cleanup=list(self._cleanup_report.actions if self._cleanup_report else []),
            record_path=str(self.record_path),
            hooks={name: outcome.describe() for name, outcome in self.hooks.items()},
            hooks_failed=[name for name, outcome in self.hooks.items() if not outcome.ok],
        )


def _command_model_paths(dspec: DeploymentSpec) -> list[str]:
    """The absolute model path the deployment's command loads, as its engine reads it."""
    path = engines.profile(dspec.engine).model_path(dspec.command)
    return [path] if path else []


def layout_lane(lane: layout_mod.LanePlan, argv: list[str], env: dict[str, str]) -> Any:
    from slurmgate.runtime.node_worker import LaneSpec

    return LaneSpec(
        id=lane.process_id, argv=argv, gpus=list(lane.gpus), delay_s=lane.delay_s, env=dict(env)
    )


# -- a prefect-free entry point ---------------------------------------------------------------


class Terminated(BaseException):
    """SIGTERM/SIGINT reached the controller."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m slurmgate.runtime.run",
        description="Run an allocation spec without Prefect, or reap what killed runs left.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run SPEC: every phase, then cleanup")
    run.add_argument("spec", type=Path, help="the allocation spec (YAML)")
    reap = commands.add_parser("reap", help="cancel the leftovers of runs whose controller died")
    for sub in (run, reap):
        sub.add_argument("--runs-dir", type=Path, default=None, help="run directories")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m slurmgate.runtime.run run SPEC [--runs-dir D]`: the run without Prefect."""
    from slurmgate.runtime.reaper import reap_stale_runs
    from slurmgate.runtime.records import load_records
    from slurmgate.runtime.spec import SpecError

    args = _parser().parse_args(argv)
    if args.command == "reap":
        tally = reap_stale_runs(load_records(args.runs_dir), wait_out_backoff=False, info=print)
        if tally.slurm_error:
            print(f"reap stopped, Slurm did not answer: {tally.slurm_error}", file=sys.stderr)
            return 1
        return 0
    try:
        spec = AllocationSpec.from_yaml(args.spec)
    except SpecError as exc:
        print(f"invalid spec:\n{exc}", file=sys.stderr)
        return 2
    try:
        run = AllocationRun(spec, runs_root=args.runs_dir)
    except InputError as exc:  # a secret reference this host cannot resolve
        print(f"invalid spec:\n{exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGINT, _raise_terminated)
    print(f"run {run.run_id}: record {run.record_path}", file=sys.stderr, flush=True)
    try:
        run.run()
    except Terminated as exc:
        print(f"run {run.run_id} terminated by {exc}; cleanup done", file=sys.stderr)
        return 128 + exc.signum
    except (RunFailed, StepFailed, CleanupFailed, slurm.SlurmError) as exc:
        print(f"run {run.run_id} failed: {exc}", file=sys.stderr)
        return 1
    print(f"run {run.run_id} succeeded", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Node failures: which one node a failed run blames, whether it retries without it, the drain.

Policy (`blame`, `retry_decision`) is pure: it reads the failed phase and the failed steps'
logs, the node workers' messages in them (`steps/protocol.py`) and what srun itself said there.
Mechanism (`run_with_node_retry`, the drain) goes through the run's own phases and the real
`scontrol`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from slurmgate.errors import InputError, one_line
from slurmgate.runtime.ledger.records import NodeFailure
from slurmgate.runtime.steps import protocol
from slurmgate.settings.runtime import NodeRetrySettings
from slurmgate.slurm import commands as slurm

if TYPE_CHECKING:
    from slurmgate.runtime.run.allocation_run import AllocationRun

# A lane that dies this soon after it started is taken for a bad command (an engine fails on
# a wrong flag or model while it starts, on every node alike), never for its node.
LANE_CRASH_MIN_UPTIME_S = 60.0
# Preflight checks whose failure says nothing about the node: the srun or the plan is wrong.
_PLAN_CHECKS = frozenset({"identity", "ntasks", "hostname"})
DRAIN_REASON_MAX = 120

# What srun says when it cannot reach a node's slurmd, or Slurm lost the node under the step.
_UNREACHABLE = re.compile(
    r"srun: error: (?:Task launch for \S+ failed on node (\S+?):|Node failure on (\S+))(.*)$",
    re.M,
)

Kind = Literal["preflight", "unreachable", "lane-crash"]


@dataclass(frozen=True)
class StepOutcome:
    """One node-worker step of a failed run: its name, planned nodes, exit status and log."""

    name: str
    nodes: tuple[str, ...]
    returncode: int | None
    log: str


@dataclass(frozen=True)
class Blame:
    """The one node a failure is attributed to (`node`), or why none is (`why_not`)."""

    node: str | None
    reason: str
    kind: Kind | None = None

    @property
    def attributed(self) -> bool:
        return self.node is not None


def _not_attributed(why: str) -> Blame:
    return Blame(node=None, reason=why)


def _preflight_faults(
    step: StepOutcome,
) -> tuple[dict[str, tuple[Kind, str]], list[str], list[str]]:
    """Per failed node of one preflight step: (kind, reason); plan-level check failures; nodes
    that reported nothing at all."""
    faults: dict[str, tuple[Kind, str]] = {}
    plan_level: list[str] = []
    for failed in protocol.messages(step.log, protocol.PreflightCheckFailed):
        text = f"preflight check {failed.check} failed: {failed.detail.strip()}"
        if failed.check in _PLAN_CHECKS:
            plan_level.append(f"{failed.host}: {text}")
        elif failed.host in step.nodes:
            faults.setdefault(failed.host, ("preflight", text))
    for first, second, rest in _UNREACHABLE.findall(step.log):
        host = first or second
        if host in step.nodes:
            faults.setdefault(
                host, ("unreachable", f"unreachable: srun: {rest.strip() or 'node failure'}")
            )
    ok = {passed.host for passed in protocol.messages(step.log, protocol.PreflightPassed)}
    silent = [n for n in step.nodes if n not in ok and n not in faults]
    return faults, plan_level, silent


def _lane_faults(step: StepOutcome) -> tuple[dict[str, tuple[Kind, str]], list[str]]:
    """Per node of one serve step: a lane that exited on its own, or a node Slurm lost; plus
    why the step's failure cannot be the node's (a lane that died young, one that could not
    start)."""
    faults: dict[str, tuple[Kind, str]] = {}
    refusals: list[str] = []
    for refused in protocol.messages(step.log, protocol.LaneSpawnFailed):
        refusals.append(f"lane {refused.lane} on {refused.host} could not start (its command)")
    for exited in protocol.messages(step.log, protocol.LaneExited):
        host, lane, status, uptime = exited.host, exited.lane, exited.status, exited.uptime_s
        if host not in step.nodes:
            continue
        if uptime < LANE_CRASH_MIN_UPTIME_S:
            refusals.append(
                f"lane {lane} on {host} exited {status} after {uptime:.1f} s, before "
                f"{LANE_CRASH_MIN_UPTIME_S:.0f} s: taken for its command, not its node"
            )
            continue
        faults.setdefault(
            host, ("lane-crash", f"lane {lane} crashed (status {status}) after {uptime:.1f} s")
        )
    for first, second, rest in _UNREACHABLE.findall(step.log):
        host = first or second
        if host in step.nodes:
            faults[host] = ("unreachable", f"unreachable: srun: {rest.strip() or 'node failure'}")
    return faults, refusals


def blame(phase: str, steps: Sequence[StepOutcome]) -> Blame:
    """The one node the failure of `phase` is attributed to, from the failed steps' logs.

    Preflight: exactly one node failed a node check (GPUs, ports, model path) or was
    unreachable, and every other planned node of every failed step reported its preflight
    passed. Later phases: exactly one node of a serve step spanning several nodes lost a lane
    that had run at least LANE_CRASH_MIN_UPTIME_S (or Slurm lost the node), while the step's
    other nodes had their lanes running. Anything else (a bad spec, a client failure, a
    timeout, several nodes, a node that said nothing) blames no node.
    """
    failed = [s for s in steps if s.returncode not in (None, 0)]
    if phase == "preflight":
        return _blame_preflight(failed)
    if phase in {"launch", "readiness", "endpoints", "client"}:
        return _blame_lanes([s for s in failed if s.name.startswith("serve-")])
    return _not_attributed(f"a failure in phase {phase} is not a node's")


def _blame_preflight(failed: Sequence[StepOutcome]) -> Blame:
    if not failed:
        return _not_attributed("no preflight step failed on a node")
    faults: dict[str, tuple[Kind, str]] = {}
    for step in failed:
        step_faults, plan_level, silent = _preflight_faults(step)
        if plan_level:
            return _not_attributed(f"{step.name}: {plan_level[0]} (the plan or srun, not a node)")
        if silent:
            return _not_attributed(
                f"{step.name}: {', '.join(silent)} reported nothing: the failure is not one node's"
            )
        if not step_faults:
            return _not_attributed(f"{step.name} exited {step.returncode} with no node named")
        for host, fault in step_faults.items():
            faults.setdefault(host, fault)
    return _one_node(faults)


def _blame_lanes(failed: Sequence[StepOutcome]) -> Blame:
    if not failed:
        return _not_attributed("no serve step failed: the failure is not a node's")
    faults: dict[str, tuple[Kind, str]] = {}
    for step in failed:
        step_faults, refusals = _lane_faults(step)
        if refusals:
            return _not_attributed(f"{step.name}: {refusals[0]}")
        if not step_faults:
            return _not_attributed(f"{step.name} exited {step.returncode} with no node named")
        for host, (kind, reason) in step_faults.items():
            if kind == "lane-crash":
                others = [n for n in step.nodes if n != host]
                started = {m.host for m in protocol.messages(step.log, protocol.LaneStarted)}
                if not others or any(n not in started for n in others):
                    return _not_attributed(
                        f"{step.name}: {reason}, but no other node of the step ran the same "
                        "lanes: the command may be at fault"
                    )
            faults.setdefault(host, (kind, reason))
    return _one_node(faults)


def _one_node(faults: Mapping[str, tuple[Kind, str]]) -> Blame:
    if len(faults) == 1:
        ((host, (kind, reason)),) = faults.items()
        return Blame(node=host, reason=reason, kind=kind)
    named = "; ".join(f"{h}: {r}" for h, (_, r) in sorted(faults.items()))
    return _not_attributed(f"{len(faults)} nodes failed ({named}): not one node's fault")


@dataclass(frozen=True)
class RetryDecision:
    """Whether a failed run is tried again, on which nodes not, and why (or why not)."""

    retry: bool
    exclude: tuple[str, ...]
    why: str


def retry_decision(
    found: Blame, *, owned_allocation: bool, excluded: Sequence[str], enabled: bool
) -> RetryDecision:
    """Once, on a new allocation without the blamed node, and only for an allocation the run
    made itself: one it attached to (SLURM_JOB_ID) has its nodes fixed by whoever made it."""
    if not found.attributed or found.node is None:
        return RetryDecision(False, tuple(excluded), f"not retried: {found.reason}")
    if not enabled:
        return RetryDecision(False, tuple(excluded), "not retried: node retries are off")
    if excluded:
        return RetryDecision(
            False,
            tuple(excluded),
            f"not retried: this was the retry without {', '.join(excluded)}; once is the limit",
        )
    if not owned_allocation:
        return RetryDecision(
            False,
            (found.node,),
            "not retried: the run attached to an allocation it did not make; submit the job "
            f"again with --exclude={found.node}",
        )
    return RetryDecision(
        True, (found.node,), f"retried once on a new allocation without {found.node}"
    )


# -- settings ----------------------------------------------------------------------------

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class NodeFailureSettingError(InputError):
    """A node-failure variable that is not a yes/no."""


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise NodeFailureSettingError(f"{name}={raw[:40]!r} is not a yes/no: set it to 1 or 0")


@dataclass(frozen=True)
class NodeFailureSettings:
    """`SLURMGATE_NODE_RETRY` (on by default) and `SLURMGATE_DRAIN_FAILED_NODES` (off)."""

    retry: bool = True
    drain: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeFailureSettings:
        e = NodeRetrySettings.environ() if env is None else env
        return cls(
            retry=_flag(e, "SLURMGATE_NODE_RETRY", True),
            drain=_flag(e, "SLURMGATE_DRAIN_FAILED_NODES", False),
        )


# -- mechanism ---------------------------------------------------------------------------


def step_outcomes(run: AllocationRun) -> list[StepOutcome]:
    """The run's node-worker steps, each with the nodes it was planned on, its exit status when
    the run failed (None: still running) and its log's end."""
    if run.layout is None:
        return []
    planned: dict[str, tuple[str, ...]] = {"preflight-client": (run.layout.client_host,)}
    for d in run.plan.deployments:
        nodes = tuple(run.layout.nodelist(d))
        planned[f"preflight-{d.name}"] = nodes
        planned[f"serve-{d.name}"] = nodes
    return [
        StepOutcome(
            name=s.name,
            nodes=planned[s.name],
            # as it was when the run failed: cleanup stops every step, failed or not
            returncode=run.exits_at_failure.get(s.name, s.returncode()),
            log=s.log_tail(8000 + 400 * len(planned[s.name])),
        )
        for s in run.supervisor.steps
        if s.name in planned
    ]


def drain_reason(run_id: str, reason: str) -> str:
    """The drain's reason as `sinfo -R` shows it: the run and the failure, on one short line."""
    return " ".join(f"slurmgate {run_id}: {reason}".split())[:DRAIN_REASON_MAX]


@dataclass
class NodeRetry:
    """The node-failure handling of one allocation: settings, and a line per decision."""

    settings: NodeFailureSettings = field(default_factory=NodeFailureSettings.from_env)
    log: Callable[[str], Any] = print

    def judge(self, run: AllocationRun) -> RetryDecision:
        """Blame a node for the failed `run`, record it, drain it if asked; retry or not."""
        phase = run.failed_phase or run.phase
        found = blame(phase, step_outcomes(run))
        decision = retry_decision(
            found,
            owned_allocation=run.owned_allocation,
            excluded=run.excluded_nodes,
            enabled=self.settings.retry,
        )
        if found.node is None:
            self.log(f"node failure: none blamed, {decision.why}")
            return decision
        failure = NodeFailure(node=found.node, reason=found.reason, kind=found.kind or "preflight",
                              retried=decision.retry, decision=decision.why)  # fmt: skip
        if self.settings.drain:
            failure.drain = self._drain(found.node, drain_reason(run.run_id, found.reason))
        run.node_failure = failure
        run.save()
        self.log(f"node failure: {found.node}: {found.reason}; {decision.why}"
                 + (f"; drain: {failure.drain}" if failure.drain else ""))  # fmt: skip
        return decision

    def _drain(self, node: str, reason: str) -> str:
        try:
            slurm.drain_node(node, reason)
        except slurm.SlurmError as exc:
            return f"failed: {one_line(exc)}"
        return f"drained (reason={reason!r})"


def run_with_node_retry(
    attempt: Callable[[tuple[str, ...], str | None], tuple[AllocationRun, BaseException | None]],
    retry: NodeRetry,
) -> AllocationRun:
    """The run, and once more on an allocation without the node it blames; raises the last
    failure. `attempt(exclude, retry_of)` runs one allocation to its end and cleanup, and
    returns the run and what failed it (an exception that is not an Exception propagates)."""
    run, failure = attempt((), None)
    if failure is None:
        return run
    decision = retry.judge(run)
    if not decision.retry:
        raise failure
    second, failure = attempt(decision.exclude, run.run_id)
    run.retried_as = second.run_id
    run.save()
    if failure is None:
        return second
    retry.judge(second)
    raise failure

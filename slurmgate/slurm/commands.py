"""Typed wrappers of the real Slurm commands, each with a timeout; errors carry the command."""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slurmgate.errors import ExternalError
from slurmgate.slurm.jobenv import command_environment, slurm_variable

DEFAULT_TIMEOUT_S = 30.0
# What every Slurm client command prints when it finds neither SLURM_CONF, nor
# /etc/slurm/slurm.conf, nor a configless controller (DNS SRV record).
NO_CONFIGURATION_MARK = "Could not establish a configuration source"
NO_CONFIGURATION = (
    "Slurm has no configuration: export SLURM_CONF=/path/to/slurm.conf, "
    "or start the bundled cluster with `slurmgate cluster up`"
)


class SlurmError(ExternalError):
    """A Slurm command failed or timed out; carries the argv and its stderr."""

    def __init__(
        self, argv: Sequence[str], message: str, stderr: str = "", *, timed_out: bool = False
    ) -> None:
        self.argv = list(argv)
        self.stderr = stderr
        self.timed_out = timed_out
        detail = f": {stderr.strip()[-800:]}" if stderr.strip() else ""
        super().__init__(f"`{shlex.join(self.argv)}` {message}{detail}")


class SlurmNotConfigured(SlurmError):
    """Slurm's client commands have no configuration source; the message is the fix."""

    def __init__(self, argv: Sequence[str], stderr: str = "", message: str = "") -> None:
        self.argv = list(argv)
        self.stderr = stderr
        self.timed_out = False
        # One line with the fix: the argv and Slurm's four lines of DNS lookups add nothing.
        ExternalError.__init__(self, message or NO_CONFIGURATION)


def missing_conf_message(conf: str) -> str:
    """The one-line fix for a SLURM_CONF that names no file."""
    return (
        f"SLURM_CONF names {conf}, which does not exist: export SLURM_CONF=/path/to/slurm.conf, "
        "or start the bundled cluster with `slurmgate cluster up`"
    )


def environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment), with the SLURM_CONF that `slurmgate
    cluster up` recorded when `base` sets none: a SLURM_CONF the user set always wins."""
    env = command_environment(base)
    if not env.get("SLURM_CONF"):
        # Imported here: the node worker reaches this module through the supervisor and
        # must start without pydantic; only a controller with no SLURM_CONF needs the record.
        from slurmgate.slurm.config import recorded_slurm_conf

        conf = recorded_slurm_conf()
        if conf:
            env["SLURM_CONF"] = conf
    return env


def run(
    argv: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run one short Slurm command; raise SlurmError on timeout or (with check) non-zero exit.

    Without a configuration source it raises SlurmNotConfigured even when `check` is off: an
    empty answer would otherwise read as "no steps left" or "job gone".
    """
    child_env = environ(env)
    conf = child_env.get("SLURM_CONF")
    if conf and not os.path.exists(conf):
        # Slurm's clients retry a missing SLURM_CONF once a second for 60 s before failing:
        # every capacity read of every tick would stall for its whole timeout.
        raise SlurmNotConfigured(argv, message=missing_conf_message(conf))
    try:
        out = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=child_env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise SlurmError(argv, f"timed out after {timeout:g} s", stderr, timed_out=True) from None
    except FileNotFoundError:
        raise SlurmError(
            argv,
            "not found: install the Slurm client (Debian: slurm-client) and put it on PATH, or "
            "start the bundled cluster with `slurmgate cluster up`",
        ) from None
    if out.returncode != 0 and NO_CONFIGURATION_MARK in out.stderr:
        raise SlurmNotConfigured(argv, out.stderr)
    if check and out.returncode != 0:
        raise SlurmError(argv, f"exited {out.returncode}", out.stderr)
    return out


class SlurmControllerDown(SlurmError):
    """Slurm has a configuration, but no controller of it answers; the message is the fix."""


def check_configured(*, timeout: float = 10.0) -> None:
    """Before anything slow starts: raise SlurmNotConfigured without a configuration source,
    SlurmControllerDown when no controller answers, SlurmError when there is no client.

    One `scontrol ping`, which answers in milliseconds in all three cases. A backup
    controller that is down while the primary is up is not a reason to stop.
    """
    argv = ["scontrol", "ping"]
    out = run(argv, timeout=timeout, check=False)
    if out.returncode != 0 and " is UP" not in out.stdout:
        status = " ".join(
            line.strip() for line in out.stdout.splitlines() if line.startswith("Slurmctld")
        )
        conf = environ().get("SLURM_CONF") or "Slurm's default configuration"
        raise SlurmControllerDown(
            argv,
            f"found no Slurm controller that answers ({status or 'no answer'}, from {conf}): "
            "start slurmctld, or the bundled cluster with `slurmgate cluster up`",
        )


def show_hostnames(nodelist: str, *, timeout: float = 10.0) -> list[str]:
    """Expand a Slurm node list (e.g. node[1-3]) in allocation order."""
    out = run(["scontrol", "show", "hostnames", nodelist], timeout=timeout)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def _kv(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for token in text.split():
        if "=" in token:
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
    return fields


@dataclass(frozen=True)
class JobInfo:
    """The fields of `scontrol show job` the runtime uses."""

    job_id: str
    state: str
    nodelist: str
    num_nodes: int
    name: str

    @property
    def active(self) -> bool:
        return self.state in {"RUNNING", "PENDING", "CONFIGURING", "SUSPENDED"}


def show_job(job_id: str, *, timeout: float = 10.0) -> JobInfo | None:
    """The job's state, or None once Slurm no longer knows it."""
    out = run(["scontrol", "show", "job", "-o", job_id], timeout=timeout, check=False)
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:
            return None
        raise SlurmError(["scontrol", "show", "job", "-o", job_id], "failed", out.stderr)
    f = _kv(out.stdout)
    return JobInfo(
        job_id=f.get("JobId", job_id),
        state=f.get("JobState", "UNKNOWN"),
        nodelist=f.get("NodeList", ""),
        num_nodes=int(f.get("NumNodes", "0").split("-")[0] or 0),
        name=f.get("JobName", ""),
    )


def node_address(node: str, *, timeout: float = 10.0) -> str:
    """NodeAddr of a node: how the controller reaches it even without DNS for node names."""
    out = run(["scontrol", "show", "node", "-o", node], timeout=timeout)
    return _kv(out.stdout).get("NodeAddr", node)


def node_addresses(nodes: Sequence[str], *, timeout: float = 10.0) -> dict[str, str]:
    """NodeAddr of several nodes in one call."""
    if not nodes:
        return {}
    out = run(["scontrol", "show", "node", "-o", ",".join(nodes)], timeout=timeout)
    found: dict[str, str] = {}
    for line in out.stdout.splitlines():
        fields = _kv(line)
        if "NodeName" in fields:
            found[fields["NodeName"]] = fields.get("NodeAddr", fields["NodeName"])
    return {n: found.get(n, n) for n in nodes}


_GRANTED = re.compile(r"Granted job allocation (\d+)")
_SUBMITTED = re.compile(r"Submitted batch job (\d+)")


def salloc_argv(
    *,
    nodes: int,
    job_name: str,
    gpus_per_node: int = 0,
    time_limit: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    reservation: str | None = None,
    constraint: str | None = None,
    exclude: Sequence[str] = (),
    comment: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The `salloc --no-shell` that holds the nodes; unset site options are left to Slurm.
    `exclude` names nodes the allocation must not get (a retry without a failed node)."""
    argv = ["salloc", "--no-shell", f"--nodes={nodes}", f"--job-name={job_name}"]
    if gpus_per_node:
        argv.append(f"--gres=gpu:{gpus_per_node}")
    if time_limit:
        argv.append(f"--time={time_limit}")
    for flag, value in (
        ("partition", partition),
        ("account", account),
        ("qos", qos),
        ("reservation", reservation),
        ("constraint", constraint),
    ):
        if value:
            argv.append(f"--{flag}={value}")
    if exclude:
        argv.append(f"--exclude={','.join(exclude)}")
    if comment:
        argv.append(f"--comment={comment}")
    argv += list(extra)
    return argv


def salloc_no_shell(*, timeout: float = 120.0, **request: Any) -> str:
    """Request an allocation that holds the nodes without a shell (`salloc_argv`'s options);
    returns the job id once Slurm grants it."""
    argv = salloc_argv(**request)
    out = run(argv, timeout=timeout)
    m = _GRANTED.search(out.stderr) or _GRANTED.search(out.stdout)
    if not m:
        raise SlurmError(argv, "gave no job id", out.stderr)
    return m.group(1)


def sbatch(argv_tail: Sequence[str], *, timeout: float = 30.0) -> str:
    """Submit a batch job (`sbatch ARGS...`); returns the job id."""
    argv = ["sbatch", *argv_tail]
    out = run(argv, timeout=timeout)
    m = _SUBMITTED.search(out.stdout)
    if not m:
        raise SlurmError(argv, "gave no job id", out.stdout + out.stderr)
    return m.group(1)


def srun_argv(
    command: Sequence[str],
    *,
    job_id: str,
    nodelist: Sequence[str],
    step_name: str,
    gres: str | None = None,
    kill_on_bad_exit: bool = True,
    overlap: bool = True,
    cpus_per_task: int | None = None,
    tasks_per_node: int = 1,
    mpi: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """One coordinated step: one task per listed node (or `tasks_per_node`, an MPI world's
    ranks under Slurm's `mpi` plugin). `gres=None` inherits the job's GPUs.

    `--kill-on-bad-exit=1` is the Slurm-level fail-fast (as in the seed): when one node's task
    exits non-zero, Slurm ends the step's other tasks, whatever they are doing.

    No `--exact`, unlike the seed: with `--overlap` it only limits a step to the CPUs it asks
    for (one per task unless `cpus_per_task`), and a serve step does not ask, so a node's model
    servers (engine, tokenizer and API processes) would share one CPU. Without it each step may
    use every CPU the job holds on its nodes, and `--overlap` lets the endpoint, probe and
    client steps run beside the serve steps on the client node.
    """
    argv = [
        "srun",
        f"--jobid={job_id}",
        f"--job-name={step_name}",
        f"--nodes={len(nodelist)}",
        f"--ntasks={len(nodelist) * tasks_per_node}",
        f"--ntasks-per-node={tasks_per_node}",
        f"--nodelist={','.join(nodelist)}",
        "--unbuffered",
    ]
    if mpi is not None:
        argv.append(f"--mpi={mpi}")
    if kill_on_bad_exit:
        argv.append("--kill-on-bad-exit=1")
    if overlap:
        argv.append("--overlap")
    if gres is not None:
        argv.append(f"--gres={gres}")
    if cpus_per_task:
        argv.append(f"--cpus-per-task={cpus_per_task}")
    argv += list(extra)
    argv.append("--")
    argv += list(command)
    return argv


@dataclass(frozen=True)
class StepInfo:
    step_id: str  # "JOB.STEP"
    name: str


def list_steps(job_id: str, *, timeout: float = 10.0) -> list[StepInfo]:
    """The job's running steps (`squeue -s`)."""
    out = run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j"], timeout=timeout, check=False)
    steps: list[StepInfo] = []
    for line in out.stdout.splitlines():
        sid, _, name = line.strip().partition("|")
        if sid:
            steps.append(StepInfo(step_id=sid, name=name))
    return steps


def scancel(
    target: str, *, signal: str | None = None, timeout: float = 15.0, quiet: bool = True
) -> bool:
    """Cancel a job or `JOB.STEP`; `signal` sends it instead (e.g. TERM). False if already gone."""
    argv = ["scancel"]
    if signal:
        argv.append(f"--signal={signal}")
    argv.append(target)
    out = run(argv, timeout=timeout, check=False)
    if out.returncode == 0:
        return True
    gone = "Invalid job id" in out.stderr or "already completed" in out.stderr
    if gone and quiet:
        return False
    raise SlurmError(argv, f"exited {out.returncode}", out.stderr)


def scancel_by_name(job_name: str, *, user: int | None = None, timeout: float = 15.0) -> None:
    """Cancel the jobs named `job_name` of `user` (a uid; default this process's), e.g. a
    salloc that timed out while pending. Without `--user`, scancel run by root or a Slurm
    operator cancels every user's jobs of that name."""
    uid = os.geteuid() if user is None else user
    try:
        who = pwd.getpwuid(uid).pw_name
    except KeyError:
        who = str(uid)  # scancel takes a uid too, when the user database knows it
    run(["scancel", f"--name={job_name}", f"--user={who}"], timeout=timeout, check=False)


def drain_node(node: str, reason: str, *, timeout: float = 15.0) -> None:
    """`scontrol update nodename=NODE state=drain reason=...`: running jobs finish, no new one
    starts there. Needs a Slurm operator or administrator (or root)."""
    run(
        ["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"],
        timeout=timeout,
    )


def set_job_comment(job_id: str, comment: str, *, timeout: float = 15.0) -> None:
    """`scontrol update jobid=JOB comment=...`: a job's owner may change its comment."""
    run(["scontrol", "update", f"jobid={job_id}", f"comment={comment}"], timeout=timeout)


def resume_node(node: str, *, timeout: float = 15.0) -> None:
    """`scontrol update nodename=NODE state=resume`: undo a drain."""
    run(["scontrol", "update", f"nodename={node}", "state=resume"], timeout=timeout)


@dataclass(frozen=True)
class QueuedJob:
    """A job of any user, as `squeue` lists it: what a reaper of other users' runs needs.

    `state` is the one word Slurm 22.05 prints for it (a flag such as COMPLETING or CONFIGURING
    stands for the whole state); `user_id` is the uid Slurm runs the job as.
    """

    job_id: str
    name: str
    user: str
    state: str
    comment: str
    user_id: int


# Why one JSON listing, and no second read of each job's comment by its id. A job's name and
# comment are written by its user, and every text format of Slurm prints them verbatim: a
# comment holding a newline forges whole lines of `squeue -o`'s listing, and in `scontrol show
# job`'s KEY=VALUE words it can forge the job's other fields, so a per-job read is no proof
# either. `squeue --json` is one document in which each comment is a single string escaped by
# Slurm's serializer: whatever it holds, it stays the `comment` of the job it sits in, beside
# that job's id, uid and state, which Slurm writes and no user can. Reading the comment again by
# id would cost a command per job and add no trust the listing lacks. What a comment says is
# still its author's word: parse_job_comment refuses one holding a newline or any other
# unprintable character, the reaper takes a comment only for the job that carries it (the job's
# name must be the comment's run), and a record's job only while its uid is the record's owner.
# The listing is read under a size bound.
MAX_SQUEUE_JSON_BYTES = 64 << 20
ACTIVE_JOB_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED"})
# A job's base state (Slurm's JOB_STATE_BASE), and the flags that stand for the whole state, in
# the order Slurm's job_state_string picks the one word it prints.
JOB_BASE_STATES = frozenset(
    {"PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"}
    | {"NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
)
JOB_STATE_FLAGS_SHOWN = (
    "COMPLETING",
    "STAGE_OUT",
    "CONFIGURING",
    "RESIZING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "SPECIAL_EXIT",
    "STOPPED",
    "REVOKED",
    "RESV_DEL_HOLD",
    "SIGNALING",
)
# What every refusal of an answer's shape says, so a caller can tell it from Slurm not answering.
UNREADABLE_ANSWER = "in a shape slurmgate does not read"


class SlurmAnswerUnreadable(SlurmError):
    """A Slurm command answered, but not in a shape slurmgate knows; the message names the field.

    Raised rather than skipping what cannot be read: a reaper that read nothing would cancel
    nothing and say nothing."""


def jobs_of_all_users(*, timeout: float = 10.0) -> list[QueuedJob]:
    """Every user's pending and running jobs (`squeue --all --json`), with their comments.

    Reads Slurm 22.05's JSON (a state as one word, numbers as numbers) and that of the data
    parser plugins of later releases (a state as a list of words from 23.11 on, a number as
    `{"set", "infinite", "number"}`). Raises SlurmAnswerUnreadable on any other shape, and
    SlurmError when Slurm lists errors.
    """
    argv = ["squeue", "--all", "--json"]
    out = run(argv, timeout=timeout)
    if len(out.stdout) > MAX_SQUEUE_JSON_BYTES:
        raise SlurmError(argv, f"answered more than {MAX_SQUEUE_JSON_BYTES >> 20} MiB", "")
    try:
        document = json.loads(out.stdout)
    except ValueError:
        raise SlurmAnswerUnreadable(
            argv, f"answered something other than JSON, {UNREADABLE_ANSWER}", out.stdout[:200]
        ) from None
    listed = document.get("jobs") if isinstance(document, dict) else None
    if not isinstance(listed, list):
        raise SlurmAnswerUnreadable(argv, f"answered JSON without a jobs list, {UNREADABLE_ANSWER}")
    errors = document.get("errors") or []
    if errors:
        listed_errors = errors if isinstance(errors, list) else [errors]
        said = "; ".join(_slurm_error_text(e) for e in listed_errors)
        raise SlurmError(argv, f"answered with errors: {said}"[:800])
    jobs = []
    for index, job in enumerate(listed):
        queued = _queued_job(argv, index, job)
        if queued.state in ACTIVE_JOB_STATES:
            jobs.append(queued)
    return jobs


def _slurm_error_text(error: Any) -> str:
    """One error of a listing's `errors`: what, why, and where Slurm says it arose."""
    if not isinstance(error, dict):
        return json.dumps(error)[:200]
    text = str(error.get("error") or error.get("error_number") or "an error")
    if error.get("description"):
        text += f": {error['description']}"
    return f"{text} ({error['source']})" if error.get("source") else text


def _queued_job(argv: Sequence[str], index: int, job: Any) -> QueuedJob:
    """One job of the listing, every field checked; SlurmAnswerUnreadable names the first that
    is of no known shape."""

    def unreadable(field: str, value: Any) -> SlurmAnswerUnreadable:
        shown = json.dumps(value)[:120]
        return SlurmAnswerUnreadable(
            argv, f"listed job #{index} with {field} {shown}, {UNREADABLE_ANSWER}"
        )

    if not isinstance(job, dict):
        raise unreadable("an entry", job)
    job_id = _number(job.get("job_id"))
    if job_id is None or job_id <= 0:
        raise unreadable("job_id", job.get("job_id"))
    user_id = _number(job.get("user_id"))
    if user_id is None or user_id < 0:
        raise unreadable("user_id", job.get("user_id"))
    state = _job_state(job.get("job_state"))
    if state is None:
        raise unreadable("job_state", job.get("job_state"))
    texts = {}
    for field in ("name", "user_name", "comment"):
        value = job.get(field)
        if value is not None and not isinstance(value, str):
            raise unreadable(field, value)
        texts[field] = value or ""
    # Slurm 22.05 prints a null user_name for a uid its host cannot name
    user = texts["user_name"] or str(user_id)
    return QueuedJob(str(job_id), texts["name"], user, state, texts["comment"], user_id)


def _number(value: Any) -> int | None:
    """A whole number as Slurm 22.05 prints it, or as the data parser's `{"set": true,
    "infinite": false, "number": N}`; None for anything else (unset and infinite too)."""
    if isinstance(value, dict) and set(value) <= {"set", "infinite", "number"}:
        if value.get("set") is not True or value.get("infinite") is not False:
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _job_state(value: Any) -> str | None:
    """The one word Slurm 22.05 prints for a job's state, from that word or from the data
    parser's list (its base state and flags); None for any other shape."""
    if isinstance(value, str):
        known = value in JOB_BASE_STATES or value in JOB_STATE_FLAGS_SHOWN
        return value if known else None
    if not isinstance(value, list) or not all(isinstance(word, str) for word in value):
        return None
    bases = [word for word in value if word in JOB_BASE_STATES]
    if len(bases) != 1:
        return None
    shown = [flag for flag in JOB_STATE_FLAGS_SHOWN if flag in value]
    return shown[0] if shown else bases[0]


def sinfo_states(*, timeout: float = 10.0) -> dict[str, str]:
    """node -> state."""
    out = run(["sinfo", "-h", "-N", "-o", "%N|%T"], timeout=timeout)
    states: dict[str, str] = {}
    for line in out.stdout.splitlines():
        node, _, state = line.strip().partition("|")
        if node:
            states[node] = state
    return states


def current_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The allocation this process runs inside, if any."""
    return slurm_variable("SLURM_JOB_ID", env) or slurm_variable("SLURM_JOBID", env) or None

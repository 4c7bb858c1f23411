"""Site hooks through prefect-shell: the hook's guard as a ShellOperation, streamed to the run."""

from __future__ import annotations

import os
import shlex

from prefect_shell import ShellOperation

from slurmgate.runtime.hooks import HookInvocation, start_watchdog
from slurmgate.tasks.allocation import warn


def run_site_hook(invocation: HookInvocation) -> None:
    """Run one hook's guard with prefect-shell: each line it prints is a log line of the
    current flow run (`prolog| …`). The guard bounds the hook's time and process tree; the
    run reads the outcome from the file it leaves, so a failing hook does not raise here.

    prefect-shell hands the guard a copy of the controller's environment; the hook itself gets
    only the environment of the guard's stdin payload.
    """
    fd = invocation.payload_fd()
    command = "exec " + shlex.join(invocation.guard_argv())
    with ShellOperation(commands=[command], log_prefix=f"{invocation.name}| ") as operation:
        try:
            process = operation.trigger(stdin=fd)  # type: ignore[arg-type]
        finally:
            os.close(fd)
        watchdog = start_watchdog(invocation, process.pid)
        try:
            process.wait_for_completion()
        except RuntimeError:
            pass  # a non-zero exit: what happened is in the guard's result file
        finally:
            watchdog.cancel()
    outcome = invocation.outcome()
    if not outcome.ok:  # a warning in the flow run's log: a failed epilog does not fail the run
        warn(f"hook {invocation.name} {outcome.describe()}; its output: {invocation.log_path}")

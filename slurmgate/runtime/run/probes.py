"""Where probes run: in the controller on the client host, or in one long-lived step there."""

from __future__ import annotations

import contextlib
import math
import subprocess
from collections.abc import Callable
from typing import Protocol

import httpx

from slurmgate.runtime.run.state import RunContext
from slurmgate.runtime.steps import readiness
from slurmgate.runtime.steps.node_worker import node_name
from slurmgate.runtime.steps.probe_step import HELLO_TIMEOUT_S, ProbeChannel, ProbeStepFailed
from slurmgate.slurm import commands as slurm


def controller_on(host: str) -> bool:
    """Whether this process runs on `host` (e.g. inside the allocation, on its first node)."""
    return node_name() == host


class ProbeOpener(Protocol):
    """What a phase that probes is given: a prober opened on demand, shut when it is done."""

    def open_prober(
        self, lifetime_s: float, hello_timeout_s: float = HELLO_TIMEOUT_S
    ) -> readiness.Prober: ...

    def shut_prober(self) -> None: ...


class Probes:
    """The run's prober, opened on demand and shut when a phase is done with it."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.origin: str | None = None  # the host the probes ran from, once they have
        self._prober: readiness.Prober | None = None
        self._close: Callable[[], None] = lambda: None

    def open_prober(
        self, lifetime_s: float, hello_timeout_s: float = HELLO_TIMEOUT_S
    ) -> readiness.Prober:
        """Probes from the client host: in this process when it runs there, else one
        long-lived step there (reused until `shut_prober`), bounded by `lifetime_s`."""
        if self._prober is not None:
            return self._prober
        ctx = self.ctx
        assert ctx.layout and ctx.job_id
        client_host = ctx.layout.client_host
        if controller_on(client_host):
            http = httpx.Client(trust_env=False)
            self._prober, self._close = readiness.LocalProber(http), http.close
            if self.origin is None:
                ctx.log(f"decision: probes run in the controller, which is on {client_host}")
            self.origin = client_host
            return self._prober
        minutes = max(1, math.ceil(lifetime_s / 60.0))
        name = "probe"
        step = ctx.supervisor.start(
            name,
            slurm.srun_argv(
                [ctx.python, "-m", "slurmgate.runtime.steps.probe_step"],
                job_id=ctx.job_id,
                nodelist=[client_host],
                step_name=ctx.step_name(name),
                gres="none",
                extra=[f"--time={minutes}"],
            ),
            env=ctx.base_env(),
            step_name=ctx.step_name(name),
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

        self._prober, self._close = channel, close
        origin = channel.hello(hello_timeout_s)
        if origin != client_host:
            raise ProbeStepFailed(
                f"the probe step ran on {origin}, not on the client host {client_host}"
            )
        if self.origin is None:
            ctx.log(
                f"decision: probes run on the client host {origin} in one step for "
                f"{minutes} min at most (the controller is on {node_name()})"
            )
        self.origin = origin
        return self._prober

    def shut_prober(self) -> None:
        """Close the probe step's input (it exits) or the in-process client; idempotent."""
        close, self._close = self._close, lambda: None
        self._prober = None
        close()

"""The client workload: its step and environment, its output echoed, the endpoints' metrics."""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Callable
from pathlib import Path

import httpx

from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.engines import mocker
from slurmgate.runtime.run import stand_ins
from slurmgate.runtime.run.endpoints import token_env
from slurmgate.runtime.run.probes import ProbeOpener
from slurmgate.runtime.run.state import RunContext, RunFailed
from slurmgate.runtime.run.supervisor import StepFailed
from slurmgate.runtime.steps import readiness
from slurmgate.runtime.steps.probe_step import ProbeStepFailed
from slurmgate.settings import handed
from slurmgate.slurm import commands as slurm

METRICS_HELLO_TIMEOUT_S = 15.0  # the metrics step after the client: optional, so bounded tighter
DIRECT_METRICS_TIMEOUT_S = 2.0

# The client's output is copied into the run's log line by line up to this many lines, then
# only its last lines: a benchmark that prints per request must not flood the Prefect log.
CLIENT_ECHO_LINES = 400
CLIENT_ECHO_TAIL_LINES = 20
CLIENT_ECHO_LINE_CHARS = 2000

# The client's reports directory (on the run's own directory): `slurmgate loadgen --chat` writes
# its JSON report there, and the allocation flow publishes what it finds as artifacts.
CLIENT_REPORTS_ENV = "SLURMGATE_RUN_REPORTS_DIR"


def env_name(deployment: str) -> str:
    """SLURMGATE_ENDPOINT_<NAME>: the client's variable for a deployment's endpoint URL."""
    return "SLURMGATE_ENDPOINT_" + re.sub(r"[^A-Z0-9]", "_", deployment.upper())


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


def client_env(ctx: RunContext) -> dict[str, str]:
    assert ctx.layout
    urls = {d.name: ctx.layout.endpoint_url(d) for d in ctx.plan.deployments}
    env = {env_name(name): url for name, url in urls.items()}
    env["SLURMGATE_ENDPOINTS"] = json.dumps(urls, sort_keys=True)
    env["OPENAI_BASE_URL"] = next(iter(urls.values())) + "/v1"
    env[CLIENT_REPORTS_ENV] = str(ctx.client_reports_dir)
    # the files the client wants kept: collected, masked and bounded, into <run>/outputs/client
    env[handed.RESULTS_DIR] = str(ctx.client_results_dir)
    # what a benchmark scrapes beside the endpoint, whose /metrics holds no engine's figures
    first = ctx.plan.deployments[0]
    scraped = layout_mod.server_metrics_urls(ctx.spec.deployments[first.index], ctx.layout, first)
    env[handed.SERVER_METRICS_URLS] = ",".join(scraped)
    # a stand-in's tiny model: its tokenizer is the one a benchmark client must count with
    for dspec in ctx.spec.deployments:
        model = stand_ins.model_dir(ctx, dspec)
        if model is not None:
            env[handed.STAND_IN_MODEL_DIR] = model
            break
    env.update(ctx.credentials.client_env)
    env.update(token_env(ctx))
    return env


def run_client(ctx: RunContext) -> int:
    """The client step on the client host; the run fails if it fails or a server dies."""
    ctx.enter("client")
    assert ctx.layout and ctx.job_id
    ctx.client_results_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    step = ctx.supervisor.start(
        "client",
        slurm.srun_argv(
            list(ctx.spec.client.command),
            job_id=ctx.job_id,
            nodelist=[ctx.layout.client_host],
            step_name=ctx.step_name("client"),
            gres="none",
            cpus_per_task=ctx.client_cpus,
        ),
        env=ctx.base_env(client_env(ctx)),
        step_name=ctx.step_name("client"),
        required=False,
    )
    # Its output reaches the run's log (the console and Prefect) as it comes; the whole
    # of it stays in the step's log file.
    echo = OutputEcho(step.log_path, lambda line: ctx.log(f"client| {line}"))
    try:
        rc = ctx.supervisor.wait(step, on_poll=echo.poll)
    except StepFailed as exc:
        raise RunFailed("client", f"{exc}; its output: {step.log_path}") from None
    finally:
        echo.finish()
    if rc != 0:
        raise RunFailed(
            "client",
            f"client exited {rc}; its output: {step.log_path}, which ends:\n" + step.log_tail(600),
        )
    ctx.log(f"client succeeded; its output: {step.log_path}")
    return rc


def collect_endpoint_metrics(ctx: RunContext, probes: ProbeOpener) -> dict[str, str]:
    """The endpoints' Prometheus text, fetched before they stop, and the requests each
    stand-in worker served (`served_by_lanes`).

    Straight from this process first, with a short timeout: after the client the numbers
    are optional, and a new probe step costs an srun, which a slow or stuck slurmctld can
    hold up for its whole start-up budget. Only what this process cannot reach is read
    through a probe step on the client host.
    """
    if not ctx.layout:
        return {}
    token = ctx.credentials.endpoint_token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    urls = {d.name: ctx.layout.endpoint_url(d) + "/metrics" for d in ctx.plan.deployments}
    lanes = {
        lane: where
        for d in ctx.plan.deployments
        for lane, where in layout_mod.stand_in_metrics_urls(
            ctx.spec.deployments[d.index], ctx.layout, d
        ).items()
    }
    texts: dict[str, str] = {}
    wanted = {**urls, **{lane: url for lane, (_, url) in lanes.items()}}
    with httpx.Client(trust_env=False) as http:
        direct = readiness.LocalProber(http)
        for name, url in wanted.items():
            text = direct.fetch(url, headers if name in urls else {}, DIRECT_METRICS_TIMEOUT_S)
            if text is not None:
                texts[name] = text
    missing = {name: url for name, url in wanted.items() if name not in texts}
    if missing:
        try:
            prober = probes.open_prober(60.0, hello_timeout_s=METRICS_HELLO_TIMEOUT_S)
            for name, url in missing.items():
                text = prober.fetch(url, headers if name in urls else {}, 2.0)
                if text is not None:
                    texts[name] = text
        except (StepFailed, ProbeStepFailed) as exc:
            ctx.log(f"endpoint metrics not collected: {exc}")
        finally:
            probes.shut_prober()
    ctx.endpoint_metrics.update({name: texts[name] for name in urls if name in texts})
    served_by_lanes(ctx, {lane: (host, texts.get(lane)) for lane, (host, _) in lanes.items()})
    return ctx.endpoint_metrics


def served_by_lanes(ctx: RunContext, texts: dict[str, tuple[str, str | None]]) -> None:
    """Log, and keep in the context (and so the record), the requests each stand-in lane
    says it served."""
    for lane, (host, text) in texts.items():
        served = mocker.served_requests(text) if text is not None else None
        if served is None:
            ctx.log(f"served: lane {lane} on node {host}: not read")
            continue
        ctx.lane_served[lane] = served
        ctx.log(f"served: lane {lane} on node {host}: {served:g} requests ({mocker.SERVED_METRIC})")

"""The demo driver: admission on the emulator tick by tick, the runtime on Slurm, then a summary.

The runtime part's allocation is itself a CI job: queued on an emulator of its own, admitted by
the same reconcile flow with Slurm's capacity, and started the moment it is dispatched.

`make demo` runs it through scripts/demo.sh as `slurmgate demo`. Mode `deployment` (the default)
triggers the served `reconcile` deployment of a local Prefect server on every tick, as the
schedule would; `direct` calls the flow in this process (faster, for tests).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from decimal import Decimal
from pathlib import Path
from typing import Any

from slurmgate.ci.priority import job_label
from slurmgate.progress import progress
from slurmgate.settings.handed import inherited
from slurmgate.settings.prefect import PrefectSettings
from slurmgate.testbed.board import AdmissionTracker, counted
from slurmgate.testbed.demo import (
    JOB_MIX,
    TICK_WORDS,
    AdmissionLink,
    AdmissionResult,
    DemoError,
    DemoJob,
    DemoOptions,
    Printer,
    RuntimeResult,
    api_calls,
    command_started_at,
    draw_jobs,
    endpoint_totals,
    link_problems,
    processes_with_env,
    runtime_problems,
    summary_lines,
    wait_until,
)
from slurmgate.testbed.localproc import stop_group
from slurmgate.testbed.prefect_server import PrefectServerError, running_prefect_server

REPO = Path(__file__).resolve().parent.parent
DEMO_SPEC = REPO / "examples" / "specs" / "demo.yaml"
DEMO_REPO = "acme/gpu-ci"
SCOPE_BLOCK = "slurmgate-demo"
PIPE_PROGRESS_S = 5.0
FLAGS = {
    "PRIORITY_SCHEDULER_ENABLED": "true",
    "NODE_SLOT_SCHEDULER_ENABLED": "true",
    # the emulator has no secondary rate limit: do not pace label writes 1 s apart
    "SLURMGATE_MIN_WRITE_INTERVAL_S": "0",
}


# ---- Prefect: a local server and the served reconcile deployment ---------------------------


@contextmanager
def served_reconcile(workdir: Path, api: str) -> Iterator[str]:
    """`deployments/serve.py`'s reconcile deployment served in a subprocess, without its schedule
    (the demo triggers every tick itself); yields the deployment name."""
    import httpx

    log = open(workdir / "serve.log", "wb")  # noqa: SIM115 (closed below)
    env = dict(
        inherited(),
        PREFECT_API_URL=api,
        PREFECT_RUNNER_POLL_FREQUENCY="1",
        PREFECT_RESULTS_PERSIST_BY_DEFAULT="true",
    )
    serve = [
        sys.executable,
        "-m",
        "slurmgate.deployments.serve",
        "--only",
        "reconcile",
        "--interval",
        "0",
    ]
    proc = subprocess.Popen(
        [*serve, "--scope", SCOPE_BLOCK, "--policy", ""],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    name = "reconcile/reconcile"

    def ready() -> bool:
        try:
            return httpx.get(f"{api}/deployments/name/{name}", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        with progress("prefect: serving the reconcile deployment (deployments/serve.py)"):
            wait_until(ready, 90, "the served reconcile deployment", proc)
        yield name
    finally:
        stop_group(proc)
        log.close()


async def _board_rows() -> list[dict[str, Any]]:
    from prefect.artifacts import Artifact

    from slurmgate.flows.reconcile import BOARD_KEY

    artifact = await Artifact.aget(BOARD_KEY)
    if artifact is None:
        return []
    data = artifact.data
    rows = json.loads(data) if isinstance(data, str) else data
    return list(rows or [])


async def _tick(
    mode: str,
    emu_url: str,
    deployment: str | None,
    *,
    scope: str = SCOPE_BLOCK,
    policy: str | None = None,
) -> dict[str, Any]:
    """One reconcile run; its summary (admitted, released, api_calls, ...)."""
    if mode == "direct":
        from slurmgate.flows.reconcile import reconcile

        result: dict[str, Any] = await reconcile(scope_block=scope, policy_block=policy)
        return result
    from prefect.deployments import run_deployment

    assert deployment is not None
    flow_run: Any = await run_deployment(  # type: ignore[misc]
        deployment,
        parameters={"scope_block": scope, "policy_block": policy},
        timeout=600,
        poll_interval=0.25,
    )
    state = flow_run.state
    if state is None or not state.is_completed():
        raise DemoError(
            f"reconcile run {flow_run.name} ended {state.name if state else 'without a state'}"
            f": {state.message if state else ''}"
        )
    value = await state.aresult() if hasattr(state, "aresult") else state.result()
    if not isinstance(value, dict):
        raise DemoError(f"reconcile run {flow_run.name} returned {value!r}, not its summary")
    return value


async def run_admission(
    emu: Any,
    jobs: list[DemoJob],
    printer: Printer,
    *,
    mode: str = "direct",
    deployment: str | None = None,
    max_ticks: int = 120,
    timeout_s: float = 420.0,
    min_tick_s: float = 1.0,
) -> AdmissionResult:
    """Queue `jobs` on the emulator, tick reconcile until every job that can run has run and
    released its lease (or `max_ticks`/`timeout_s` pass), following the fleet with the tracker."""
    from slurmgate.blocks import GitHubScopeBlock

    # The controller authenticates as a GitHub App, as a site's should: the emulator registers
    # one, installed on the demo's owner, and hands out its private key; each flow run's client
    # trades the App's JWT for an installation token (looked up, cached, refreshed).
    app = emu.admin.create_app()
    await GitHubScopeBlock(
        api_url=emu.url,
        repo=emu.repo,
        app_id=app["app_id"],
        app_private_key=app["private_key"],
        min_write_interval_s=0,
    ).save(SCOPE_BLOCK, overwrite=True)
    ids = [emu.admin.add_job(j.labels, j.duration_s, name=j.row_id)["id"] for j in jobs]
    emu.admin.reset_stats()
    tracker = AdmissionTracker(ids)
    started = time.monotonic()
    flow_admitted = flow_released = flow_calls = 0
    problems: list[str] = []
    tick = 0
    while tick < max_ticks:
        tick += 1
        tick_started = time.monotonic()
        running = asyncio.ensure_future(_tick(mode, emu.url, deployment))
        # A terminal gets the live board every second; a pipe or a log gets a line every
        # PIPE_PROGRESS_S, so a long first tick is never silent.
        while not running.done():
            await asyncio.wait({running}, timeout=1.0 if printer.live_mode else PIPE_PROGRESS_S)
            if running.done():
                break
            dump = emu.state.dump()
            if printer.live_mode:
                peek = tracker.peek(tick, dump, elapsed_s=time.monotonic() - started)
                printer.show(peek, running=True)
            else:
                tracked = tracker.job_ids or set()
                moved = sum(
                    1 for j in dump["jobs"] if j["id"] in tracked and j["status"] != "queued"
                )
                printer.say(
                    f"tick {tick} running: {counted(moved, 'job')} dispatched so far, "
                    f"t={time.monotonic() - started:.0f}s"
                )
        try:
            summary = await running
        except Exception as exc:  # a failed tick is a demo failure; the next tick repairs state
            problems.append(f"reconcile tick {tick} failed: {type(exc).__name__}: {exc}")
            summary = {}
        flow_admitted += int(summary.get("admitted", 0))
        flow_released += int(summary.get("released", 0))
        flow_calls += int(summary.get("api_calls", 0))
        dump = emu.admin.dump()
        view = tracker.observe(
            tick,
            dump,
            await _board_rows(),
            elapsed_s=time.monotonic() - started,
            api_calls=api_calls(emu.admin.stats()),
        )
        printer.show(view)
        ours = [j for j in dump["jobs"] if j["id"] in tracker.job_ids]  # type: ignore[operator]
        waiting = [
            j for j in ours if j["status"] != "completed" and j["id"] not in tracker.never_fits
        ]
        leases_left = sum(p.leases for p in view.pools)
        if not waiting and leases_left == 0:
            break
        if time.monotonic() - started > timeout_s:
            problems.append(
                f"admission timed out after {timeout_s:.0f} s with "
                f"{counted(len(waiting), 'job')} unfinished and "
                f"{counted(leases_left, 'lease')} held"
            )
            break
        await asyncio.sleep(max(0.0, min_tick_s - (time.monotonic() - tick_started)))
    else:
        problems.append(f"admission did not settle within {max_ticks} ticks")
    final = emu.admin.dump()
    leases_left = sum(
        1 for r in final["runners"] if any(lb["name"].startswith("ci-lease-") for lb in r["labels"])
    )
    for job_id in tracker.never_fits:
        emu.admin.cancel_job(job_id)  # what a person does with a job no pool can hold
    if flow_admitted != len(tracker.admitted):
        problems.append(
            f"the flows report {counted(flow_admitted, 'admission')} but the fleet showed "
            f"{counted(len(tracker.admitted), 'leased job')}"
        )
    return AdmissionResult(
        jobs=len(jobs),
        ticks=tick,
        admitted=len(tracker.admitted),
        admitted_by_flow=flow_admitted,
        released_by_flow=flow_released,
        completed=len(tracker.completed),
        never_fits=dict(tracker.never_fits),
        backfills=[
            {k: str(v) if k.endswith("score") else v for k, v in asdict(b).items()}
            for b in tracker.backfills
        ],
        peak_utilization=dict(sorted(tracker.peak.items())),
        capacity=dict(sorted(tracker.capacity.items())),
        api_calls=api_calls(emu.admin.stats()),
        api_calls_by_flow=flow_calls,
        leases_left=leases_left,
        seconds=round(time.monotonic() - started, 1),
        mode=mode,
        problems=problems,
    )


# ---- runtime -------------------------------------------------------------------------------

# The runtime part's CI job waits in a pool of its own, one emulator runner per node of the
# cluster's default partition, with Slurm as that pool's capacity authority.
LINK_POOL = "slurm-demo"
LINK_BLOCK = "slurmgate-demo-runtime"  # its scope and its policy block
LINK_TOKEN = "demo-runtime"
DISPATCH_TIMEOUT_S = 120.0  # a first reconcile run on a cold Prefect server takes seconds


def default_partition() -> tuple[str, int]:
    """The cluster's default partition and its node count: where the allocation lands."""
    from slurmgate.slurm import commands as slurm

    out = slurm.run(["scontrol", "show", "partition", "-o"], check=False)
    for line in out.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("Default") == "YES" and fields.get("TotalNodes", "").isdigit():
            return fields["PartitionName"], int(fields["TotalNodes"])
    raise DemoError(
        "Slurm names no default partition (scontrol show partition: no Default=YES); "
        "set Default=YES on the partition the demo's allocation should use"
    )


class Dispatch:
    """When the emulator hands one job to a runner (GitHub's dispatch), by the wall clock."""

    def __init__(self, emu: Any, job_id: int) -> None:
        self.job_id = job_id
        self.at: float | None = None
        self.runner = ""
        self.happened = threading.Event()
        emu.state.listeners.append(self.seen)

    def seen(self, action: str, job: Any) -> None:
        # called under the emulator's lock: note the instant and wake the waiting anchor
        if action == "in_progress" and job.id == self.job_id and self.at is None:
            self.at = time.time()
            self.runner = str(job.runner_name)
            self.happened.set()

    def wait(self, ticking: threading.Thread, timeout_s: float) -> bool:
        """Until the dispatch; False when it did not come in `timeout_s`, or 2 s after the
        admitting reconcile run ended without it."""
        deadline = time.monotonic() + timeout_s
        while not self.happened.wait(0.1):
            if not ticking.is_alive():
                return self.happened.wait(2.0)
            if time.monotonic() > deadline:
                return False
        return True


async def _save_link_blocks(emu: Any, partition: str) -> None:
    from slurmgate.blocks import AdmissionPolicyBlock, GitHubScopeBlock
    from slurmgate.settings.admission import PoolPartition

    app = emu.admin.create_app()
    await GitHubScopeBlock(
        api_url=emu.url,
        repo=emu.repo,
        app_id=app["app_id"],
        app_private_key=app["private_key"],
        min_write_interval_s=0,
    ).save(LINK_BLOCK, overwrite=True)
    await AdmissionPolicyBlock(
        priority_scheduler_enabled=True,
        node_slot_scheduler_enabled=True,
        pool_partitions={LINK_POOL: PoolPartition(partition=partition)},
    ).save(LINK_BLOCK, overwrite=True)


def _link_tick(mode: str, deployment: str | None) -> dict[str, Any]:
    """One reconcile run over the runtime part's emulator, as the admission part runs its own."""
    return asyncio.run(_tick(mode, "", deployment, scope=LINK_BLOCK, policy=LINK_BLOCK))


def _leases_on(emu: Any) -> int:
    return sum(
        1
        for r in emu.admin.dump()["runners"]
        if any(lb["name"].startswith("ci-lease-") for lb in r["labels"])
    )


def _board_slurm(pool: str) -> str:
    for row in asyncio.run(_board_rows()):
        if row.get("pool") in (pool, f"cluster:{pool}"):
            return str(row.get("slurm") or "")
    return ""


def run_runtime(
    workdir: Path,
    spec_path: Path = DEMO_SPEC,
    *,
    mode: str = "direct",
    deployment: str | None = None,
) -> RuntimeResult:
    """The allocation flow on the cluster with the demo spec, started the moment an emulator
    dispatches its CI job, which the reconcile flow admitted with Slurm's capacity; then the
    job completes, a tick releases its lease, and loadgen, metrics and cleanup are read."""
    from prefect.artifacts import Artifact

    from slurmgate.runtime.spec.allocation import AllocationSpec
    from slurmgate.testbed.emulator.testing import running_emulator

    result = RuntimeResult()
    out = workdir / "loadgen"
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o777)
    base = AllocationSpec.from_yaml(spec_path)
    client = base.client.model_copy(
        update={"env": {**base.client.env, "SLURMGATE_DEMO_OUT": str(out)}}
    )
    spec = base.model_copy(update={"client": client})
    started = time.monotonic()
    partition, nodes = default_partition()
    link = result.link = AdmissionLink(pool=LINK_POOL, partition=partition)
    with running_emulator(
        {LINK_POOL: nodes}, repo=DEMO_REPO, token="demo-token", tick_s=0.02
    ) as emu:
        asyncio.run(_save_link_blocks(emu, partition))
        labels = [
            "self-hosted",
            f"cluster:{LINK_POOL}",
            f"nodes:{spec.total_nodes}",
            job_label(Decimal("1"), LINK_TOKEN),
            "ci-attempt-1",
        ]
        # it runs until the allocation ends: the demo completes it then, as the runner would
        job_id = link.job_id = emu.admin.add_job(labels, 3600, name=f"allocation {spec.name}")["id"]
        dispatch = Dispatch(emu, job_id)
        admitting: dict[str, Any] = {}

        def admit() -> None:
            try:
                admitting["summary"] = _link_tick(mode, deployment)
            except Exception as exc:  # reported below; the dispatch wait sees the thread end
                admitting["error"] = exc

        # the admitting run goes on in a thread: the anchor starts when GitHub dispatches the
        # job (as its workflow step `slurmgate allocation run` would), not when the tick ends
        ticking = threading.Thread(target=admit, name="demo-admit", daemon=True)
        with progress(
            f"runtime: its CI job (nodes:{spec.total_nodes}, cluster:{LINK_POOL}) admitted by "
            f"the reconcile flow, Slurm partition {partition} as capacity",
            "dispatched",
        ):
            ticking.start()
            dispatched = dispatch.wait(ticking, DISPATCH_TIMEOUT_S)
        if dispatched:
            link.dispatched_at, link.anchor = dispatch.at, dispatch.runner
        else:
            result.problems.append(
                f"the runtime's CI job {job_id} was not dispatched within "
                f"{DISPATCH_TIMEOUT_S:.0f} s of its admission; the allocation runs unlinked"
            )
        link.admission_s = round(time.monotonic() - started, 2)
        link.flow_started_at = time.time()
        flow_result = _allocation(spec, workdir, result)
        ticking.join(timeout=DISPATCH_TIMEOUT_S)
        if "error" in admitting:
            exc = admitting["error"]
            result.problems.append(f"admitting reconcile run failed: {type(exc).__name__}: {exc}")
        link.admitted_by_flow = int(admitting.get("summary", {}).get("admitted", 0))
        link.slurm_capacity = _board_slurm(LINK_POOL)
        emu.admin.complete_job(job_id, "success" if flow_result else "failure")
        link.completed = True
        releasing = time.monotonic()
        # the next tick releases the finished job's lease (a second one if the first raced)
        for _ in range(2):
            try:
                link.released_by_flow += int(_link_tick(mode, deployment).get("released", 0))
            except Exception as exc:
                result.problems.append(
                    f"releasing reconcile run failed: {type(exc).__name__}: {exc}"
                )
            link.leases_left = _leases_on(emu)
            if link.leases_left == 0:
                break
        link.release_s = round(time.monotonic() - releasing, 2)
    timings = flow_result.get("timings") or {}
    link.salloc_asked_at = timings.get("salloc_asked_at_epoch")
    link.granted_at = timings.get("allocated_at_epoch")
    result.seconds = round(time.monotonic() - started, 1)
    result.run_id = str(flow_result.get("run_id", ""))
    result.job_id = str(flow_result.get("job_id", ""))
    result.hosts = list(flow_result.get("hosts", []))
    # salloc asked -> Slurm granted: a job admitted on nodes Slurm had free waits for nothing
    allocated = timings.get("allocated")
    result.allocation_wait_s = float(allocated) if allocated is not None else None
    for path in sorted(out.glob("*.json")):
        result.loadgen[path.stem] = json.loads(path.read_text())
    artifact: Any = Artifact.get("allocation-endpoint-stats")
    rows: list[dict[str, Any]] = []
    if artifact is not None:
        data = artifact.data
        rows = list(json.loads(data) if isinstance(data, str) else data or [])
    totals = endpoint_totals(rows or [])
    result.served, result.throttled_429 = totals["served"], totals["throttled"]
    result.endpoint_requests = totals["requests"]
    records = sorted((workdir / "runs").glob("*/record.json"))
    if records:
        record = json.loads(records[-1].read_text())
        result.run_id = result.run_id or record["run_id"]
        result.cleanup_complete = record.get("cleanup_complete") is True
    if result.run_id:
        wait_until_quiet = time.monotonic() + 5
        while True:
            result.leftover_processes = processes_with_env("SLURMGATE_RUN_ID", result.run_id)
            if not result.leftover_processes or time.monotonic() > wait_until_quiet:
                break
            time.sleep(0.2)
    if result.job_id and shutil.which("squeue"):
        out_q = subprocess.run(
            ["squeue", "-h", "-j", result.job_id, "-o", "%i"],
            capture_output=True,
            text=True,
            check=False,
        )
        result.slurm_job_left = bool(out_q.stdout.strip())
    if not result.problems:
        result.problems += runtime_problems(result)
    result.problems += link_problems(link)
    return result


def _allocation(spec: Any, workdir: Path, result: RuntimeResult) -> dict[str, Any]:
    """The allocation flow in this (main) thread; its result, or {} with the failure noted."""
    from slurmgate.flows.allocation import allocation

    # The flow's own log lines reach the console only from WARNING up: without this line the
    # run's half a minute would be silent.
    try:
        with progress(
            f"runtime: allocation {spec.name} on Slurm ({spec.total_nodes} nodes)", "done"
        ):
            flow_result: dict[str, Any] = allocation(spec=spec, runs_dir=str(workdir / "runs"))
            return flow_result
    except Exception as exc:
        result.problems.append(f"allocation flow failed: {type(exc).__name__}: {exc}")
        return {}


# ---- summary -------------------------------------------------------------------------------


def run_demo(options: DemoOptions) -> int:
    """Admission on the emulator, then the runtime on Slurm, then the summary; 0 when it held."""
    os.environ.update(FLAGS)
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="slurmgate-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SLURMGATE_STATE_DIR", str(workdir / "state"))
    # Prefect in local mode, isolated: never the user's own ~/.prefect database
    os.environ.setdefault("PREFECT_HOME", str(workdir / "prefect"))
    try:
        jobs = draw_jobs(
            load=options.load,
            never_fits=options.never_fits,
            seed=options.seed,
            duration_s=options.duration_s,
        )
    except DemoError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    adm = rt = None
    try:
        with contextmanager_chain(options.mode, workdir) as deployment:
            with Printer(options.live) as printer:
                if not options.skip_admission:
                    adm = asyncio.run(admission_part(jobs, printer, options.mode, deployment))
            if not options.skip_runtime:
                rt = run_runtime(workdir, mode=options.mode, deployment=deployment)
    except DemoError as exc:
        print(f"demo: {exc} (logs in {workdir})", file=sys.stderr)
        return 1
    lines = summary_lines(adm, rt, time.time() - command_started_at())
    if options.workdir is None:
        lines.insert(-1, f"run files (logs, records, summary.json): {workdir}")
    print("\n".join(lines), flush=True)
    (workdir / "summary.json").write_text(
        json.dumps(
            {"admission": asdict(adm) if adm else None, "runtime": asdict(rt) if rt else None},
            indent=1,
            default=str,
        )
    )
    failed = (adm is not None and adm.problems) or (rt is not None and rt.problems)
    return 1 if failed else 0


async def admission_part(
    jobs: list[DemoJob], printer: Printer, mode: str, deployment: str | None
) -> AdmissionResult:
    from slurmgate.testbed.emulator import fleet_from_job_mix
    from slurmgate.testbed.emulator.testing import running_emulator

    pools = fleet_from_job_mix(JOB_MIX)
    with running_emulator(pools, repo=DEMO_REPO, token="demo-token", tick_s=0.1) as emu:
        printer.say(
            f"admission: emulator at {emu.url} with {sum(pools.values())} runners in "
            f"{len(pools)} pools ({', '.join(f'{p}={n}' for p, n in pools.items())}); "
            f"{counted(len(jobs), 'job')} from the InferenceX mix; {TICK_WORDS[mode]}"
        )
        return await run_admission(emu, jobs, printer, mode=mode, deployment=deployment)


def stop_sending_to_the_server() -> None:
    """Send what Prefect still holds for the server (flow logs, events), then detach its API
    log handlers: once the server stops, nothing may try to reach it, least of all at exit,
    after the summary."""
    import logging

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogHandler, APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        if isinstance(logger, logging.Logger):
            for handler in [h for h in logger.handlers if isinstance(h, APILogHandler)]:
                logger.removeHandler(handler)


@contextmanager
def contextmanager_chain(mode: str, workdir: Path) -> Iterator[str | None]:
    """Deployment mode: a local Prefect server and the served reconcile deployment.
    Direct mode: whatever PREFECT_API_URL names, or Prefect's ephemeral server."""
    if mode != "deployment":
        from slurmgate.flows.prefect_api import use_prefect_api

        use_prefect_api()
        yield None
        return
    print(
        "prefect: flow runs go to a Prefect server the demo starts (prefect server start, "
        f"log in {workdir}); it stops, with its runs, when the demo ends",
        file=sys.stderr,
    )
    try:
        with ExitStack() as stack:
            with progress("prefect: starting a temporary Prefect server"):
                server = stack.enter_context(
                    running_prefect_server(
                        workdir,
                        log=workdir / "prefect-server.log",
                        prefect_home=Path(PrefectSettings.text("home") or workdir / "prefect"),
                    )
                )
            os.environ["PREFECT_API_URL"] = server.api_url
            try:
                with served_reconcile(workdir, server.api_url) as name:
                    yield name
            finally:
                stop_sending_to_the_server()
    except PrefectServerError as exc:
        raise DemoError(str(exc)) from None

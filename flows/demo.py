"""The demo driver: admission on the emulator tick by tick, the runtime on Slurm, then a summary.

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
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from slurmgate.cli.progress import progress
from slurmgate.testbed.board import AdmissionTracker, counted
from slurmgate.testbed.demo import (
    JOB_MIX,
    TICK_WORDS,
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
        os.environ,
        PREFECT_API_URL=api,
        PREFECT_RUNNER_POLL_FREQUENCY="1",
        PREFECT_RESULTS_PERSIST_BY_DEFAULT="true",
    )
    serve = [sys.executable, "deployments/serve.py", "--only", "reconcile", "--interval", "0"]
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

    from flows.reconcile import BOARD_KEY

    artifact = await Artifact.aget(BOARD_KEY)
    if artifact is None:
        return []
    data = artifact.data
    rows = json.loads(data) if isinstance(data, str) else data
    return list(rows or [])


async def _tick(mode: str, emu_url: str, deployment: str | None) -> dict[str, Any]:
    """One reconcile run; its summary (admitted, released, api_calls, ...)."""
    if mode == "direct":
        from flows.reconcile import reconcile

        result: dict[str, Any] = await reconcile(scope_block=SCOPE_BLOCK, policy_block=None)
        return result
    from prefect.deployments import run_deployment

    assert deployment is not None
    flow_run: Any = await run_deployment(deployment, timeout=600, poll_interval=0.25)  # type: ignore[misc]
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
    from blocks import GitHubScopeBlock

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


def run_runtime(workdir: Path, spec_path: Path = DEMO_SPEC) -> RuntimeResult:
    """The allocation flow on the cluster with the demo spec; reads loadgen, metrics, cleanup."""
    from prefect.artifacts import Artifact

    from flows.allocation import allocation
    from slurmgate.runtime.spec import AllocationSpec

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
    # The flow's own log lines reach the console only from WARNING up: without this line the
    # run's half a minute would be silent.
    try:
        with progress(
            f"runtime: allocation {spec.name} on Slurm ({spec.total_nodes} nodes)", "done"
        ):
            flow_result = allocation(spec=spec, runs_dir=str(workdir / "runs"))
    except Exception as exc:
        result.problems.append(f"allocation flow failed: {type(exc).__name__}: {exc}")
        flow_result = {}
    result.seconds = round(time.monotonic() - started, 1)
    result.run_id = str(flow_result.get("run_id", ""))
    result.job_id = str(flow_result.get("job_id", ""))
    result.hosts = list(flow_result.get("hosts", []))
    # salloc asked -> Slurm granted: a job admitted on nodes Slurm had free waits for nothing
    allocated = (flow_result.get("timings") or {}).get("allocated")
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
    return result


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
                rt = run_runtime(workdir)
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
        from flows.prefect_api import use_prefect_api

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
                        prefect_home=Path(os.environ.get("PREFECT_HOME") or workdir / "prefect"),
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

"""Prefect's share of one busy reconcile tick, on equal work, on SQLite and on PostgreSQL.

The flow arm runs `slurmgate.flows.reconcile.reconcile` (one `lease` task run per admission)
against a real `prefect server start`; the core arm runs the core's `reconcile_tick` with the
plain steps (`bench_reconcile.core_tick`: the same settings, client options, releases and
re-plan, and a log of the same lines) and no Prefect, on a fresh emulator with the same fleet
and queue, once
the server has recorded the flow's task runs (so that the core arm never shares the CPU with
the flow's event backlog; that catch-up is reported with the flow arm). The ratio flow / core
is Prefect's share; SQLite's and PostgreSQL's are measured side by side:

- `prefect server start` on a free loopback port, each in its own temporary PREFECT_HOME: once
  with the default SQLite (no connection URL), once with PREFECT_SERVER_DATABASE_CONNECTION_URL
  pointing at a throw-away PostgreSQL from `scripts/postgres-local.sh` (Debian's package);
- a fresh GitHub emulator fleet with the queued jobs of bench_reconcile (the InferenceX mix), so
  that one tick admits many jobs;
- each arm runs in its own child process (the flow's Prefect client points at the server); the
  flow arm counts its Prefect API requests by route and the client's retries (Prefect logs each
  503/429/502 retry and its backoff), and the server's log gives the 503s it sent, by route;
- optionally a second client creates flow runs meanwhile (`--load-rate` per second: create,
  Running, Completed, and a UI-style list), as CI triggers and the UI would, through both arms.

Each backend and load is measured `--repeat` times (default 3), the backends alternating; the
tables show the run with the median flow / core and list every run's ratio.

Run: .venv/bin/python benchmarks/bench_prefect_db.py [--runners 1000] [--jobs 500] [--load-rate 2]
     .venv/bin/python benchmarks/bench_prefect_db.py --smoke    (under a minute per backend)
Writes <results-dir>/prefect_db.json and prefect_db.md (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import re
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from options import SMOKE_NOTE, add_output_flags, results_dir

from slurmgate.testbed.prefect_server import running_prefect_server

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PG_SCRIPT = REPO / "scripts" / "postgres-local.sh"
BACKENDS = ("sqlite", "postgres")
SERVER_RETRYABLE = "Encountered retryable exception in request"
API_FRAME = re.compile(r'prefect/server/api/(?P<module>\w+)\.py", line \d+, in (?P<function>\w+)')
CLIENT_RETRY = re.compile(
    r"(?:retryable status code (?P<code>\d+)|retryable exception).*?made in (?P<wait>[\d.]+)s"
)
TICK_ENV = {
    "PRIORITY_SCHEDULER_ENABLED": "true",
    "NODE_SLOT_SCHEDULER_ENABLED": "true",
    "SLURMGATE_MIN_WRITE_INTERVAL_S": "0",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "INFO",  # Prefect's default: decision lines reach the API's logs
    # Prefect logs each client retry (503/429/502 and its backoff) at DEBUG; the child counts
    # those lines and drops every other DEBUG record. Prefect re-applies its logging config
    # during a run, so the level is set through its config, not only once by hand.
    "PREFECT_LOGGING_LOGGERS_PREFECT_CLIENT_LEVEL": "DEBUG",
}


class BenchError(RuntimeError):
    """A step of the benchmark failed; the message says which and where its log is."""


def clean_env() -> dict[str, str]:
    """This process's environment without any Prefect setting (each child sets its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}


def pg_parent() -> Path:
    """Where the cluster's directory goes: the temp dir, unless we are root and the `postgres`
    user (who runs the cluster then) cannot reach it, e.g. under pytest's 0700 tmp dirs."""
    temp = Path(tempfile.gettempdir()).resolve()
    if os.geteuid() != 0:
        return temp
    reachable = all(p.stat().st_mode & stat.S_IXOTH for p in (temp, *temp.parents))
    return temp if reachable else Path("/tmp")


@contextlib.contextmanager
def postgres(workdir: Path) -> Iterator[Callable[[str], str]]:
    """A throw-away PostgreSQL cluster (scripts/postgres-local.sh); yields `database(name)`,
    which creates a fresh database and returns its asyncpg URL."""
    env = dict(os.environ, SLURMGATE_PG_DIR=str(pg_parent() / f"{workdir.name}-pg"))

    def database(name: str) -> str:
        done = subprocess.run(
            ["bash", str(PG_SCRIPT), "start"],
            env=dict(env, SLURMGATE_PG_DB=name),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise BenchError(f"scripts/postgres-local.sh start failed: {done.stderr.strip()}")
        return done.stdout.strip().splitlines()[-1]

    try:
        yield database
    finally:
        subprocess.run(["bash", str(PG_SCRIPT), "stop"], env=env, check=False)


class LoadClient:
    """A second client on the server while the tick runs: every 1/rate s it creates a flow run,
    moves it to Running and Completed, and lists recent runs as the UI does. 503s are retried
    with a short backoff (as a CI script should) and counted."""

    def __init__(self, api: str, rate: float) -> None:
        import httpx

        self.rate = rate
        self.http = httpx.Client(base_url=api, timeout=30.0)
        self.runs = 0
        self.requests = 0
        self.retried_503 = 0
        self.create_s: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _send(self, method: str, path: str, body: dict[str, Any]) -> Any:
        delay = 0.2
        for _ in range(10):
            self.requests += 1
            response = self.http.request(method, path, json=body)
            if response.status_code != 503:
                response.raise_for_status()
                return response.json() if response.content else None
            self.retried_503 += 1
            time.sleep(delay)
            delay = min(delay * 2, 3.0)
        raise BenchError(f"load client: {method} {path} still 503 after 10 tries")

    def _one_run(self, flow_id: str) -> None:
        started = time.perf_counter()
        run = self._send(
            "POST",
            "/flow_runs/",
            {
                "flow_id": flow_id,
                "name": f"ci-{uuid.uuid4().hex[:8]}",
                "state": {"type": "PENDING"},
            },
        )
        self.create_s.append(time.perf_counter() - started)
        for state in ("RUNNING", "COMPLETED"):
            self._send("POST", f"/flow_runs/{run['id']}/set_state", {"state": {"type": state}})
        self._send("POST", "/flow_runs/filter", {"limit": 20, "sort": "EXPECTED_START_TIME_DESC"})
        self.runs += 1

    def _run(self) -> None:
        try:
            flow_id = self._send("POST", "/flows/", {"name": "bench-load"})["id"]
            while not self._stop.is_set():
                next_at = time.monotonic() + 1 / self.rate
                self._one_run(flow_id)
                self._stop.wait(max(0.0, next_at - time.monotonic()))
        except Exception as exc:  # reported in the results, never silently dropped
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> LoadClient:
        if self.rate > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        self.http.close()

    def summary(self) -> dict[str, Any]:
        return {
            "rate_per_s": self.rate,
            "flow_runs_created": self.runs,
            "requests": self.requests,
            "retried_503": self.retried_503,
            "create_p50_s": round(statistics.median(self.create_s), 3) if self.create_s else None,
            "create_max_s": round(max(self.create_s), 3) if self.create_s else None,
            "errors": self.errors,
        }


def server_503_routes(log_text: str) -> dict[str, int]:
    """How many 503s each API route sent (from the traceback under each logged 503)."""
    routes: dict[str, int] = {}
    for block in log_text.split(SERVER_RETRYABLE)[1:]:
        # the first frame in an API module past the app's own middleware (api/server.py)
        frames = [f for f in API_FRAME.finditer(block[:30000]) if f["module"] != "server"]
        route = f"{frames[0]['module']}.{frames[0]['function']}" if frames else "unknown"
        routes[route] = routes.get(route, 0) + 1
    return dict(sorted(routes.items(), key=lambda item: -item[1]))


LEASE_RUN_PREFIX = "lease-j"  # the lease task runs' names: lease-j<job>-a<attempt>


def lease_runs(api: str, expected: int, settle_s: float = 60.0) -> list[dict[str, Any]]:
    """Every `lease` task run the server holds. The server records task runs from their events,
    a moment after the tick: wait until `expected` are in with final states, or `settle_s`."""
    import httpx

    deadline = time.monotonic() + settle_s
    with httpx.Client(base_url=api, timeout=60.0) as http:
        while True:
            found: list[dict[str, Any]] = []
            while True:
                body = {
                    "task_runs": {"name": {"like_": LEASE_RUN_PREFIX}},
                    "limit": 200,
                    "offset": len(found),
                }
                page = http.post("/task_runs/filter", json=body)
                page.raise_for_status()
                found.extend(page.json())
                if len(page.json()) < 200:
                    break
            final = [r for r in found if r.get("state") and r["state"]["type"] != "RUNNING"]
            if (len(found) >= expected and len(final) == len(found)) or (
                time.monotonic() > deadline
            ):
                return found
            time.sleep(0.5)


def lease_run_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """States and run times of the lease task runs (start to end, as the server recorded them)."""
    durations = []
    for run in runs:
        if run.get("start_time") and run.get("end_time"):
            start = datetime.fromisoformat(run["start_time"])
            durations.append((datetime.fromisoformat(run["end_time"]) - start).total_seconds())
    states: dict[str, int] = {}
    for run in runs:
        kind = run["state"]["type"] if run.get("state") else "NONE"
        states[kind] = states.get(kind, 0) + 1
    durations.sort()
    return {
        "count": len(runs),
        "states": states,
        "run_time_p50_s": round(statistics.median(durations), 3) if durations else None,
        "run_time_p95_s": (
            round(durations[int(0.95 * (len(durations) - 1))], 3) if durations else None
        ),
        "run_time_sum_s": round(sum(durations), 2),
    }


ID_SEGMENT = re.compile(r"/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def count_api_requests(api: str) -> dict[str, int]:
    """Count this process's HTTP requests to the Prefect API by route (ids folded to {id}),
    from httpx's own send, which Prefect's clients go through; returns the live counter."""
    import httpx

    routes: dict[str, int] = {}
    lock = threading.Lock()
    prefix = api.rstrip("/")

    def route(request: httpx.Request) -> str | None:
        url = str(request.url)
        if not url.startswith(prefix):
            return None
        path = ID_SEGMENT.sub("/{id}", url[len(prefix) :].split("?")[0])
        return f"{request.method} {path}"

    def counted(send: Any) -> Any:
        def note(request: httpx.Request) -> None:
            name = route(request)
            if name:
                with lock:
                    routes[name] = routes.get(name, 0) + 1

        if asyncio.iscoroutinefunction(send):

            async def async_send(self: Any, request: httpx.Request, **kw: Any) -> Any:
                note(request)
                return await send(self, request, **kw)

            return async_send

        def sync_send(self: Any, request: httpx.Request, **kw: Any) -> Any:
            note(request)
            return send(self, request, **kw)

        return sync_send

    httpx.AsyncClient.send = counted(httpx.AsyncClient.send)  # type: ignore[method-assign]
    httpx.Client.send = counted(httpx.Client.send)  # type: ignore[method-assign]
    return routes


def cpu_s() -> float:
    """This process's CPU time so far (user + system, every thread)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class ServerCpu:
    """CPU seconds the server's processes (its session: the API and its services, and with
    SQLite the database too) used, read from /proc by the session id of its listening port."""

    def __init__(self, url: str) -> None:
        port = url.rsplit(":", 1)[1].split("/")[0]
        found = subprocess.run(
            ["pgrep", "-f", "--", f"--port {port}"], capture_output=True, text=True, check=False
        ).stdout.split()
        self.sid = os.getsid(int(found[0])) if found else None

    def __call__(self) -> float | None:
        if self.sid is None:
            return None
        ticks = 0
        for proc_stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = proc_stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == self.sid:  # field 6 of stat: the session id
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")


def tick_child(api: str, gh_url: str, repo: str) -> dict[str, Any]:
    """In the child process: one reconcile tick against the server, counting client retries
    and the Prefect API requests the tick made."""
    import prefect  # noqa: F401  (sets up Prefect's logging before we hook its client logger)

    retries: dict[str, float] = {"count": 0, "backoff_s": 0.0}
    codes: dict[str, int] = {}

    def count(record: logging.LogRecord) -> bool:
        match = CLIENT_RETRY.search(record.getMessage())
        if match:
            retries["count"] += 1
            retries["backoff_s"] += float(match["wait"])
            code = match["code"] or "exception"
            codes[code] = codes.get(code, 0) + 1
        return record.levelno >= logging.WARNING  # the rest of the client's DEBUG stays quiet

    client_logger = logging.getLogger("prefect.client")
    client_logger.setLevel(logging.DEBUG)
    client_logger.addFilter(count)
    routes = count_api_requests(api)

    from slurmgate.flows.reconcile import reconcile

    started, cpu_before = time.perf_counter(), cpu_s()
    error = None
    summary: dict[str, Any] = {}
    try:
        summary = asyncio.run(reconcile(scope_block=None, api_url=gh_url, repo=repo))
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[:500]}"
    wall, cpu = time.perf_counter() - started, cpu_s() - cpu_before
    from prefect.logging.handlers import APILogHandler

    # the last log batch, so that the request count holds every log write
    asyncio.run(APILogHandler.aflush())
    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 2),
        "summary": summary,
        "error": error,
        "client_retries": int(retries["count"]),
        "client_retry_codes": codes,
        "client_backoff_s": round(retries["backoff_s"], 2),
        "retry_logger_still_debug": client_logger.level == logging.DEBUG,
        "api_requests": dict(sorted(routes.items(), key=lambda item: -item[1])),
    }


def core_child(gh_url: str, repo: str, log: str) -> dict[str, Any]:
    """In the child process: the same tick through the core, without Prefect."""
    from bench_reconcile import core_logger, core_tick

    from slurmgate.settings.admission import AdmissionSettings

    class Target:  # what core_tick reads of an emulator
        url, token = gh_url, os.environ["GITHUB_TOKEN"]

    Target.repo = repo  # type: ignore[attr-defined]
    cpu_before = cpu_s()
    counts, wall = asyncio.run(core_tick(Target, AdmissionSettings(), core_logger(Path(log))))
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu_s() - cpu_before, 2), "summary": counts}


def run_child(
    kind: str, api: str, emu: Any, workdir: Path, server_cpu: ServerCpu | None = None
) -> dict[str, Any]:
    """Run tick_child (kind "tick") or core_child (kind "core") in a fresh interpreter, with the
    flow's Prefect client on `api`; adds the CPU seconds this process (the emulator, and the
    load client when on) and the server used meanwhile."""
    env = clean_env()
    env.update(TICK_ENV)
    env.update(
        PREFECT_API_URL=api,
        PREFECT_HOME=str(workdir / "client"),
        GITHUB_TOKEN=emu.token,
        SLURMGATE_STATE_DIR=str(workdir / f"state-{kind}"),
    )
    log = workdir / f"{kind}.log"
    extra = [str(workdir / "core-tick.log")] if kind == "core" else [api]
    argv = [sys.executable, __file__, f"--{kind}-child", emu.url, emu.repo, *extra]
    server_before = server_cpu() if server_cpu else None
    here_before = cpu_s()
    with log.open("w") as err:
        done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    here = cpu_s() - here_before
    server_after = server_cpu() if server_cpu else None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise BenchError(f"the {kind} process failed (exit {done.returncode}); see {log}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["emulator_cpu_s"] = round(here, 2)
    result["server_cpu_s"] = (
        round(server_after - server_before, 2)
        if server_after is not None and server_before is not None
        else None
    )
    return result


def measure_backend(
    name: str, database_url: str | None, load_rate: float, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    """One fresh server on `name`'s database; the flow's tick on a fresh fleet, then the core's
    on another fresh fleet with the same queue (the server up and the load on for both)."""
    from bench_reconcile import fleet_sizes, load_mix, queue_jobs

    from slurmgate.testbed.emulator.testing import running_emulator

    mix = load_mix()
    pools = fleet_sizes(mix, args.runners)
    load_before = os.getloadavg()
    with running_prefect_server(workdir, database_url=database_url) as server:
        api, server_log, startup_s = server.api_url, server.log, server.startup_s
        server_cpu = ServerCpu(server.url)
        print(
            f"[bench] {name}, load {load_rate}/s: server up in {startup_s:.1f} s, tick starts",
            flush=True,
        )
        with LoadClient(api, load_rate) as load:
            with running_emulator(pools) as emu:
                queue_jobs(emu, mix, args.jobs, args.seed)
                emu.admin.reset_stats()
                tick = run_child("tick", api, emu, workdir, server_cpu)
                github = emu.admin.stats()
            summary = tick["summary"]
            leases = summary.get("admitted", 0) + summary.get("rolled_back", 0)
            # The server records the task runs from their events after the tick has ended: the
            # core arm starts once it has, so it never shares the CPU with the flow's backlog,
            # and that backlog's time and CPU count as the flow arm's.
            backlog_cpu, backlog_started = server_cpu(), time.perf_counter()
            runs = lease_run_stats(lease_runs(api, leases))
            catch_up_s = round(time.perf_counter() - backlog_started, 2)
            backlog_cpu_after = server_cpu()
            backlog_cpu_s = (
                round(backlog_cpu_after - backlog_cpu, 2)
                if backlog_cpu is not None and backlog_cpu_after is not None
                else None
            )
            with running_emulator(pools) as twin:
                queue_jobs(twin, mix, args.jobs, args.seed)
                twin.admin.reset_stats()
                core = run_child("core", api, twin, workdir, server_cpu)
                core_github = twin.admin.stats()
        load_after = os.getloadavg()
    server_text = server_log.read_text(errors="replace")
    server_503 = server_text.count(SERVER_RETRYABLE)
    requests = tick["api_requests"]
    result = {
        "backend": name,
        "load_rate_per_s": load_rate,
        "server_startup_s": round(startup_s, 2),
        "tick_wall_s": tick["wall_s"],
        "core_wall_s": core["wall_s"],
        "flow_over_core": ratio(tick["wall_s"], core["wall_s"]),
        "tick_error": tick["error"],
        "admitted": summary.get("admitted", 0),
        "rolled_back": summary.get("rolled_back", 0),
        "blocked": summary.get("blocked", 0),
        "core_admitted": core["summary"]["admitted"],
        "core_rolled_back": core["summary"]["rolled_back"],
        "core_blocked": core["summary"]["blocked"],
        "lease_tasks": leases,
        "prefect_ms_per_lease": (
            round(1000 * (tick["wall_s"] - core["wall_s"]) / leases, 1) if leases else None
        ),
        "lease_task_runs": runs,
        "server_catch_up_s": catch_up_s,
        "server_catch_up_cpu_s": backlog_cpu_s,
        # where the time went: CPU seconds of each process while each arm ran
        "cpu_s": {
            arm: {
                "tick_process": r["cpu_s"],
                "emulator_and_load_client": r["emulator_cpu_s"],
                "prefect_server": r["server_cpu_s"],
            }
            for arm, r in (("flow", tick), ("core", core))
        },
        "server_503s": server_503,
        "server_503s_by_route": server_503_routes(server_text),
        "tick_client_retries": tick["client_retries"],
        "tick_client_retry_codes": tick["client_retry_codes"],
        "tick_client_backoff_s": tick["client_backoff_s"],
        "retry_counter_active": tick["retry_logger_still_debug"],
        "prefect_api_requests": sum(requests.values()),
        "prefect_api_requests_by_route": requests,
        "github_requests": github["total"],
        "github_writes": github["writes"],
        "core_github_requests": core_github["total"],
        "core_github_writes": core_github["writes"],
        "load_client": load.summary(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
    }
    print(
        f"[bench] {name}: flow {tick['wall_s']} s, core {core['wall_s']} s "
        f"(flow / core {result['flow_over_core']}x), {leases} lease tasks, "
        f"{server_503} server 503s, {tick['client_retries']} client retries",
        flush=True,
    )
    return result


def median_run(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median flow / core (the lower middle one of an even count), with every
    run's flow / core in run order beside it."""
    median = sorted(tries, key=lambda r: r["flow_over_core"] or 0.0)[(len(tries) - 1) // 2]
    chosen = dict(median)
    chosen["flow_over_core_runs"] = [r["flow_over_core"] for r in tries]
    chosen["other_runs_errors"] = [
        r["tick_error"] for r in tries if r["tick_error"] and r is not median
    ]
    return chosen


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def compare(sq: dict[str, Any], pg: dict[str, Any]) -> dict[str, float | None]:
    """SQLite over PostgreSQL for one load condition."""
    return {
        "tick_wall_ratio": ratio(sq["tick_wall_s"], pg["tick_wall_s"]),
        "flow_over_core_ratio": ratio(sq["flow_over_core"], pg["flow_over_core"]),
        "lease_task_run_time_p50_ratio": ratio(
            sq["lease_task_runs"]["run_time_p50_s"], pg["lease_task_runs"]["run_time_p50_s"]
        ),
        "load_client_create_p50_ratio": ratio(
            sq["load_client"]["create_p50_s"], pg["load_client"]["create_p50_s"]
        ),
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Each load condition (quiet, then loaded), each backend in turn, both arms each."""
    conditions: list[dict[str, Any]] = []
    with postgres(workdir) as database:
        pg_started = time.perf_counter()
        database("bench_warmup")  # installs (if needed) and starts the cluster
        pg_start_s = time.perf_counter() - pg_started
        print(f"[bench] postgres up in {pg_start_s:.1f} s", flush=True)
        for index, rate in enumerate(args.load_rates):
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.order}
            # the backends alternate, so that a change in the machine's load meets both
            for attempt in range(args.repeat):
                for name in args.order:
                    # a fresh database per measurement, as SQLite gets a fresh file
                    url = database(f"prefect_{index}_{attempt}") if name == "postgres" else None
                    where = workdir / f"{name}-load{rate:g}-{attempt}"
                    runs[name].append(measure_backend(name, url, rate, args, where))
            backends = {name: median_run(tries) for name, tries in runs.items()}
            conditions.append(
                {
                    "load_rate_per_s": rate,
                    "backends": backends,
                    "sqlite_over_postgres": compare(backends["sqlite"], backends["postgres"]),
                }
            )
    return {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "prefect": __import__("prefect").__version__,
        "smoke": args.smoke,
        "command": args.command,
        "fleet": {"runners": args.runners, "queued_jobs": args.jobs, "seed": args.seed},
        "order": list(args.order),
        "repeat": args.repeat,
        "postgres_start_s": round(pg_start_s, 2),
        "targets": {"sqlite_flow_over_core": TARGET_SQLITE, "postgres_flow_over_core": TARGET_PG},
        "conditions": conditions,
    }


TARGET_SQLITE = 2.0
TARGET_PG = 1.25


def condition_table(condition: dict[str, Any]) -> list[str]:
    sq, pg = condition["backends"]["sqlite"], condition["backends"]["postgres"]
    r = condition["sqlite_over_postgres"]
    rate = condition["load_rate_per_s"]

    def row(label: str, a: Any, b: Any, ratio_text: Any = "") -> str:
        return f"| {label} | {a} | {b} | {ratio_text} |"

    def load(b: dict[str, Any], key: str) -> Any:
        return b["load_client"][key]

    def runs(b: dict[str, Any]) -> str:
        return (
            f"{b['lease_task_runs']['run_time_p50_s']} / {b['lease_task_runs']['run_time_p95_s']}"
        )

    def decided(b: dict[str, Any], prefix: str = "") -> str:
        return f"{b[prefix + 'admitted']} / {b[prefix + 'rolled_back']} / {b[prefix + 'blocked']}"

    def cpu(b: dict[str, Any], arm: str) -> str:
        c = b["cpu_s"][arm]
        return f"{c['tick_process']} / {c['emulator_and_load_client']} / {c['prefect_server']}"

    def top_routes(b: dict[str, Any], n: int = 4) -> str:
        return ", ".join(
            f"{k} {v}" for k, v in list(b["prefect_api_requests_by_route"].items())[:n]
        )

    title = (
        f"## With a second client creating {rate:g} flow runs/s"
        if rate
        else "## Quiet server (the tick is the only client)"
    )
    lines = [
        title,
        "",
        "| measure | SQLite | PostgreSQL | SQLite / PostgreSQL |",
        "|---|---|---|---|",
        row("flow tick wall (s)", sq["tick_wall_s"], pg["tick_wall_s"], f"{r['tick_wall_ratio']}x"),
        row("core tick wall, same work, no Prefect (s)", sq["core_wall_s"], pg["core_wall_s"]),
        row(
            "**flow / core** (target SQLite <= 2, PostgreSQL <= 1.25)",
            f"**{sq['flow_over_core']}x**",
            f"**{pg['flow_over_core']}x**",
        ),
        row(
            "flow / core of each run (the median run is shown)",
            ", ".join(f"{x}x" for x in sq["flow_over_core_runs"]),
            ", ".join(f"{x}x" for x in pg["flow_over_core_runs"]),
        ),
        row(
            "Prefect's time per lease, (flow - core) / leases (ms)",
            sq["prefect_ms_per_lease"],
            pg["prefect_ms_per_lease"],
        ),
        row("CPU s, flow arm: tick / emulator / Prefect server*", cpu(sq, "flow"), cpu(pg, "flow")),
        row("CPU s, core arm: tick / emulator / Prefect server*", cpu(sq, "core"), cpu(pg, "core")),
        row(
            "server still recording the flow's task runs after the tick: s (server CPU s)",
            f"{sq['server_catch_up_s']} ({sq['server_catch_up_cpu_s']})",
            f"{pg['server_catch_up_s']} ({pg['server_catch_up_cpu_s']})",
        ),
        row("flow: admitted / rolled back / blocked", decided(sq), decided(pg)),
        row("core: admitted / rolled back / blocked", decided(sq, "core_"), decided(pg, "core_")),
        row(
            "GitHub requests (writes): flow; core",
            f"{sq['github_requests']} ({sq['github_writes']}); "
            f"{sq['core_github_requests']} ({sq['core_github_writes']})",
            f"{pg['github_requests']} ({pg['github_writes']}); "
            f"{pg['core_github_requests']} ({pg['core_github_writes']})",
        ),
        row(
            "lease task run time p50 / p95 (s)",
            runs(sq),
            runs(pg),
            f"{r['lease_task_run_time_p50_ratio']}x (p50)",
        ),
        row("503s sent by the server", sq["server_503s"], pg["server_503s"]),
        row(
            "503s by API route",
            ", ".join(f"{k} {v}" for k, v in sq["server_503s_by_route"].items()) or "-",
            ", ".join(f"{k} {v}" for k, v in pg["server_503s_by_route"].items()) or "-",
        ),
        row(
            "tick client retries (backoff slept, s)",
            f"{sq['tick_client_retries']} ({sq['tick_client_backoff_s']})",
            f"{pg['tick_client_retries']} ({pg['tick_client_backoff_s']})",
        ),
        row(
            "Prefect API requests of the tick",
            sq["prefect_api_requests"],
            pg["prefect_api_requests"],
        ),
        row("most requested routes", top_routes(sq), top_routes(pg)),
    ]
    if rate:
        lines += [
            row(
                "load client: flow runs created (503s retried)",
                f"{load(sq, 'flow_runs_created')} ({load(sq, 'retried_503')})",
                f"{load(pg, 'flow_runs_created')} ({load(pg, 'retried_503')})",
            ),
            row(
                "load client: create p50 / max (s)",
                f"{load(sq, 'create_p50_s')} / {load(sq, 'create_max_s')}",
                f"{load(pg, 'create_p50_s')} / {load(pg, 'create_max_s')}",
                f"{r['load_client_create_p50_ratio']}x (p50)",
            ),
        ]
    lines += [
        row("server start to /health (s)", sq["server_startup_s"], pg["server_startup_s"]),
        row(
            "load average (1 min) before / after",
            f"{sq['loadavg_before'][0]} / {sq['loadavg_after'][0]}",
            f"{pg['loadavg_before'][0]} / {pg['loadavg_after'][0]}",
        ),
        "",
    ]
    errors = [f"{b['backend']}: {b['tick_error']}" for b in (sq, pg) if b["tick_error"]]
    errors += [
        f"{b['backend']} (another run): {e}" for b in (sq, pg) for e in b["other_runs_errors"]
    ]
    errors += [f"{b['backend']} load: {e}" for b in (sq, pg) for e in b["load_client"]["errors"]]
    errors += [
        f"{b['backend']}: the server holds {b['lease_task_runs']['count']} lease task runs, the "
        f"tick made {b['lease_tasks']}"
        for b in (sq, pg)
        if b["lease_task_runs"]["count"] != b["lease_tasks"]
    ]
    errors += [
        f"{b['backend']}: the arms decided differently (flow {decided(b)}, core "
        f"{decided(b, 'core_')})"
        for b in (sq, pg)
        if decided(b) != decided(b, "core_")
    ]
    if sq["lease_tasks"] != pg["lease_tasks"]:
        errors.append("the backends made different numbers of lease tasks")
    lines += [
        "\\* The server's own processes: with SQLite the database works inside them, PostgreSQL's "
        "processes are not counted.",
        "",
    ]
    if errors:
        lines += ["Errors: " + "; ".join(errors), ""]
    return lines


def markdown(result: dict[str, Any]) -> str:
    fleet = result["fleet"]
    lines = [
        "# Prefect's share of a busy reconcile tick, on SQLite and PostgreSQL",
        "",
        f"{fleet['runners']} emulator runners, {fleet['queued_jobs']} queued jobs (InferenceX "
        f"mix, seed {fleet['seed']}). Flow arm: `slurmgate.flows.reconcile.reconcile`, one "
        "`lease` task run per admission, on a fresh `prefect server start` (loopback, Prefect "
        f"{result['prefect']}) and a fresh fleet. Core arm: the core's `reconcile_tick` with "
        "the plain steps and no Prefect (same settings, client options, queue and log lines), "
        "on a fresh fleet, once the server has recorded the flow's task runs (their events "
        "arrive during the tick and are processed after it), the server and the load still on. "
        "PostgreSQL 15 from "
        f"Debian (throw-away cluster, started in {result['postgres_start_s']} s). Backends ran "
        f"one after the other ({' then '.join(result['order'])}, {result['repeat']} time(s) "
        "each, alternating; each table shows the run with the median flow / core) on "
        f"{result['machine']['cpus']} cores shared with other work (load averages below).",
        "",
        f"Command: `{result['command']}`",
        "",
    ]
    for condition in result["conditions"]:
        lines += condition_table(condition)
    if result["smoke"]:
        lines += [SMOKE_NOTE, ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="example: .venv/bin/python benchmarks/bench_prefect_db.py --smoke "
        "--results-dir /tmp/out",
    )
    parser.add_argument("--runners", type=int, default=1000, help="emulator runners (default 1000)")
    parser.add_argument("--jobs", type=int, default=500, help="queued jobs (default 500)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--load-rate",
        type=float,
        default=2.0,
        help="flow runs per second a second client creates during the loaded tick; the quiet "
        "tick is always measured too (0: quiet only; default 2)",
    )
    parser.add_argument(
        "--postgres-first", action="store_true", help="run PostgreSQL before SQLite"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="measurements per backend and load, alternating backends; the tables show the "
        "run with the median flow / core (default 3; 1 with --smoke)",
    )
    add_output_flags(
        parser,
        "24 runners and 10 queued jobs, both backends, quiet server only (about 30 s)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.runners, args.jobs, args.repeat = min(args.runners, 24), min(args.jobs, 10), 1
    for flag in ("runners", "jobs", "repeat"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.load_rate < 0:
        parser.error("--load-rate must be 0 (no load) or a positive rate per second")
    args.order = BACKENDS[::-1] if args.postgres_first else BACKENDS
    # smoke keeps the side-by-side (both backends) but measures the quiet condition only
    args.load_rates = [0.0, args.load_rate] if args.load_rate and not args.smoke else [0.0]
    shown = [a for a in (argv if argv is not None else sys.argv[1:])]
    args.command = " ".join([".venv/bin/python", "benchmarks/bench_prefect_db.py", *shown])
    return args


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--tick-child":
        print(json.dumps(tick_child(sys.argv[4], sys.argv[2], sys.argv[3])))
        return
    if len(sys.argv) == 5 and sys.argv[1] == "--core-child":
        print(json.dumps(core_child(*sys.argv[2:5])))
        return
    for key in ("PRIORITY_SCHEDULER_ENABLED", "NODE_SLOT_SCHEDULER_ENABLED"):
        os.environ.setdefault(key, "true")
    args = parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="slurmgate-bench-db-"))
    try:
        result = run(args, workdir)
    except BenchError as exc:
        sys.exit(f"bench_prefect_db: {exc} (logs kept in {workdir})")
    shutil.rmtree(workdir, ignore_errors=True)  # server and tick logs; kept only on failure
    out = results_dir(args)
    (out / "prefect_db.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / "prefect_db.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

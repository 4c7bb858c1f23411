"""One busy reconcile tick through a real Prefect server on SQLite, then on PostgreSQL.

Why: Prefect's default SQLite server answers 503 ("database is busy") under light load and its
client (`prefect.client.base`) retries it after 2^n s; the reconcile benchmark blamed ~2 s
per lease subflow on it. This runs the same burst against both databases, side by side:

- `prefect server start` on a free loopback port, each in its own temporary PREFECT_HOME: once
  with the default SQLite (no connection URL), once with PREFECT_SERVER_DATABASE_CONNECTION_URL
  pointing at a throw-away PostgreSQL from `scripts/postgres-local.sh` (Debian's package);
- a fresh GitHub emulator fleet with the same queued jobs (bench_reconcile's fleet, imported), so
  that one tick admits many jobs, each through its own `lease` subflow;
- the tick runs `flows.reconcile.reconcile` in a child process whose Prefect client points at the
  server; it counts the client's retries (Prefect logs each 503/429/502 retry and its backoff);
- optionally a second client creates flow runs meanwhile (`--load-rate` per second: create,
  Running, Completed, and a UI-style list), as CI triggers and the UI would, and counts its 503s;
- the same queue is also admitted through the core protocol without Prefect, as the floor.

Run: .venv/bin/python benchmarks/bench_prefect_db.py [--runners 240] [--jobs 120] [--load-rate 2]
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


def lease_runs(api: str) -> list[dict[str, Any]]:
    """Every `lease` subflow run the server holds."""
    import httpx

    found: list[dict[str, Any]] = []
    with httpx.Client(base_url=api, timeout=60.0) as http:
        while True:
            body = {"flows": {"name": {"any_": ["lease"]}}, "limit": 200, "offset": len(found)}
            page = http.post("/flow_runs/filter", json=body)
            page.raise_for_status()
            found.extend(page.json())
            if len(page.json()) < 200:
                return found


def subflow_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """States and run times of the lease subflows (start to end, as the server recorded them)."""
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


def tick_child(api: str, gh_url: str, repo: str) -> dict[str, Any]:
    """In the child process: one reconcile tick against the server, counting client retries."""
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

    from flows.reconcile import reconcile

    started = time.perf_counter()
    error = None
    summary: dict[str, Any] = {}
    try:
        summary = asyncio.run(reconcile(scope_block=None, api_url=gh_url, repo=repo))
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[:500]}"
    wall = time.perf_counter() - started
    return {
        "wall_s": round(wall, 3),
        "summary": summary,
        "error": error,
        "client_retries": int(retries["count"]),
        "client_retry_codes": codes,
        "client_backoff_s": round(retries["backoff_s"], 2),
        "retry_logger_still_debug": client_logger.level == logging.DEBUG,
    }


def run_tick(api: str, emu: Any, workdir: Path) -> dict[str, Any]:
    """Run tick_child in a fresh interpreter with its Prefect client on `api`."""
    env = clean_env()
    env.update(TICK_ENV)
    env.update(
        PREFECT_API_URL=api,
        PREFECT_HOME=str(workdir / "client"),
        GITHUB_TOKEN=emu.token,
        SLURMGATE_STATE_DIR=str(workdir / "state"),
    )
    argv = [sys.executable, __file__, "--tick-child", api, emu.url, emu.repo]
    log = workdir / "tick.log"
    with log.open("w") as err:
        done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise BenchError(f"the tick process failed (exit {done.returncode}); see {log}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def measure_backend(
    name: str, database_url: str | None, load_rate: float, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    """One fresh server on `name`'s database, a fresh fleet, one busy tick (and the load)."""
    from bench_reconcile import fleet_sizes, load_mix, queue_jobs

    from slurmgate.testbed.emulator.testing import running_emulator

    mix = load_mix()
    pools = fleet_sizes(mix, args.runners)
    load_before = os.getloadavg()
    with (
        running_prefect_server(workdir, database_url=database_url) as server,
        running_emulator(pools) as emu,
    ):
        api, server_log, startup_s = server.api_url, server.log, server.startup_s
        queue_jobs(emu, mix, args.jobs, args.seed)
        emu.admin.reset_stats()
        print(
            f"[bench] {name}, load {load_rate}/s: server up in {startup_s:.1f} s, tick starts",
            flush=True,
        )
        with LoadClient(api, load_rate) as load:
            tick = run_tick(api, emu, workdir)
        github = emu.admin.stats()
        subflows = subflow_stats(lease_runs(api))
        load_after = os.getloadavg()
    server_text = server_log.read_text(errors="replace")
    server_503 = server_text.count(SERVER_RETRYABLE)
    summary = tick["summary"]
    leases = summary.get("admitted", 0) + summary.get("rolled_back", 0)
    result = {
        "backend": name,
        "load_rate_per_s": load_rate,
        "server_startup_s": round(startup_s, 2),
        "tick_wall_s": tick["wall_s"],
        "tick_error": tick["error"],
        "admitted": summary.get("admitted", 0),
        "rolled_back": summary.get("rolled_back", 0),
        "blocked": summary.get("blocked", 0),
        "lease_subflows": leases,
        "wall_s_per_lease_subflow": round(tick["wall_s"] / leases, 3) if leases else None,
        "lease_subflow_runs": subflows,
        "server_503s": server_503,
        "server_503s_by_route": server_503_routes(server_text),
        "tick_client_retries": tick["client_retries"],
        "tick_client_retry_codes": tick["client_retry_codes"],
        "tick_client_backoff_s": tick["client_backoff_s"],
        "retry_counter_active": tick["retry_logger_still_debug"],
        "github_requests": github["total"],
        "github_writes": github["writes"],
        "load_client": load.summary(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
    }
    print(
        f"[bench] {name}: tick {tick['wall_s']} s, {leases} lease subflows, "
        f"{server_503} server 503s, {tick['client_retries']} client retries",
        flush=True,
    )
    return result


def core_floor(args: argparse.Namespace) -> dict[str, Any]:
    """The same queue admitted through the core protocol, without Prefect."""
    from bench_reconcile import core_tick, fleet_sizes, load_mix, queue_jobs

    from slurmgate.admission.settings import AdmissionSettings
    from slurmgate.testbed.emulator.testing import running_emulator

    mix = load_mix()
    with running_emulator(fleet_sizes(mix, args.runners)) as emu:
        queue_jobs(emu, mix, args.jobs, args.seed)
        admitted, wall = asyncio.run(core_tick(emu, AdmissionSettings()))
    return {
        "wall_s": round(wall, 3),
        "admitted": admitted,
        "wall_s_per_admission": round(wall / admitted, 4) if admitted else None,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def compare(sq: dict[str, Any], pg: dict[str, Any]) -> dict[str, float | None]:
    """SQLite over PostgreSQL for one load condition."""
    return {
        "tick_wall_ratio": ratio(sq["tick_wall_s"], pg["tick_wall_s"]),
        "tick_wall_without_backoff_ratio": ratio(
            sq["tick_wall_s"] - sq["tick_client_backoff_s"],
            pg["tick_wall_s"] - pg["tick_client_backoff_s"],
        ),
        "wall_per_lease_subflow_ratio": ratio(
            sq["wall_s_per_lease_subflow"], pg["wall_s_per_lease_subflow"]
        ),
        "lease_subflow_run_time_p50_ratio": ratio(
            sq["lease_subflow_runs"]["run_time_p50_s"],
            pg["lease_subflow_runs"]["run_time_p50_s"],
        ),
        "load_client_create_p50_ratio": ratio(
            sq["load_client"]["create_p50_s"], pg["load_client"]["create_p50_s"]
        ),
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Each load condition (quiet, then loaded), each backend in turn, then the core floor."""
    conditions: list[dict[str, Any]] = []
    with postgres(workdir) as database:
        pg_started = time.perf_counter()
        database("bench_warmup")  # installs (if needed) and starts the cluster
        pg_start_s = time.perf_counter() - pg_started
        print(f"[bench] postgres up in {pg_start_s:.1f} s", flush=True)
        for index, rate in enumerate(args.load_rates):
            backends = {}
            for name in args.order:
                # a fresh database per measurement, as SQLite gets a fresh file
                url = database(f"prefect_{index}") if name == "postgres" else None
                where = workdir / f"{name}-load{rate:g}"
                backends[name] = measure_backend(name, url, rate, args, where)
            conditions.append(
                {
                    "load_rate_per_s": rate,
                    "backends": backends,
                    "sqlite_over_postgres": compare(backends["sqlite"], backends["postgres"]),
                }
            )
    for key in ("PRIORITY_SCHEDULER_ENABLED", "NODE_SLOT_SCHEDULER_ENABLED"):
        os.environ.setdefault(key, "true")
    floor = core_floor(args)
    for condition in conditions:
        condition["over_core_per_admission"] = {
            f"{name}_ratio": ratio(b["wall_s_per_lease_subflow"], floor["wall_s_per_admission"])
            for name, b in condition["backends"].items()
        }
    return {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "prefect": __import__("prefect").__version__,
        "smoke": args.smoke,
        "fleet": {"runners": args.runners, "queued_jobs": args.jobs, "seed": args.seed},
        "order": list(args.order),
        "postgres_start_s": round(pg_start_s, 2),
        "conditions": conditions,
        "core_without_prefect": floor,
    }


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
            f"{b['lease_subflow_runs']['run_time_p50_s']} / "
            f"{b['lease_subflow_runs']['run_time_p95_s']}"
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
        row("tick wall time (s)", sq["tick_wall_s"], pg["tick_wall_s"], f"{r['tick_wall_ratio']}x"),
        row("lease subflows (admitted + rolled back)", sq["lease_subflows"], pg["lease_subflows"]),
        row(
            "tick wall per lease subflow (s)",
            sq["wall_s_per_lease_subflow"],
            pg["wall_s_per_lease_subflow"],
            f"{r['wall_per_lease_subflow_ratio']}x",
        ),
        row(
            "lease subflow run time p50 / p95 (s)",
            runs(sq),
            runs(pg),
            f"{r['lease_subflow_run_time_p50_ratio']}x (p50)",
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
            "tick wall minus that backoff (s)",
            round(sq["tick_wall_s"] - sq["tick_client_backoff_s"], 2),
            round(pg["tick_wall_s"] - pg["tick_client_backoff_s"], 2),
            f"{r['tick_wall_without_backoff_ratio']}x",
        ),
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
        row(
            "per lease subflow over the core floor",
            f"{condition['over_core_per_admission']['sqlite_ratio']}x",
            f"{condition['over_core_per_admission']['postgres_ratio']}x",
        ),
        "",
    ]
    errors = [f"{b['backend']}: {b['tick_error']}" for b in (sq, pg) if b["tick_error"]]
    errors += [f"{b['backend']} load: {e}" for b in (sq, pg) for e in b["load_client"]["errors"]]
    errors += [
        f"{b['backend']}: the server holds {b['lease_subflow_runs']['count']} lease runs, the "
        f"tick made {b['lease_subflows']}"
        for b in (sq, pg)
        if b["lease_subflow_runs"]["count"] != b["lease_subflows"]
    ]
    if sq["lease_subflows"] != pg["lease_subflows"]:
        errors.append("the backends made different numbers of lease subflows")
    if errors:
        lines += ["Errors: " + "; ".join(errors), ""]
    return lines


def markdown(result: dict[str, Any]) -> str:
    fleet, floor = result["fleet"], result["core_without_prefect"]
    lines = [
        "# Prefect server on SQLite vs PostgreSQL: one busy reconcile tick",
        "",
        f"{fleet['runners']} emulator runners, {fleet['queued_jobs']} queued jobs (InferenceX "
        f"mix, seed {fleet['seed']}); each measurement on a fresh `prefect server start` "
        f"(loopback, Prefect {result['prefect']}) and a fresh fleet; PostgreSQL 15 from Debian "
        f"(throw-away cluster, started in {result['postgres_start_s']} s). Backends ran one "
        f"after the other ({' then '.join(result['order'])}) on {result['machine']['cpus']} "
        "cores shared with other work (load averages below).",
        "",
    ]
    for condition in result["conditions"]:
        lines += condition_table(condition)
    lines += [
        f"Core floor without Prefect (same queue, fresh emulator): {floor['wall_s']} s for "
        f"{floor['admitted']} admissions, {floor['wall_s_per_admission']} s each.",
        "",
    ]
    if result["smoke"]:
        lines += [SMOKE_NOTE, ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="example: .venv/bin/python benchmarks/bench_prefect_db.py --smoke "
        "--results-dir /tmp/out",
    )
    parser.add_argument("--runners", type=int, default=240, help="emulator runners (default 240)")
    parser.add_argument("--jobs", type=int, default=120, help="queued jobs (default 120)")
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
    add_output_flags(
        parser,
        "24 runners and 10 queued jobs, both backends, quiet server only (about 30 s)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.runners, args.jobs = min(args.runners, 24), min(args.jobs, 10)
    for flag in ("runners", "jobs"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.load_rate < 0:
        parser.error("--load-rate must be 0 (no load) or a positive rate per second")
    args.order = BACKENDS[::-1] if args.postgres_first else BACKENDS
    # smoke keeps the side-by-side (both backends) but measures the quiet condition only
    args.load_rates = [0.0, args.load_rate] if args.load_rate and not args.smoke else [0.0]
    return args


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--tick-child":
        print(json.dumps(tick_child(*sys.argv[2:5])))
        return
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

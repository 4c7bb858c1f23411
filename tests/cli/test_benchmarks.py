"""The README's benchmark commands, each run as written plus `--smoke --results-dir DIR`.

The commands are parsed out of the README, so a renamed script or a changed flag fails here. Each
run must measure both arms of its comparison, print the ratio, write JSON plus markdown to the
given directory, leave the committed `benchmarks/results/` alone, and leave no process behind.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ..runtime.conftest import assert_no_orphans

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "benchmarks" / "results"
COMMAND = re.compile(r"^\s*(\.venv/bin/python\s+benchmarks/bench_\w+\.py\b[^#\n]*)", re.M)
NEEDS_SLURM = {"bench_runtime.py"}
# Their smoke runs keep a wall-clock pace (the soak's controllers tick in simulated time): one at a
# time, beside the Slurm pass only, or a loaded machine leaves them too few ticks to admit.
PACED = {"bench_soak.py"}
RUN_TIMEOUT_S = 420  # a seventh benchmark of unknown size gets room; the others take 1-60 s


def readme_benchmark_commands() -> list[str]:
    """Every `.venv/bin/python benchmarks/bench_*.py ...` line in the README's code blocks."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    return [m.strip() for block in blocks for m in COMMAND.findall(block)]


def script_of(command: str) -> str:
    return Path(shlex.split(command)[1]).name


def numbers(data: Any, path: str = "") -> list[tuple[str, float]]:
    """Every numeric leaf of a JSON document with its dotted key path."""
    if isinstance(data, dict):
        return [pair for k, v in data.items() for pair in numbers(v, f"{path}.{k}")]
    if isinstance(data, list):
        return [pair for i, v in enumerate(data) for pair in numbers(v, f"{path}[{i}]")]
    if isinstance(data, int | float) and not isinstance(data, bool):
        return [(path, float(data))]
    return []


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


# ---- what each known benchmark must write (the seventh and later get the generic checks) ----


def check_plan(out: Path) -> None:
    data = json.loads((out / "plan.json").read_text())
    small, large = data["small"], data["large"]
    assert (small["runners"], large["runners"]) == (100, 1000)
    assert (small["queued_jobs"], large["queued_jobs"]) == (50, 500)
    assert positive(small["median_ms"]) and positive(large["median_ms"])
    assert small["admitted"] > 0 and large["admitted"] > 0
    assert data["ratio_large_over_small"] == pytest.approx(
        large["median_ms"] / small["median_ms"], rel=0.01
    )
    assert data["smoke"] is True and data["repeat"] == 5
    assert "Ratio large / small" in (out / "plan.md").read_text()


def check_reconcile(out: Path) -> None:
    data = json.loads((out / "reconcile.json").read_text())
    busy, idle, core = data["busy_tick"], data["idle_tick"], data["core_tick_without_prefect"]
    assert data["fleet"]["runners"] == 24 and data["fleet"]["queued_jobs"] == 8
    assert busy["admitted"] > 0 and busy["label_writes"] > 0
    # the same fleet and queue through the core protocol admits the same jobs
    assert core["admitted"] == busy["admitted"] and positive(core["wall_s"])
    assert idle["quota_used"] == 0 and idle["writes"] == 0 and idle["not_modified"] > 0
    assert positive(data["ratios"]["busy_over_idle_wall"])
    assert positive(data["ratios"]["prefect_tick_over_core_tick"])
    assert data["smoke"] is True
    assert "| measure | busy tick | idle tick | ratio |" in (out / "reconcile.md").read_text()


def check_policies(out: Path) -> None:
    data = json.loads((out / "policies.json").read_text())
    scenarios = {row["scenario"] for row in data["rows"]}
    tuning = {"kth100", "kth100x0.8", "kth100x0.75", "kth-pools"}
    held_out = {"lanl32", "lanl16", "lanl32x0.8", "lanl16x0.8", "inferencex", "inferencex-x0.7"}
    assert scenarios == tuning | held_out
    # greedy, classic EASY, the default and the two before it everywhere; fcfs, conservative
    # and planning on predictions where they explain; the eleven rejected candidates (the
    # wide fractions among them) where they tune
    explain = {"kth100", "kth100x0.8", "kth-pools", "lanl32"}
    assert len(data["rows"]) == 5 * len(scenarios) + 3 * len(explain) + 11 * len(tuning)
    assert all(row["metrics"]["jobs"] > 0 for row in data["rows"])
    assert {t["scenario"] for t in data["targets"]} == scenarios
    # the split: KTH scenarios tune, the others are held out; default and candidates all judged
    split = {t["scenario"]: t["split"] for t in data["targets"]}
    assert {k for k, v in split.items() if v == "tuning"} == tuning
    assert len(data["targets"]) == 3 * len(scenarios) + len(explain) + 11 * len(tuning)
    assert all(t["bsld"] > 0 and t["easy_mean"] > 0 for t in data["targets"])
    for policy in ("greedy", "easy"):
        drivers = data["drivers"][policy]
        assert positive(drivers["fast_s"]) and positive(drivers["via_plan_s"])
        assert positive(drivers["ratio"]) and drivers["same_schedule"] is True
    assert data["smoke"] is True
    # a smoke run draws the charts of the two scenarios with a Gantt day (an SWF log, the mix)
    charted = {"kth100", "inferencex"}
    assert {p.name.split("-wait-cdf")[0][9:] for p in out.glob("*-wait-cdf.png")} == charted
    for key in charted:
        for chart in ("wait-cdf", "wide-waits", "gantt-greedy", "gantt-default"):
            assert (out / f"policies-{key}-{chart}.png").stat().st_size > 0, (key, chart)
    assert "Replay drivers side by side" in (out / "policies.md").read_text()


def check_endpoint(out: Path) -> None:
    data = json.loads((out / "endpoint.json").read_text())
    # the peer is measured when its venv is installed already (a smoke run never installs it)
    proxies = ["slurmgate", "peer"] if data["peer_measured"] else ["slurmgate"]
    # the routers come with the dev extra: the test venv has them
    assert data["routers_measured"] == ["sglang-router", "vllm-router"]
    proxies += data["routers_measured"]
    # nginx, the C floor, comes from Debian (scripts/setup.sh installs nginx-light)
    assert data["nginx_measured"], "nginx is not installed: run scripts/setup.sh as root"
    proxies.append("nginx")
    proxies.append("python-floor")  # the least a Python proxy does: not an outside peer
    # the endpoint with HAProxy forwarding, from Debian (scripts/setup.sh installs haproxy)
    assert data["haproxy_measured"], "HAProxy is not installed: run scripts/setup.sh as root"
    proxies.append("slurmgate-haproxy")
    for key in ("json_0ms", "sse_0ms", "json_20ms", "json_0ms_rate", "sse_0ms_rate"):
        cell = data["cells"][key]
        for arm in ("direct", *proxies):
            run = cell[arm]
            assert run["requests"] > 0 and run["non_2xx"] == 0, (key, arm, run)
            assert run["socket_errors"] == 0, (key, arm, run)
        for arm in proxies:
            assert positive(cell[arm]["cpu_us_per_request"])
            assert positive(cell[arm]["throughput_over_direct"])
        if data["peer_measured"]:
            assert positive(cell["slurmgate_over_peer_cpu"])
        assert cell["best_peer"] in proxies and positive(cell["slurmgate_over_best_peer_cpu"])
        assert cell["best_peer"] != "python-floor"
        floor = cell["floor"]
        for ratio in ("floor_over_nginx", "slurmgate_over_floor"):
            assert floor[ratio]["min"] <= floor[ratio]["median"] <= floor[ratio]["max"], key
            assert positive(floor[ratio]["median"]), key
        # one round in a smoke run: the ratio is that round's, from the arms' own CPU figures
        assert floor["floor_over_nginx"]["median"] == pytest.approx(
            cell["python-floor"]["cpu_us_per_request"] / cell["nginx"]["cpu_us_per_request"]
        )
    assert positive(data["cells"]["sse_0ms"]["slurmgate"]["cpu_us_per_chunk"])
    for key, cell in data["cells"].items():
        for targets in (cell["targets"], cell["targets_haproxy"]):
            assert positive(targets["cpu_over_nginx"]["median"]), key
            assert targets["p99_over_best_peer"]["peer"] in proxies, key
        # the HAProxy arm's ratio is its own CPU over nginx's, not the Python plane's
        assert cell["targets_haproxy"]["cpu_over_nginx"]["median"] == pytest.approx(
            cell["slurmgate-haproxy"]["cpu_us_per_request"] / cell["nginx"]["cpu_us_per_request"]
        )
        assert cell["offered_rate_req_s"] == (data["offered_rate_req_s"] if "rate" in key else None)
    assert data["smoke"] is True
    text = (out / "endpoint.md").read_text()
    assert "| cell | slurmgate CPU/request | peer CPU/request | ratio |" in text
    assert "| cell | offered | arm | CPU / nginx | p99 / best peer (peer) |" in text
    assert "| cell | Python floor / nginx | slurmgate / Python floor |" in text


def check_dynamo(out: Path) -> None:
    data = json.loads((out / "dynamo.json").read_text())
    summary = data["summary"]
    for arm in ("direct", "endpoint"):
        assert summary[arm]["ok"] > 0 and summary[arm]["errors"] == 0, summary[arm]
        assert positive(summary[arm]["frontend_cpu_us_per_request"]["median"])
        assert positive(summary[arm]["ttft_p90_ms"]["median"])
    assert positive(summary["endpoint"]["endpoint_cpu_us_per_request"]["median"])
    assert positive(summary["endpoint_over_frontend_cpu"]["median"])
    assert "added_ttft_p50_ms" in summary and data["smoke"] is True


def check_pd(out: Path) -> None:
    data = json.loads((out / "pd.json").read_text())
    assert data["routers_measured"] == ["sglang-router", "slurmgate"]
    for key in ("json", "sse"):
        cell = data["cells"][key]
        for arm in data["routers_measured"]:
            run = cell[arm]
            assert run["requests"] > 0 and run["non_2xx"] == 0, (key, arm, run)
            assert run["socket_errors"] == 0, (key, arm, run)
            assert positive(run["cpu_us_per_request"])
        assert positive(cell["slurmgate_over_sglang_router_cpu"])
    assert positive(data["cells"]["sse"]["slurmgate"]["cpu_us_per_chunk"])
    ttft = data["ttft"]
    for arm in ("direct", "sglang-router", "slurmgate"):
        # every streamed answer came whole (8 events) through the pairing, direct included
        asked = ttft["requests_per_round"] * ttft["rounds"]
        assert ttft[arm]["failures"] == 0 and ttft[arm]["answered"] == asked
        assert positive(ttft[arm]["ttft_p50_ms"])
    assert positive(ttft["slurmgate_ttft_over_sglang_router"])
    assert "vllm-router" in data["vllm_router_note"] and data["smoke"] is True
    assert "| cell | slurmgate CPU/request | sglang-router CPU/request | ratio |" in (
        (out / "pd.md").read_text()
    )


def check_runtime(out: Path) -> None:
    data = json.loads((out / "runtime.json").read_text())
    for key in (
        "stub_startup_s",
        "bare_srun_N4_true_s",
        "start_to_all_lanes_ready_s",
        "prefect_flow_start_to_all_lanes_ready_s",
        "cleanup_after_success_s",
        "cancel_to_clean_s",
        "overhead_over_bare_srun",
    ):
        assert positive(data[key]), (key, data[key])
    assert data["repeat"] == 1 and all(len(v) == 1 for v in data["samples"].values())
    assert data["smoke"] is True
    assert "overhead ÷ bare srun" in (out / "runtime.md").read_text()


def check_events(out: Path) -> None:
    data = json.loads((out / "events.json").read_text())
    jobs = data["config"]["jobs_per_mode"]
    assert jobs == 3 and data["config"]["interval_s"] == 12.0
    for mode in ("events", "polling"):
        arm = data[mode]
        assert arm["missing"] == 0 and len(arm["latencies_s"]) == jobs, arm
        assert positive(arm["median_s"]) and arm["flow_runs_started"] > 0
    assert data["events"]["relay"]["posted"] >= jobs and data["events"]["relay"]["bad"] == 0
    assert data["polling"]["relay"] is None
    assert positive(data["ratio_median_polling_over_events"])
    assert data["smoke"] is True
    assert "Median ratio polling / events" in (out / "events.md").read_text()


def check_prefect_db(out: Path) -> None:
    data = json.loads((out / "prefect_db.json").read_text())
    assert data["smoke"] is True and data["order"] == ["sqlite", "postgres"]
    assert data["repeat"] == 1
    (quiet,) = data["conditions"]  # smoke measures the quiet server only
    arms = quiet["backends"]
    for backend in ("sqlite", "postgres"):
        arm = arms[backend]
        assert arm["tick_error"] is None and arm["admitted"] > 0, arm
        assert arm["lease_task_runs"]["states"] == {"COMPLETED": arm["lease_tasks"]}
        assert arm["retry_counter_active"], "the 503 counter must be live, or 0 means nothing"
        # the core arm did the same work: the same decisions and the same GitHub writes
        assert arm["core_admitted"] == arm["admitted"] and arm["core_blocked"] == arm["blocked"]
        assert arm["core_github_writes"] == arm["github_writes"]
        assert positive(arm["flow_over_core"]) and arm["prefect_api_requests"] > 0
        # the core arm started once the server had recorded the flow's task runs
        assert arm["server_catch_up_s"] >= 0 and arm["server_catch_up_cpu_s"] is not None
        assert arm["flow_over_core_runs"] == [arm["flow_over_core"]]  # smoke: one run each
    # the same fleet and queue: both servers admit the same jobs with the same GitHub writes
    assert arms["sqlite"]["admitted"] == arms["postgres"]["admitted"]
    assert arms["sqlite"]["github_writes"] == arms["postgres"]["github_writes"]
    assert arms["postgres"]["server_503s"] == 0
    assert positive(quiet["sqlite_over_postgres"]["tick_wall_ratio"])


def check_soak(out: Path) -> None:
    data = json.loads((out / "soak.json").read_text())
    faulty, clean = data["faulty"], data["fault_free"]
    assert faulty["config"]["seed"] == clean["config"]["seed"]
    assert faulty["violations_total"] == 0, faulty["evidence"]
    assert sum(faulty["faults_injected"].values()) > 0 and clean["faults_injected"] == {}
    assert faulty["admissions"] > 0 and clean["admissions"] > 0
    assert faulty["ticks"] > 0 and clean["checks"] >= clean["ticks"] > 0
    assert positive(data["ratio_api_calls_per_admission_faulty_over_fault_free"])
    assert data["smoke"] is True


def check_many_repos(out: Path) -> None:
    """The issue's targets, at any size: with events an idle tick costs no primary quota and at
    most 20 requests (the full read every K reads aside, which is the repair path), and a busy
    tick's reads stay within 2 per admission beyond an idle tick, on top of exactly N+1 writes."""
    data = json.loads((out / "many_repos.json").read_text())
    events, polling = data["events"], data["polling"]
    ev, po = events["summary"], polling["summary"]
    assert ev["idle_quota_median"] == 0 and ev["idle_requests_median"] <= 20
    quiet = [t for t in events["idle"] if t["reads"] < po["idle_requests_min"]]
    assert quiet and all(t["quota_used"] == 0 and t["requests"] <= 20 for t in quiet)
    for arm in (ev, po):
        assert arm["busy_admitted"] == data["size"]["admit"]
        assert arm["busy_writes"] == arm["busy_writes_budget_n_plus_1"]
    assert 0 <= ev["busy_reads_per_admission_over_idle"] <= 2
    # one read verifies the tick's admissions together: fewer reads than each its own
    assert ev["busy_alone_admitted"] == data["size"]["admit"]
    assert ev["busy_reads_per_admission_over_idle"] < ev["busy_alone_reads_per_admission_over_idle"]
    paced = data["paced"]  # at GitHub's write pace (left out of a smoke run: a minute of writes)
    assert all(p["admitted"] == data["size"]["paced_admit"] and not p["rolled_back"] for p in paced)
    if paced:
        default, longer = sorted(paced, key=lambda p: p["orphan_grace_s"])
        assert longer["reads_per_admission_over_quiet"] <= 2
        assert longer["reads_per_admission_over_quiet"] < default["reads_per_admission_over_quiet"]
    assert ev["idle_requests_median"] < po["idle_requests_median"]  # the events save requests
    assert data["ratios"]["idle_requests_polling_over_events"] > 1
    assert events["deliveries"] > 0 and polling["deliveries"] == 0


KNOWN: dict[str, tuple[Callable[[Path], None], str]] = {
    # script: (checks of its results, what its printed comparison says)
    "bench_plan.py": (check_plan, "Ratio large / small"),
    "bench_reconcile.py": (check_reconcile, "| ratio |"),
    "bench_policies.py": (check_policies, "slower than the fast driver"),
    "bench_endpoint.py": (check_endpoint, "| ratio |"),
    "bench_pd.py": (check_pd, "| ratio |"),
    "bench_dynamo.py": (check_dynamo, "Added by the endpoint"),
    "bench_runtime.py": (check_runtime, "÷ bare srun"),
    "bench_events.py": (check_events, "Median ratio polling / events"),
    "bench_prefect_db.py": (check_prefect_db, "SQLite / PostgreSQL"),
    "bench_soak.py": (check_soak, "Ratio API calls per admission"),
    "bench_many_repos.py": (check_many_repos, "ratio polling / events"),
}


def check_generic(out: Path) -> None:
    """Any benchmark: JSON that parses, a markdown table or a plot, and a positive ratio."""
    documents = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert documents, f"no JSON written to {out}"
    assert list(out.glob("*.md")) or list(out.glob("*.png")), f"no markdown or PNG in {out}"
    ratios = [
        (key, value)
        for doc in documents
        for key, value in numbers(doc)
        if re.search(r"ratio|_over_", key.rsplit(".", 1)[-1])
    ]
    assert any(positive(value) for _, value in ratios), f"no positive ratio among {ratios}"


def committed_state() -> dict[str, tuple[int, int]]:
    """Modification time and size of every committed result file."""
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in COMMITTED.iterdir()}


def active_bench_jobs() -> set[str]:
    """Slurm jobs the runtime benchmark starts (its stub and llama.cpp specs through slurmgate,
    and its bare `srun` arms) that are still queued or running."""
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, timeout=30, check=True
    )
    names = (" sg-local-stub-", " sg-llamacpp", " sg-bench-")
    return {line for line in out.stdout.splitlines() if any(n in line for n in names)}


COMMANDS = readme_benchmark_commands()


def test_the_readme_lists_every_known_benchmark() -> None:
    listed = {script_of(c) for c in COMMANDS}
    assert set(KNOWN) <= listed, f"README's benchmark section lacks {set(KNOWN) - listed}"
    for command in COMMANDS:
        script = REPO / shlex.split(command)[1]
        assert script.is_file(), f"README names {script.relative_to(REPO)}, which does not exist"


def test_make_bench_runs_every_readme_benchmark() -> None:
    assert re.search(r"^bench:\n\tbash scripts/bench\.sh$", (REPO / "Makefile").read_text(), re.M)
    script = REPO / "scripts" / "bench.sh"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    listed = subprocess.run(
        ["bash", str(script), "--list"], capture_output=True, text=True, timeout=30, check=True
    )
    runs = {Path(line.split()[-1]).name for line in listed.stdout.splitlines()}
    assert {script_of(c) for c in COMMANDS} <= runs, listed.stdout


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(
            c,
            id=script_of(c),
            marks=[
                *([pytest.mark.slurm] if script_of(c) in NEEDS_SLURM else []),
                *([pytest.mark.serial] if script_of(c) in PACED else []),
            ],
        )
        for c in COMMANDS
    ],
)
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_readme_benchmark_runs_small(
    command: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    script = script_of(command)
    if script in NEEDS_SLURM:
        request.getfixturevalue("slurm_cluster")
        jobs_before = active_bench_jobs()
    argv = shlex.split(command)
    if not (REPO / argv[0]).exists():  # a venv elsewhere (SLURMGATE_VENV): the same interpreter
        argv[0] = sys.executable
    out = tmp_path / "results"
    token = str(tmp_path / "proc")  # in the environment of everything the benchmark starts
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "SLURM_JOBID")}
    env.update(TMPDIR=token, PREFECT_HOME=str(tmp_path / "proc" / "prefect"))
    Path(token).mkdir()
    before = committed_state()

    ran = subprocess.run(
        [*argv, "--smoke", "--results-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert ran.returncode == 0, (
        f"{command} --smoke failed:\n{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
    )

    after = committed_state()
    touched = [p.name for p in out.iterdir() if after.get(p.name) != before.get(p.name)]
    assert not touched, f"the smoke run wrote into benchmarks/results/: {touched}"
    checks, printed = KNOWN.get(script, (check_generic, ""))
    checks(out)
    assert printed in ran.stdout, f"{script} did not print its comparison ({printed!r})"
    assert_no_orphans(token, within=15.0)
    if script in NEEDS_SLURM:
        assert active_bench_jobs() <= jobs_before, "the benchmark left Slurm jobs behind"

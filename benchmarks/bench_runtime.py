"""Runtime overhead on 4 local Slurm nodes: start-to-ready beside `srun -N4 true`, cancel-to-clean.

Run after `slurmgate cluster up` (SLURM_CONF exported):
    .venv/bin/python benchmarks/bench_runtime.py [--repeat 3] [--smoke] [--results-dir DIR]
Writes benchmarks/results/runtime.json and runtime.md. `--smoke` makes one round instead of 3.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from options import SMOKE_NOTE, add_output_flags, results_dir

from slurmgate.runtime import slurm
from slurmgate.runtime.records import RunRecord, load_records
from slurmgate.runtime.run import AllocationRun
from slurmgate.runtime.spec import AllocationSpec
from slurmgate.testbed.localproc import free_port

REPO = Path(__file__).resolve().parent.parent


def four_node_spec(hang: bool = False) -> dict[str, Any]:
    """The example, plus a dedicated client node: 4 nodes, 4 lanes, no stagger."""
    data = yaml.safe_load((REPO / "examples" / "specs" / "local-stub.yaml").read_text())
    data["client"]["dedicated_node"] = True
    data["client"]["command"] = ["true"]
    for d in data["deployments"]:
        d["lead_boot_standoff_s"] = 0
        d["rank_launch_stagger_s"] = 0
        if hang:
            d["env"] = {"SLURMGATE_STUB_HANG": "1"}
    return data


def stub_startup_s() -> float:
    """The stub's own start: spawn to /health 200, on this machine, outside Slurm."""
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmgate.testbed.stub_server", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 30:
                raise RuntimeError("stub did not start")
            time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait()


def bare_srun_s() -> float:
    t0 = time.perf_counter()
    subprocess.run(["srun", "-N4", "--ntasks-per-node=1", "true"], check=True, timeout=60)
    return time.perf_counter() - t0


def start_to_ready_s(runs_root: Path) -> dict[str, float]:
    """Controller phases up to all lanes ready (owned allocation), then cleanup."""
    run = AllocationRun(
        AllocationSpec.from_data(four_node_spec()), runs_root=runs_root, log=lambda m: None
    )
    t0 = time.perf_counter()
    try:
        run.until_ready()
        ready = time.perf_counter() - t0
    finally:
        t1 = time.perf_counter()
        run.finish(None)
        cleanup = time.perf_counter() - t1
    return {"ready_s": ready, "cleanup_s": cleanup}


def flow_start_to_ready_s(runs_root: Path) -> float:
    """The same, through the Prefect `allocation` flow (subflow per phase), from the call."""
    from flows.allocation import allocation

    spec = AllocationSpec.from_data(four_node_spec())
    t0 = time.time()
    summary = allocation(spec=spec, runs_dir=str(runs_root))
    return float(summary["timings"]["lanes_ready_at_epoch"]) - t0


def cancel_to_clean_s(runs_root: Path, spec_path: Path) -> float:
    """SIGTERM to a controller process mid-readiness → process gone and allocation over."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slurmgate.runtime.run",
            "run",
            str(spec_path),
            "--runs-dir",
            str(runs_root),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    record: RunRecord | None = None
    while time.monotonic() < deadline and record is None:
        for rec in load_records(runs_root):
            if rec.phase == "readiness" and rec.controller_pid == proc.pid:
                record = rec
        time.sleep(0.05)
    if record is None:
        proc.kill()
        raise RuntimeError("controller never reached readiness")
    time.sleep(1.0)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    while True:
        info = slurm.show_job(str(record.job_id))
        if info is None or not info.active:
            break
        time.sleep(0.02)
    return time.perf_counter() - t0


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    add_output_flags(parser, "one round instead of 3")
    args = parser.parse_args()
    if args.smoke:
        args.repeat = 1
    if not os.environ.get("SLURM_CONF"):
        print("SLURM_CONF is not set: run `slurmgate cluster up` and export it", file=sys.stderr)
        return 2
    nodes = slurm.sinfo_states()
    if len(nodes) < 4:
        print(f"needs 4 nodes, the cluster has {len(nodes)}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="slurmgate-bench-"))
    hang_spec = tmp / "hang.yaml"
    hang_spec.write_text(yaml.safe_dump(four_node_spec(hang=True)))

    os.environ.setdefault("PREFECT_HOME", str(tmp / "prefect"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    flow_start_to_ready_s(tmp / "warmup")  # starts the ephemeral Prefect server once

    stub, srun, ready, cleanup, cancel, via_flow = [], [], [], [], [], []
    for i in range(args.repeat):
        stub.append(stub_startup_s())
        srun.append(bare_srun_s())
        r = start_to_ready_s(tmp / f"ready-{i}")
        ready.append(r["ready_s"])
        cleanup.append(r["cleanup_s"])
        cancel.append(cancel_to_clean_s(tmp / f"cancel-{i}", hang_spec))
        via_flow.append(flow_start_to_ready_s(tmp / f"flow-{i}"))
        print(
            f"round {i + 1}: stub {stub[-1]:.3f}s srun -N4 {srun[-1]:.3f}s "
            f"ready {ready[-1]:.3f}s (flow {via_flow[-1]:.3f}s) cleanup {cleanup[-1]:.3f}s "
            f"cancel→clean {cancel[-1]:.3f}s",
            flush=True,
        )
    overhead = median(ready) - median(stub)
    result: dict[str, Any] = {
        "cluster": "slurm-local netns, 4 nodes, one 2-core machine",
        "repeat": args.repeat,
        "stub_startup_s": median(stub),
        "bare_srun_N4_true_s": median(srun),
        "start_to_all_lanes_ready_s": median(ready),
        "runtime_overhead_s": overhead,
        "overhead_over_bare_srun": overhead / median(srun),
        "prefect_flow_start_to_all_lanes_ready_s": median(via_flow),
        "prefect_flow_overhead_over_bare_srun": (median(via_flow) - median(stub)) / median(srun),
        "cleanup_after_success_s": median(cleanup),
        "cancel_to_clean_s": median(cancel),
        "samples": {
            "stub_startup_s": stub,
            "bare_srun_N4_true_s": srun,
            "start_to_all_lanes_ready_s": ready,
            "cleanup_after_success_s": cleanup,
            "cancel_to_clean_s": cancel,
            "prefect_flow_start_to_all_lanes_ready_s": via_flow,
        },
        "smoke": args.smoke,
    }
    out = results_dir(args)
    (out / "runtime.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        f"# Allocation runtime overhead (4-node local Slurm, medians of {args.repeat})",
        "",
        "| measurement | seconds |",
        "|---|---|",
        f"| bare `srun -N4 --ntasks-per-node=1 true` | {median(srun):.3f} |",
        f"| stub's own startup (spawn → /health 200) | {median(stub):.3f} |",
        "| controller start → all 3 lane heads ready (4 lane processes) "
        f"(salloc, resolve, 3 preflight steps, 2 launch steps, probes) | {median(ready):.3f} |",
        f"| runtime overhead = ready − stub startup | {overhead:.3f} |",
        f"| **overhead ÷ bare srun** | **{overhead / median(srun):.1f}×** |",
        "| the same through the Prefect `allocation` flow, from the call "
        f"(3 sync subflows before readiness) | {median(via_flow):.3f} |",
        f"| flow overhead ÷ bare srun | {(median(via_flow) - median(stub)) / median(srun):.1f}× |",
        f"| cleanup after success (2 serve steps + owned allocation) | {median(cleanup):.3f} |",
        f"| SIGTERM mid-readiness → controller gone, allocation over | {median(cancel):.3f} |",
        "",
        *([SMOKE_NOTE, ""] if args.smoke else []),
    ]
    (out / "runtime.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runtime overhead on 4 local Slurm nodes: start-to-ready beside `srun -N4 true`, cancel-to-clean.

Run after `slurmgate cluster up` (SLURM_CONF exported):
    .venv/bin/python benchmarks/bench_runtime.py [--repeat 3] [--smoke] [--results-dir DIR]
Writes benchmarks/results/runtime.json and runtime.md. `--smoke` makes one round instead of 3.

The llama.cpp arm runs a real engine (llama.cpp's server through xllamacpp, on a generated tiny
GGUF whose load takes a few tenths of a second): two replicas through slurmgate (`engine:
llamacpp`) to all lanes ready, beside the same command started by hand with a bare
`srun -N2` and polled for /health 200. Both include the engine's own start (spawn to /health
200 on this machine, measured too), so their difference is what slurmgate adds.
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

from slurmgate.runtime.ledger.records import RunRecord, load_records
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.slurm import commands as slurm
from slurmgate.testbed.llamacpp_server import launch_command
from slurmgate.testbed.localproc import free_port, stop_group
from slurmgate.testbed.tiny_gguf import MODEL_NAME, write_tiny_model

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
    return local_startup_s(
        [sys.executable, "-m", "slurmgate.testbed.stub_server", "--port", str(port)], port
    )


def local_startup_s(argv: list[str], port: int) -> float:
    """A server's own start: spawn to /health 200, on this machine, outside Slurm."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_healthy([f"http://127.0.0.1:{port}"], t0, proc)
        return time.perf_counter() - t0
    finally:
        stop_group(proc)


def wait_healthy(urls: list[str], t0: float, proc: subprocess.Popen[bytes]) -> None:
    """Poll every URL's /health every 10 ms until each has answered 200 once."""
    pending = set(urls)
    with httpx.Client(trust_env=False, timeout=0.5) as client:
        while pending:
            for url in sorted(pending):
                try:
                    if client.get(url + "/health").status_code == 200:
                        pending.discard(url)
                except httpx.HTTPError:
                    pass
            if not pending:
                return
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
            if time.perf_counter() - t0 > 60:
                raise RuntimeError(f"not healthy within 60 s: {sorted(pending)}")
            time.sleep(0.01)


LLAMA_NODES = 2
LLAMA_PORT = 18520


def llama_command(model: Path) -> list[str]:
    """The llama.cpp lane's command, the same for both arms (the launcher adds host and port)."""
    return [*launch_command(model, python=sys.executable), "-a", MODEL_NAME, "-lv", "1"]


def llama_spec(model: Path) -> dict[str, Any]:
    """Two llama.cpp replicas on two nodes, the client (`true`) beside the first."""
    return {
        "schema_version": 1,
        "name": "bench-llamacpp",
        "gpus_per_node": 8,
        "time_limit": "00:05:00",
        "client": {"command": ["true"], "cpus": 1},
        "deployments": [
            {
                "name": "llm",
                "engine": "llamacpp",
                "command": llama_command(model),
                "replicas": LLAMA_NODES,
                "gpus_per_node": 1,
                "base_port": LLAMA_PORT,
                "endpoint_port": 17520,
                "startup_timeout_s": 60,
                "distributed_timeout_s": 30,
                "lead_boot_standoff_s": 0,
                "rank_launch_stagger_s": 0,
            }
        ],
    }


def llama_bare_srun_s(model: Path) -> float:
    """The same server by hand: `srun -N2` of the same command, until both answer /health 200."""
    nodes = sorted(slurm.sinfo_states())[-LLAMA_NODES:]
    addresses = slurm.node_addresses(nodes)
    name = f"sg-bench-llamacpp-bare-{os.getpid()}"
    argv = [
        "srun", f"--nodes={LLAMA_NODES}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
        f"--job-name={name}", "--time=5",
        *llama_command(model), "--host", "0.0.0.0", "--port", str(LLAMA_PORT), "--metrics",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_healthy([f"http://{addresses[n]}:{LLAMA_PORT}" for n in nodes], t0, proc)
        return time.perf_counter() - t0
    finally:
        stop_group(proc)
        slurm.scancel_by_name(name)


def llama_start_to_ready_s(model: Path, runs_root: Path) -> float:
    """Through slurmgate: controller start to both llama.cpp lanes ready, then cleanup."""
    run = AllocationRun(
        AllocationSpec.from_data(llama_spec(model)), runs_root=runs_root, log=lambda m: None
    )
    t0 = time.perf_counter()
    try:
        run.until_ready()
        return time.perf_counter() - t0
    finally:
        run.finish(None)


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
    from slurmgate.flows.allocation import allocation

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

    # 100 000 extra vocabulary entries: llama.cpp's own load takes a few tenths of a second.
    model = write_tiny_model(tmp / "tiny.gguf", extra_tokens=100_000)
    llama_port = free_port()
    llama_local, llama_bare, llama_ready = [], [], []

    stub, srun, ready, cleanup, cancel, via_flow = [], [], [], [], [], []
    for i in range(args.repeat):
        stub.append(stub_startup_s())
        srun.append(bare_srun_s())
        r = start_to_ready_s(tmp / f"ready-{i}")
        ready.append(r["ready_s"])
        cleanup.append(r["cleanup_s"])
        cancel.append(cancel_to_clean_s(tmp / f"cancel-{i}", hang_spec))
        via_flow.append(flow_start_to_ready_s(tmp / f"flow-{i}"))
        llama_local.append(
            local_startup_s(
                [*llama_command(model), "--port", str(llama_port), "--metrics"], llama_port
            )
        )
        llama_bare.append(llama_bare_srun_s(model))
        llama_ready.append(llama_start_to_ready_s(model, tmp / f"llama-{i}"))
        print(
            f"round {i + 1}: stub {stub[-1]:.3f}s srun -N4 {srun[-1]:.3f}s "
            f"ready {ready[-1]:.3f}s (flow {via_flow[-1]:.3f}s) cleanup {cleanup[-1]:.3f}s "
            f"cancel→clean {cancel[-1]:.3f}s | llama.cpp: own start {llama_local[-1]:.3f}s "
            f"bare srun -N2 → /health 200 {llama_bare[-1]:.3f}s "
            f"slurmgate → ready {llama_ready[-1]:.3f}s",
            flush=True,
        )
    overhead = median(ready) - median(stub)
    llama_own = median(llama_local)
    llama_overhead = median(llama_ready) - llama_own
    llama_bare_overhead = median(llama_bare) - llama_own
    # srun's own part is tens of milliseconds; a non-positive one would be noise, not a ratio
    llama_ratio = llama_overhead / llama_bare_overhead if llama_bare_overhead > 0 else None
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
        "llamacpp": {
            "replicas": LLAMA_NODES,
            "engine_own_startup_s": llama_own,
            "bare_srun_to_health_200_s": median(llama_bare),
            "slurmgate_start_to_all_lanes_ready_s": median(llama_ready),
            "slurmgate_overhead_s": llama_overhead,
            "bare_srun_overhead_s": llama_bare_overhead,
            "slurmgate_minus_bare_srun_s": median(llama_ready) - median(llama_bare),
            "overhead_over_bare_srun": llama_ratio,
        },
        "samples": {
            "stub_startup_s": stub,
            "bare_srun_N4_true_s": srun,
            "start_to_all_lanes_ready_s": ready,
            "cleanup_after_success_s": cleanup,
            "cancel_to_clean_s": cancel,
            "prefect_flow_start_to_all_lanes_ready_s": via_flow,
            "llamacpp_engine_own_startup_s": llama_local,
            "llamacpp_bare_srun_to_health_200_s": llama_bare,
            "llamacpp_slurmgate_start_to_all_lanes_ready_s": llama_ready,
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
        f"## A real engine: llama.cpp, {LLAMA_NODES} replicas on {LLAMA_NODES} nodes",
        "",
        "llama.cpp's own server (xllamacpp) on a generated tiny GGUF; both arms run the same "
        "command and include the engine's start.",
        "",
        "| measurement | seconds |",
        "|---|---|",
        f"| engine's own start (spawn → /health 200, this machine, no Slurm) | {llama_own:.3f} |",
        f"| bare `srun -N{LLAMA_NODES}` of the same command → every /health 200 "
        f"| {median(llama_bare):.3f} |",
        "| slurmgate (`engine: llamacpp`): controller start → all lane heads ready (salloc, "
        f"resolve, preflight, launch, 2 good probes in a row) | {median(llama_ready):.3f} |",
        f"| slurmgate − bare srun | {median(llama_ready) - median(llama_bare):.3f} |",
        f"| slurmgate overhead = ready − engine's own start | {llama_overhead:.3f} |",
        f"| bare srun overhead = srun ready − engine's own start | {llama_bare_overhead:.3f} |",
        "| **llama.cpp: overhead ÷ bare srun overhead** | **"
        + (f"{llama_ratio:.1f}×" if llama_ratio is not None else "n/a (srun overhead ≤ 0)")
        + "** |",
        "",
        *([SMOKE_NOTE, ""] if args.smoke else []),
    ]
    (out / "runtime.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the logical endpoint adds in front of Dynamo's real frontend: CPU per request and TTFT.

Run: ``.venv/bin/python benchmarks/bench_dynamo.py`` (about 3 minutes; needs ``.venv-dynamo``,
which ``SLURMGATE_WITH_DYNAMO=1 scripts/setup.sh`` makes). On loopback, without Slurm: Dynamo's
frontend (ai-dynamo 1.6.1) over a prefill and a decode mocker worker (Dynamo's simulated engine,
``--speedup-ratio`` 10) with file discovery and the event plane through a ZMQ broker, as the
runtime launches them. Two arms over the same frontend and workers, in alternating rounds:

- ``direct``: slurmgate's chat load generator streams chat completions at the frontend, at a
  fixed rate (``--rate``, evenly spaced, open loop: a closed loop would let the endpoint's own
  CPU lower the offered load and with it the frontend's TTFT on a small machine);
- ``endpoint``: the same load through ``python -m slurmgate.runtime.endpoint`` in front of the
  frontend, with the deployment's backpressure (the frontend's own
  ``dynamo_frontend_queued_requests`` gauge, sampled every 100 ms).

Reported per arm, from the load generator: TTFT p50 and p90 (median over the rounds, with
their range), requests/s; from ``/proc``: the endpoint's CPU per request and, beside it, the
frontend's own CPU per request in both arms. The endpoint's added TTFT is endpoint minus direct,
round by round. ``--smoke``: one round of 2 s per arm. Results go to
``benchmarks/results/dynamo.json`` and ``dynamo.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from bench_endpoint import spread, tree_cpu_seconds
from options import add_output_flags, write_results

from slurmgate.runtime.engines.mocker import (
    SYSTEM_PORT_MAX,
    FileDiscovery,
    Launch,
    MockerOptions,
    ZmqBroker,
    frontend_launch,
    mocker_launch,
)
from slurmgate.testbed.localproc import free_port, free_port_below, stop_group

REPO = Path(__file__).resolve().parents[1]
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"
HOST = "127.0.0.1"
MODEL = "tiny"
ARMS = ("direct", "endpoint")
QUEUE = ("dynamo_frontend_queued_requests", "dynamo_frontend_inflight_requests")


class Stack:
    """The benchmark's processes, each in a session of its own, logs in `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str] | tuple[str, ...], env: dict[str, str]) -> None:
        with (self.root / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(
                list(argv),
                cwd=REPO,
                env={**os.environ, "HOME": str(self.root), "PYTHONPATH": str(REPO), **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def launch(self, name: str, launch: Launch) -> None:
        self.start(name, launch.argv, dict(launch.env))

    def wait(self, what: str, check: Any, within: float = 120.0) -> None:
        deadline = time.monotonic() + within
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    log = (self.root / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n{log}")
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                if check():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not within {within} s")
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):
            stop_group(proc, timeout=10)


@contextlib.contextmanager
def dynamo_stack(root: Path) -> Iterator[tuple[Stack, dict[str, int]]]:
    """The frontend over a prefill and a decode mocker, and the endpoint in front of it."""
    python = str(DYNAMO_PYTHON)
    model = root / MODEL
    subprocess.run(
        [python, "-m", "slurmgate.testbed.tiny_hf", str(model)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True,
        capture_output=True, timeout=120,
    )  # fmt: skip
    s = Stack(root)
    ports = {name: free_port() for name in ("http", "response", "xsub", "xpub", "endpoint")}
    discovery = FileDiscovery(str(root / "kv"))
    broker = ZmqBroker(f"tcp://{HOST}:{ports['xsub']}", f"tcp://{HOST}:{ports['xpub']}")
    try:
        s.start(
            "broker", [python, "-m", "slurmgate.testbed.zmq_broker", broker.xsub, broker.xpub], {}
        )
        options = MockerOptions(speedup_ratio=10.0)
        for role in ("prefill", "decode"):
            s.launch(
                role,
                mocker_launch(
                    role, str(model), MODEL, free_port_below(SYSTEM_PORT_MAX, HOST), HOST,
                    discovery,
                    python=python, rpc_port=free_port(), broker=broker, options=options,
                ),
            )  # fmt: skip
        s.launch(
            "frontend",
            frontend_launch(
                ports["http"], HOST, discovery, python=python,
                response_port=ports["response"], broker=broker,
            ),
        )  # fmt: skip
        frontend = f"http://{HOST}:{ports['http']}"
        s.wait(
            "the model in the frontend's /v1/models",
            lambda: MODEL in [m["id"] for m in httpx.get(f"{frontend}/v1/models").json()["data"]],
        )
        endpoint_argv = [
            sys.executable, "-m", "slurmgate.runtime.endpoint", "--name", "dyn",
            "--listen", f"{HOST}:{ports['endpoint']}", "--backend", frontend,
            "--queue-waiting-metric", QUEUE[0], "--queue-running-metric", QUEUE[1],
        ]  # fmt: skip
        s.start("endpoint", endpoint_argv, {})
        s.wait(
            "the endpoint's /health",
            lambda: httpx.get(f"http://{HOST}:{ports['endpoint']}/health").status_code == 200,
        )
        yield s, ports
    finally:
        s.stop()


def load_round(url: str, seconds: float, rate: float, workdir: Path) -> dict[str, Any]:
    """One run of slurmgate's chat load generator against `url` at `rate` requests a second,
    evenly spaced (open loop: both arms get the same offered load); its JSON report."""
    report = workdir / f"load-{time.monotonic_ns()}.json"
    argv = [
        sys.executable, "-m", "slurmgate.cli", "loadgen", url, "--chat", "--model", MODEL,
        "--rate", f"{rate:g}", "--arrivals", "constant", "--duration", f"{seconds:g}",
        "--prompt-tokens", "32", "--output-tokens", "16", "--json", "--report", str(report),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 120)
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(f"loadgen failed ({done.returncode}): {done.stderr[-1500:]}")
    data: dict[str, Any] = json.loads(report.read_text())
    return data


def idle_cpu(s: Stack, seconds: float) -> dict[str, float]:
    """CPU seconds per second each process spends with no request at all (the endpoint's
    queue sampler and health probes, the workers' and frontend's own timers)."""
    pids = {name: proc.pid for name, proc in s.procs.items()}
    before = {n: tree_cpu_seconds(p) for n, p in pids.items()}
    time.sleep(seconds)
    return {n: (tree_cpu_seconds(p) - before[n]) / seconds for n, p in pids.items()}


def measure(
    s: Stack, ports: dict[str, int], rounds: int, seconds: float, rate: float, workdir: Path
) -> dict[str, list[dict[str, Any]]]:
    urls = {
        "direct": f"http://{HOST}:{ports['http']}",
        "endpoint": f"http://{HOST}:{ports['endpoint']}",
    }
    pids = {name: proc.pid for name, proc in s.procs.items()}
    for arm in ARMS:  # warm both paths (the frontend's tokenizer, the pools)
        load_round(urls[arm], min(2.0, seconds), rate, workdir)
    out: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for _ in range(rounds):
        for arm in ARMS:
            before = {n: tree_cpu_seconds(p) for n, p in pids.items()}
            report = load_round(urls[arm], seconds, rate, workdir)
            cpu = {n: tree_cpu_seconds(p) - before[n] for n, p in pids.items()}
            ok = max(1, int(report["ok"]))
            out[arm].append(
                {
                    "ok": report["ok"],
                    "errors": report["errors"],
                    "throttled": report["throttled"],
                    "req_s": report["request_rate"],
                    "ttft_p50_ms": report["ttft"]["p50"] * 1e3,
                    "ttft_p90_ms": report["ttft"]["p90"] * 1e3,
                    "endpoint_cpu_us_per_request": cpu["endpoint"] / ok * 1e6,
                    "frontend_cpu_us_per_request": cpu["frontend"] / ok * 1e6,
                    "workers_cpu_us_per_request": (cpu["prefill"] + cpu["decode"]) / ok * 1e6,
                }
            )
    return out


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    direct, endpoint = rounds["direct"], rounds["endpoint"]
    return {
        arm: {
            key: spread([r[key] for r in rs])
            for key in (
                "req_s",
                "ttft_p50_ms",
                "ttft_p90_ms",
                "frontend_cpu_us_per_request",
                "endpoint_cpu_us_per_request",
                "workers_cpu_us_per_request",
            )
        }
        | {"errors": sum(sum(r["errors"].values()) for r in rs), "ok": sum(r["ok"] for r in rs)}
        for arm, rs in rounds.items()
    } | {
        "added_ttft_p50_ms": spread(
            [e["ttft_p50_ms"] - d["ttft_p50_ms"] for d, e in zip(direct, endpoint, strict=True)]
        ),
        "added_ttft_p90_ms": spread(
            [e["ttft_p90_ms"] - d["ttft_p90_ms"] for d, e in zip(direct, endpoint, strict=True)]
        ),
        "endpoint_over_frontend_cpu": spread(
            [
                e["endpoint_cpu_us_per_request"] / max(e["frontend_cpu_us_per_request"], 1e-9)
                for e in endpoint
            ]
        ),
    }


def markdown(results: dict[str, Any]) -> str:
    s = results["summary"]

    def cell(found: dict[str, float], unit: str = "") -> str:
        return f"{found['median']:.1f}{unit} ({found['min']:.1f}–{found['max']:.1f})"

    lines = [
        "# The logical endpoint in front of Dynamo's frontend",
        "",
        f"Run {results['when']} on {results['machine']['cpus']} CPUs, Python "
        f"{results['machine']['python']}, ai-dynamo 1.6.1 (frontend, a prefill and a decode "
        f"mocker at speedup 10, file discovery, ZMQ broker), all on loopback. Load: slurmgate's "
        f"chat load generator, streamed chats offered at {results['rate']:g} req/s evenly "
        f"spaced (open loop, the same for both arms), 32 prompt and 16 output tokens; "
        f"{results['rounds']} alternating rounds of {results['round_s']:g} s per arm. Each "
        "value is the median over the rounds, with their range.",
        "",
        f"Command: `{results['command']}`",
        "",
        "| arm | req/s | TTFT p50 ms | TTFT p90 ms | frontend CPU µs/req | endpoint CPU µs/req |",
        "|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        a = s[arm]
        endpoint_cpu = cell(a["endpoint_cpu_us_per_request"]) if arm == "endpoint" else "-"
        lines.append(
            f"| {arm} | {cell(a['req_s'])} | {cell(a['ttft_p50_ms'])} | {cell(a['ttft_p90_ms'])} "
            f"| {cell(a['frontend_cpu_us_per_request'])} | {endpoint_cpu} |"
        )
    lines += [
        "",
        f"Added by the endpoint, round by round: TTFT p50 {cell(s['added_ttft_p50_ms'], ' ms')}, "
        f"p90 {cell(s['added_ttft_p90_ms'], ' ms')}; its CPU per request is "
        f"{cell(s['endpoint_over_frontend_cpu'], '×')} the frontend's own.",
        "",
        f"Failed requests: direct {s['direct']['errors']}, endpoint {s['endpoint']['errors']} "
        f"(of {s['direct']['ok']} and {s['endpoint']['ok']} served).",
        "",
        "With no request at all, CPU per second: "
        + ", ".join(f"{name} {value * 1e3:.1f} ms" for name, value in results["idle_cpu"].items())
        + f" (over {results['idle_s']:g} s). The endpoint's share is its queue sampler (the "
        "frontend's /metrics every 100 ms) and its health probes; at "
        f"{results['rate']:g} req/s it is "
        f"{results['idle_cpu']['endpoint'] / results['rate'] * 1e6:.0f} µs per request of the "
        "endpoint's CPU above.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per arm")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per arm and round")
    parser.add_argument("--rate", type=float, default=40.0, help="requests a second offered")
    add_output_flags(parser, "one round of 2 s per arm")
    ns = parser.parse_args()
    if not DYNAMO_PYTHON.exists():
        sys.exit(
            "bench_dynamo: no Dynamo venv (.venv-dynamo): run SLURMGATE_WITH_DYNAMO=1 "
            "scripts/setup.sh first"
        )
    if ns.smoke:
        ns.rounds, ns.seconds = 1, 2.0
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="slurmgate-bench-dynamo-") as tmp,
        dynamo_stack(Path(tmp)) as (stack, ports),
    ):
        idle_s = 2.0 if ns.smoke else 10.0
        idle = idle_cpu(stack, idle_s)
        rounds = measure(stack, ports, ns.rounds, ns.seconds, ns.rate, Path(tmp))
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": ".venv/bin/python benchmarks/bench_dynamo.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "rounds": ns.rounds,
        "round_s": ns.seconds,
        "rate": ns.rate,
        "idle_s": idle_s,
        "idle_cpu": idle,
        "per_round": rounds,
        "summary": summarize(rounds),
        "smoke": ns.smoke,
    }
    results["command"] = results["command"].strip()
    results["bench_seconds"] = time.monotonic() - started
    out = write_results(ns, "dynamo", results, markdown(results))
    print(f"({results['bench_seconds']:.0f} s; wrote {out / 'dynamo'}.json and .md)")


if __name__ == "__main__":
    main()

"""CPU per request and added time to first token of the PD endpoint against sglang-router's PD mode.

Run: ``.venv/bin/python benchmarks/bench_pd.py`` (about 3 minutes on a quiet machine, at most
about 7 when every round has to be run again; loopback only). One prefill and one decode lane
of the stub engine (``slurmgate.testbed.stub_server --disaggregation-mode prefill|decode``, the
lanes SGLang's router pairs in ``tests/endpoint/test_stub_pd.py``) serve every arm of the run:

- ``sglang-router``: SGLang's gateway (Rust, from PyPI; the ``dev`` extra pins it) in PD mode,
  ``--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL``, its log at warning;
- ``slurmgate``: ``python -m slurmgate.runtime.endpoint`` with ``--prefill URL BOOTSTRAP_PORT
  --decode URL`` and its default settings (queue sampling, health probes and breakers on);
- ``direct`` (time to first token only): the client pairs the request itself, sending the same
  body with the bootstrap fields to the prefill and the decode lane at once, and reads the
  decode's stream: the latency a client sees with no router at all.

vllm-router is not an arm: its PD mode (``--vllm-pd-disaggregation``) speaks vLLM's protocol
(the prefill's answer carries ``kv_transfer_params`` that the router hands to the decode), not
SGLang's bootstrap rooms, and the stub engine (like the endpoint) plays SGLang's; see
``VLLM_NOTE``.

Two CPU cells, both driven by wrk (Debian package ``wrk``) POSTing from a Lua script: a small JSON
completion, and an SSE answer of 8 chunks. The router under test runs alone on one core; wrk
and the two lanes share the other. A router's CPU is utime + stime of its process tree
(``/proc/PID/stat``) over the round, so it does not depend on how fast the shared core lets the
lanes answer. A round in which the machine did work that is none of the arms' beyond
``--max-foreign`` of a core is run again, up to ``--retries`` times (the report says how many
were, and how many stayed noisy). Time to first token is measured after the CPU cells, in
alternating rounds of sequential streamed requests (one at a time, keep-alive) per arm.

``--smoke``: one round of 1 s per arm and cell and a few TTFT requests: a check that the
benchmark works, not a measurement. Results go to ``benchmarks/results/pd.json`` and ``pd.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httptools
import httpx
from bench_endpoint import (
    _median,
    _version,
    cores,
    cpu_model_name,
    lua_script,
    measure_round,
    pin_to_load_core,
    require_wrk,
    spawn,
    stop,
    wait_ready,
)
from options import add_output_flags, write_results

from slurmgate.testbed.localproc import free_port

CONNECTIONS = 32
SSE_CHUNKS = 8
JSON_BODY = '{"model": "m", "prompt": "hello", "max_tokens": 16}'
SSE_BODY = '{"model": "m", "prompt": "hello", "max_tokens": 8, "stream": true}'
ROUTERS = ("sglang-router", "slurmgate")  # the arms wrk drives, each its own process
TTFT_ARMS = ("direct", *ROUTERS)
STUB_FLAGS = ["--tokens-per-second", "0", "--max-concurrency", "64", "--bootstrap-timeout", "10"]
VLLM_NOTE = (
    "vllm-router (installed, pinned in the dev extra) is not measured in PD mode: its "
    "`--vllm-pd-disaggregation` sends the request to the prefill first and hands the "
    "`kv_transfer_params` of the prefill's answer to the decode (vLLM's KV-connector "
    "protocol); it injects no bootstrap room. The stub engine plays SGLang's PD protocol "
    "(bootstrap host, port and room), so through vllm-router the stub's decode lane answers "
    "400 (no bootstrap_room) to every request. Teaching the stub vLLM's protocol would not "
    "make it a like-for-like peer either: the endpoint pairs requests SGLang's way only (both "
    "lanes at once), so the two would route different protocols over differently behaving "
    "lanes. Its regular mode is measured in bench_endpoint.py."
)


@dataclass(frozen=True)
class Cell:
    key: str
    label: str
    body: str


CELLS = (
    Cell("json", "small JSON completion", JSON_BODY),
    Cell("sse", f"SSE, {SSE_CHUNKS} chunks", SSE_BODY),
)


# ---- the lanes and the arms ----------------------------------------------------------------


@dataclass
class Lanes:
    prefill: str
    decode: str
    bootstrap_port: int
    procs: list[subprocess.Popen[bytes]]


def start_lanes(load_core: int | None) -> Lanes:
    """One stub prefill lane (with its bootstrap port) and one stub decode lane."""
    p_port, d_port, boot = free_port(), free_port(), free_port()
    stub = [sys.executable, "-m", "slurmgate.testbed.stub_server", "--host", "127.0.0.1"]
    prefill = spawn(
        [*stub, "--port", str(p_port), "--disaggregation-mode", "prefill",
         "--disaggregation-bootstrap-port", str(boot), *STUB_FLAGS],
        load_core,
    )  # fmt: skip
    decode = spawn(
        [*stub, "--port", str(d_port), "--disaggregation-mode", "decode", *STUB_FLAGS], load_core
    )
    lanes = Lanes(f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}", boot, [])
    lanes.procs = [prefill, decode]
    return lanes


def arm_argv(arm: str, port: int, lanes: Lanes) -> list[str]:
    prefill = [lanes.prefill, str(lanes.bootstrap_port)]
    if arm == "sglang-router":
        return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", *prefill, "--decode", lanes.decode,
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
                "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port())]  # fmt: skip
    return [sys.executable, "-m", "slurmgate.runtime.endpoint", "--name", "bench-pd",
            "--listen", f"127.0.0.1:{port}", "--prefill", *prefill,
            "--decode", lanes.decode]  # fmt: skip


def wait_serving(url: str, timeout: float = 60.0) -> None:
    """Until a completion through the arm is answered 200: a router answers /health before its
    workers are registered (SGLang's gates on /workers), so only a paired answer says ready."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            answer = httpx.post(f"{url}/v1/completions", content=JSON_BODY, timeout=5,
                                headers={"content-type": "application/json"})  # fmt: skip
            if answer.status_code == 200:
                return
            last = f"{answer.status_code} {answer.text[:200]}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{url} answered no completion within {timeout}s (last: {last})")


# ---- time to first token -------------------------------------------------------------------


class _Answer:
    """One HTTP answer read off a socket: its status, body and when its first SSE event came."""

    def __init__(self) -> None:
        self.first_event: float | None = None
        self.complete = False
        self.body = bytearray()

    def on_body(self, data: bytes) -> None:
        if self.first_event is None and b"data:" in data:
            self.first_event = time.perf_counter()
        self.body += data

    def on_message_complete(self) -> None:
        self.complete = True


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _request(url: str, body: bytes) -> bytes:
    host = url.removeprefix("http://").encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (host, len(body))
    ) + body


def _read(sock: socket.socket) -> tuple[int, _Answer]:
    answer = _Answer()
    parser = httptools.HttpResponseParser(answer)
    while not answer.complete:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection mid-answer")
        parser.feed_data(data)
    return parser.get_status_code(), answer


def _events(body: bytes | bytearray) -> int:
    return bytes(body).count(b"data: ") - bytes(body).count(b"data: [DONE]")


def ttft_round(arm: str, url: str, lanes: Lanes, requests: int) -> dict[str, Any]:
    """``requests`` sequential streamed completions on keep-alive connections: time to the
    first SSE event and to the end of the answer, in ms."""
    ttft: list[float] = []
    total: list[float] = []
    failures = 0
    if arm == "direct":
        prefill, decode = _connect(lanes.prefill), _connect(lanes.decode)
    else:
        decode = _connect(url)
    try:
        for _ in range(requests):
            started = time.perf_counter()
            if arm == "direct":  # the pairing a router does, done by the client itself
                paired = json.loads(SSE_BODY) | {
                    "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": lanes.bootstrap_port,
                    "bootstrap_room": random.getrandbits(63),
                }
                body = json.dumps(paired, separators=(",", ":")).encode()
                prefill.sendall(_request(lanes.prefill, body))
                decode.sendall(_request(lanes.decode, body))
            else:
                decode.sendall(_request(url, SSE_BODY.encode()))
            status, answer = _read(decode)
            ended = time.perf_counter()
            if arm == "direct":
                status = max(status, _read(prefill)[0])
            if status != 200 or answer.first_event is None or _events(answer.body) != SSE_CHUNKS:
                failures += 1
                continue
            ttft.append((answer.first_event - started) * 1e3)
            total.append((ended - started) * 1e3)
    finally:
        decode.close()
        if arm == "direct":
            prefill.close()
    return {"ttft_ms": ttft, "total_ms": total, "failures": failures}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- the run -------------------------------------------------------------------------------


def run(
    ns: argparse.Namespace, wrk: str, workdir: Path
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(cells, ttft, pinning) of one run: every arm over the same two lanes."""
    proxy_core, load_core = cores()
    lanes = start_lanes(load_core)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    urls: dict[str, str] = {}
    try:
        wait_ready(f"{lanes.prefill}/health")
        wait_ready(f"{lanes.decode}/health")
        for arm in ROUTERS:
            port = free_port()
            env = None if arm == "slurmgate" else {"PATH": os.environ.get("PATH", "")}
            procs[arm] = spawn(arm_argv(arm, port, lanes), proxy_core, env=env)
            urls[arm] = f"http://127.0.0.1:{port}"
        for arm in ROUTERS:
            wait_serving(urls[arm])
        own = [p.pid for p in [*lanes.procs, *procs.values()]]
        cells: dict[str, Any] = {}
        for cell in CELLS:
            script = lua_script(cell.body, workdir)
            for arm in ROUTERS:  # warm-up: pools, caches, the lanes' first answers
                measure_round(wrk, [urls[arm]], min(1.0, ns.seconds), script, load_core,
                              procs[arm].pid, own, ns.connections)  # fmt: skip
            results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ROUTERS}
            discarded = 0
            for _ in range(ns.rounds):
                for arm in ROUTERS:
                    best: dict[str, Any] | None = None
                    for attempt in range(ns.retries + 1):
                        r = measure_round(wrk, [urls[arm]], ns.seconds, script, load_core,
                                          procs[arm].pid, own, ns.connections)  # fmt: skip
                        if best is None or r["foreign_cores"] < best["foreign_cores"]:
                            best = r
                        if r["foreign_cores"] <= ns.max_foreign:
                            break
                        discarded += attempt < ns.retries
                    assert best is not None
                    best["noisy"] = best["foreign_cores"] > ns.max_foreign
                    results[arm].append(best)
            cells[cell.key] = summarise_cell(cell, results, discarded)
        ttft = measure_ttft(ns, urls, lanes)
    finally:
        for proc in [*procs.values(), *lanes.procs]:
            stop(proc)
    pinning = {"router_core": proxy_core, "load_and_lanes_core": load_core}
    return cells, ttft, pinning


def summarise_cell(
    cell: Cell, results: dict[str, list[dict[str, Any]]], discarded: int
) -> dict[str, Any]:
    out: dict[str, Any] = {"cell": cell.label, "body": cell.body, "discarded_rounds": discarded}
    for arm, rs in results.items():
        requests = sum(r["requests"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        cpu = sum(r["proxy_cpu_s"] for r in rs)
        summary: dict[str, Any] = {
            "requests": requests,
            "non_2xx": sum(r["non_2xx"] for r in rs),
            "socket_errors": sum(r["socket_errors"] for r in rs),
            "req_s": requests / wall,
            "cpu_us_per_request": cpu / max(1, requests) * 1e6,
            "core_busy": cpu / wall,
            "p50_ms": _median([r["p50_ms"] for r in rs]),
            "p99_ms": _median([r["p99_ms"] for r in rs]),
            "foreign_cores_median": _median([r["foreign_cores"] for r in rs]),
            "noisy_rounds": sum(r["noisy"] for r in rs),
            "rounds": rs,
        }
        if cell.body is SSE_BODY:
            summary["cpu_us_per_chunk"] = summary["cpu_us_per_request"] / SSE_CHUNKS
        out[arm] = summary
    out["slurmgate_over_sglang_router_cpu"] = (
        out["slurmgate"]["cpu_us_per_request"] / out["sglang-router"]["cpu_us_per_request"]
    )
    return out


def measure_ttft(ns: argparse.Namespace, urls: dict[str, str], lanes: Lanes) -> dict[str, Any]:
    """Alternating rounds of sequential streamed requests per arm, direct included."""
    samples: dict[str, dict[str, list[float]]] = {
        arm: {"ttft_ms": [], "total_ms": []} for arm in TTFT_ARMS
    }
    failures = dict.fromkeys(TTFT_ARMS, 0)
    per_round: dict[str, list[float]] = {arm: [] for arm in TTFT_ARMS}
    for arm in TTFT_ARMS:  # warm-up
        ttft_round(arm, urls.get(arm, ""), lanes, min(10, ns.ttft_requests))
    for _ in range(ns.rounds):
        for arm in TTFT_ARMS:
            r = ttft_round(arm, urls.get(arm, ""), lanes, ns.ttft_requests)
            samples[arm]["ttft_ms"] += r["ttft_ms"]
            samples[arm]["total_ms"] += r["total_ms"]
            failures[arm] += r["failures"]
            if r["ttft_ms"]:
                per_round[arm].append(_median(r["ttft_ms"]))
    out: dict[str, Any] = {
        "requests_per_round": ns.ttft_requests,
        "rounds": ns.rounds,
        "body": SSE_BODY,
    }
    for arm in TTFT_ARMS:
        ttft, total = samples[arm]["ttft_ms"], samples[arm]["total_ms"]
        out[arm] = {
            "answered": len(ttft),
            "failures": failures[arm],
            "ttft_p50_ms": _median(ttft),
            "ttft_p90_ms": _percentile(ttft, 0.9),
            "total_p50_ms": _median(total),
            "round_medians_ms": per_round[arm],
        }
    direct = out["direct"]["ttft_p50_ms"]
    for arm in ROUTERS:
        out[arm]["added_ttft_p50_ms"] = out[arm]["ttft_p50_ms"] - direct
        out[arm]["added_ttft_p90_ms"] = out[arm]["ttft_p90_ms"] - out["direct"]["ttft_p90_ms"]
    sg, sgl = out["slurmgate"]["added_ttft_p50_ms"], out["sglang-router"]["added_ttft_p50_ms"]
    out["slurmgate_ttft_over_sglang_router"] = (
        out["slurmgate"]["ttft_p50_ms"] / out["sglang-router"]["ttft_p50_ms"]
    )
    # the added latencies' own ratio, when the router's is measurably above the direct path
    out["slurmgate_added_over_sglang_router_added"] = sg / sgl if sgl > 0.01 else None
    return out


# ---- report --------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    cells, ttft, pin = results["cells"], results["ttft"], results["pinned"]
    machine = results["machine"]
    lines = [
        "# PD endpoint benchmark: slurmgate against sglang-router in PD mode",
        "",
        f"Run {results['when']} on {machine['cpus']} CPUs ({machine['cpu']}), Python "
        f"{machine['python']}, load average {machine['load_average_at_start'][0]:.2f} at the "
        f"start and {machine['load_average_at_end'][0]:.2f} at the end (other work shares this "
        "machine). Both routers in front of the same stub "
        f"prefill lane and stub decode lane (SGLang's PD protocol: bootstrap host, port and "
        f"room); sglang-router {results['routers']['sglang-router']} with `--pd-disaggregation`"
        ". Each router pinned to core "
        f"{pin['router_core']}; wrk and the two lanes on core {pin['load_and_lanes_core']}. "
        f"wrk with {results['connections']} connections POSTing from a Lua script; "
        f"{results['rounds']} alternating rounds of {results['round_s']:g} s per arm and cell; "
        "CPU = utime + stime of the router's process tree over the rounds.",
        "",
        f"Command: `{results['command']}`",
        "",
        "| cell | slurmgate CPU/request | sglang-router CPU/request | ratio | slurmgate req/s "
        "| sglang-router req/s | rounds kept noisy (sg / sglang) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in ("json", "sse"):
        c = cells[key]
        sg, sr = c["slurmgate"], c["sglang-router"]
        per = "cpu_us_per_chunk" in sg
        sg_cpu = f"{sg['cpu_us_per_request']:.0f} µs" + (
            f" ({sg['cpu_us_per_chunk']:.1f}/chunk)" if per else ""
        )
        sr_cpu = f"{sr['cpu_us_per_request']:.0f} µs" + (
            f" ({sr['cpu_us_per_chunk']:.1f}/chunk)" if per else ""
        )
        lines.append(
            f"| {c['cell']} | {sg_cpu} | {sr_cpu} | {c['slurmgate_over_sglang_router_cpu']:.2f}× "
            f"| {sg['req_s']:.0f} | {sr['req_s']:.0f} | {sg['noisy_rounds']} / "
            f"{sr['noisy_rounds']} |"
        )
    lines += [
        "",
        f"Time to first token, one streamed request ({SSE_CHUNKS} chunks) at a time on a "
        f"keep-alive connection, {ttft['rounds']} alternating rounds of "
        f"{ttft['requests_per_round']} per arm; `direct` is the client pairing the request "
        "itself (the same body with bootstrap fields to the prefill and the decode lane at "
        "once, TTFT read on the decode's stream):",
        "",
        "| arm | TTFT p50 | TTFT p90 | added p50 over direct | added p90 | answered | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in TTFT_ARMS:
        t = ttft[arm]
        added = (
            f"{t['added_ttft_p50_ms']:+.2f} ms | {t['added_ttft_p90_ms']:+.2f} ms"
            if "added_ttft_p50_ms" in t
            else "- | -"
        )
        lines.append(
            f"| {arm} | {t['ttft_p50_ms']:.2f} ms | {t['ttft_p90_ms']:.2f} ms | {added} "
            f"| {t['answered']} | {t['failures']} |"
        )
    added_ratio = ttft["slurmgate_added_over_sglang_router_added"]
    lines += [
        "",
        f"TTFT p50 slurmgate / sglang-router: {ttft['slurmgate_ttft_over_sglang_router']:.2f}×"
        + (
            f"; added TTFT slurmgate / sglang-router: {added_ratio:.2f}×."
            if added_ratio is not None
            else "."
        ),
        "",
        "sglang-router's first token comes late because of how it writes to its client, not "
        "because of its routing: under strace it sets `TCP_NODELAY` on its connections to the "
        "lanes but not on the connections it accepts, so the first SSE event, written right "
        "after the answer's head, waits for the client's delayed ACK of that head (Linux "
        "delays it by up to 40 ms); the whole answer then arrives at once. The slurmgate "
        "endpoint and the stub lanes set `TCP_NODELAY` on every connection.",
        "",
        "wrk latency (median of the rounds' p50 / p99, ms) and foreign load (median of the "
        "rounds, in cores busy with work none of the arms did):",
        "",
        "| cell | arm | p50 | p99 | foreign cores |",
        "|---|---|---|---|---|",
    ]
    for key in ("json", "sse"):
        for arm in ROUTERS:
            a = cells[key][arm]
            lines.append(
                f"| {cells[key]['cell']} | {arm} | {a['p50_ms']:.2f} | {a['p99_ms']:.2f} "
                f"| {a['foreign_cores_median']:.2f} |"
            )
    discarded = sum(cells[k]["discarded_rounds"] for k in ("json", "sse"))
    lines += [
        "",
        f"Rounds discarded for foreign CPU load (over {results['max_foreign_cores']:g} of a core): "
        f"{discarded}, each run again (up to {results['retries']} times; a round still noisy "
        "after that is kept and counted above). The lanes are Python stubs on the shared core, "
        "so the request rates say how fast that core answered, not what a router can carry; "
        "the CPU per request is the router's own.",
        "",
        "Not measured: " + VLLM_NOTE,
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per cell")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per arm and round")
    parser.add_argument("--retries", type=int, default=2, help="re-runs of a noisy round")
    parser.add_argument("--connections", type=int, default=CONNECTIONS, help="wrk connections")
    parser.add_argument(
        "--ttft-requests", type=int, default=200, help="streamed requests per arm and TTFT round"
    )
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.1,
        help="cores of foreign CPU load above which a round is discarded",
    )
    add_output_flags(parser, "one round of 1 s per arm and cell, 20 TTFT requests per arm")
    ns = parser.parse_args()
    wrk = require_wrk()
    if ns.smoke:
        ns.rounds, ns.seconds, ns.retries, ns.ttft_requests = 1, 1.0, 0, 20
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        sys.exit("bench_pd: sglang-router is not installed: pip install -e '.[dev]'")
    pin_to_load_core()
    started = time.monotonic()
    cpu_model = cpu_model_name()
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": (".venv/bin/python benchmarks/bench_pd.py " + shlex.join(sys.argv[1:])).strip(),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_model,
            "python": platform.python_version(),
            "load_average_at_start": os.getloadavg(),
        },
        "routers": {
            "sglang-router": _version("sglang-router"),
            "vllm-router": _version("vllm-router"),
        },
        "routers_measured": list(ROUTERS),
        "vllm_router_note": VLLM_NOTE,
        "connections": ns.connections,
        "rounds": ns.rounds,
        "round_s": ns.seconds,
        "max_foreign_cores": ns.max_foreign,
        "retries": ns.retries,
    }
    with tempfile.TemporaryDirectory() as tmp:
        cells, ttft, pinned = run(ns, wrk, Path(tmp))
    results.update(cells=cells, ttft=ttft, pinned=pinned)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    results["bench_seconds"] = time.monotonic() - started
    results["smoke"] = ns.smoke
    out = write_results(ns, "pd", results, markdown(results))
    print(f"({results['bench_seconds']:.0f} s; wrote {out / 'pd'}.json and .md)")


if __name__ == "__main__":
    main()

"""Cost of the logical endpoint: one load straight to a stub and through the endpoint on one core.

Run: ``.venv/bin/python benchmarks/bench_endpoint.py`` (about 45 s, loopback only). It measures,
in one run and side by side:

1. a 20 ms backend (the stub with ``--first-token-delay 0.02``): throughput, p50/p99, the p50 the
   endpoint adds, and the endpoint's CPU per request (``/proc/<pid>/stat`` utime+stime);
2. a 0 ms backend: peak requests per second through the endpoint pinned to one core;
3. the upstream HTTP client the endpoint should use: httpx.AsyncClient against aiohttp's
   ClientSession, CPU per request for the same requests, each in a process pinned to one core.

The endpoint runs alone on core 0; the stub and this load generator share core 1. The peer
figure is DataDesigner's aiohttp proxy, about 235 us of CPU per small JSON request. Results go to
``benchmarks/results/endpoint.json`` and ``endpoint.md`` (``--results-dir DIR`` for another
place). ``--smoke`` measures every column for 1.5 s instead of 6 s, with 600 requests per client
probe: about 15 s, a check that the benchmark works, not a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from options import add_output_flags, write_results

from slurmgate.testbed.loadgen import LoadReport, LoadSpec, run_load
from slurmgate.testbed.localproc import free_port

REPO = Path(__file__).resolve().parents[1]

PEER_CPU_US = 235.0  # the peer proxy, per small JSON request: benchmarks/reference/endpoint-peer.md
CLK_TCK = os.sysconf("SC_CLK_TCK")
BODY = {"model": "stub-model", "prompt": "hello", "max_tokens": 16}


_AVAILABLE = sorted(os.sched_getaffinity(0))  # read before this process pins itself


def cores() -> tuple[int | None, int | None]:
    """(endpoint core, load core), or (None, None) when there are fewer than two cores."""
    if len(_AVAILABLE) < 2:
        return None, None
    return _AVAILABLE[0], _AVAILABLE[1]


def spawn(args: list[str], core: int | None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def pin() -> None:
        if core is not None:
            os.sched_setaffinity(0, {core})

    return subprocess.Popen(
        [sys.executable, *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=pin,
        start_new_session=True,
    )


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def wait_ready(url: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready within {timeout}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def load(url: str, concurrency: int, duration: float) -> LoadReport:
    import uvloop

    spec = LoadSpec(url=url, concurrency=concurrency, duration=duration, body=BODY)
    return uvloop.run(run_load(spec))


def reference_proxy(port: int, backend: str) -> None:
    """A peer-style proxy (aiohttp server + aiohttp client, chunked relay), run for comparison.

    It mirrors the shape of DataDesigner's aiohttp proxy without routing, retries or limits, so
    it is a lower bound for that design on this machine, measured under the same conditions.
    """
    import aiohttp
    import uvloop
    from aiohttp import web

    hop = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}

    async def handle(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
        async with session.request(
            request.method, backend + request.rel_url.raw_path_qs, data=body, headers=headers
        ) as upstream:
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in hop}
            out.pop("Content-Length", None)
            response = web.StreamResponse(status=upstream.status, headers=out)
            await response.prepare(request)
            async for chunk in upstream.content.iter_chunked(65536):
                await response.write(chunk)
            await response.write_eof()
            return response

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))

    async def close(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, loop=uvloop.new_event_loop())


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _combine(rounds: list[LoadReport]) -> dict[str, Any]:
    """Throughput over all rounds; latency percentiles as the median of the rounds' values."""
    ok = sum(r.ok for r in rounds)
    elapsed = sum(r.elapsed for r in rounds)
    return {
        "ok": ok,
        "throttled": sum(r.throttled for r in rounds),
        "errors": sum(sum(r.errors.values()) for r in rounds),
        "elapsed": elapsed,
        "throughput": ok / elapsed,
        "latency_p50": _median([r.latency_p50 for r in rounds]),
        "latency_p99": _median([r.latency_p99 for r in rounds]),
        "rounds": [r.to_dict() for r in rounds],
    }


def compare(
    backend_args: list[str],
    concurrency: int,
    duration: float,
    warmup: float,
    with_reference: bool = False,
    rounds: int = 3,
) -> dict[str, Any]:
    """Direct vs through the endpoint (and the reference proxy), same backend and load.

    The targets are measured in interleaved rounds (direct, endpoint, reference, direct, ...) so
    that other work on the machine drifting over the run weighs on every column alike.
    """
    ep_core, load_core = cores()
    stub_port, ep_port, ref_port = free_port(), free_port(), free_port()
    stub_url = f"http://127.0.0.1:{stub_port}"
    targets = {"endpoint": f"http://127.0.0.1:{ep_port}"}
    backend = spawn(
        ["-m", "slurmgate.testbed.stub_server", "--port", str(stub_port), *backend_args], load_core
    )
    procs = {
        "endpoint": spawn(
            [
                "-m", "slurmgate.runtime.endpoint", "--name", "bench",
                "--listen", f"127.0.0.1:{ep_port}", "--backend", stub_url,
            ],
            ep_core,
        )
    }  # fmt: skip
    if with_reference:
        targets["reference"] = f"http://127.0.0.1:{ref_port}"
        procs["reference"] = spawn(
            [str(Path(__file__).resolve()), "--reference-proxy", str(ref_port), "--url", stub_url],
            ep_core,
        )
    reports: dict[str, list[LoadReport]] = {"direct": [], **{name: [] for name in targets}}
    cpu = dict.fromkeys(targets, 0.0)
    wall = dict.fromkeys(targets, 0.0)
    try:
        wait_ready(f"{stub_url}/health")
        for url in targets.values():
            wait_ready(f"{url}/v1/models")
        for url in [stub_url, *targets.values()]:
            load(url, concurrency, warmup)
        for _ in range(rounds):
            reports["direct"].append(load(stub_url, concurrency, duration / rounds))
            for name, url in targets.items():
                pid = procs[name].pid
                cpu_before, wall_before = cpu_seconds(pid), time.perf_counter()
                reports[name].append(load(url, concurrency, duration / rounds))
                cpu[name] += cpu_seconds(pid) - cpu_before
                wall[name] += time.perf_counter() - wall_before
    finally:
        for proc in procs.values():
            stop(proc)
        stop(backend)
    out: dict[str, Any] = {
        "backend_args": backend_args,
        "concurrency": concurrency,
        "duration_s": duration,
        "rounds": rounds,
        "pinned": {"endpoint_core": ep_core, "load_and_stub_core": load_core},
        "direct": _combine(reports["direct"]),
    }
    direct = out["direct"]
    for name in targets:
        combined = _combine(reports[name])
        us = cpu[name] / max(1, combined["ok"] + combined["throttled"]) * 1e6
        key = "through_endpoint" if name == "endpoint" else "through_reference"
        out[key] = combined
        out[f"{name}_cpu_us_per_request"] = us
        out[f"{name}_core_utilisation"] = cpu[name] / wall[name]
        out[f"{name}_throughput_ratio"] = combined["throughput"] / direct["throughput"]
        out[f"{name}_added_p50_ms"] = (combined["latency_p50"] - direct["latency_p50"]) * 1e3
        out[f"{name}_added_p99_ms"] = (combined["latency_p99"] - direct["latency_p99"]) * 1e3
    out["endpoint_capacity_req_s_per_core"] = 1e6 / out["endpoint_cpu_us_per_request"]
    if with_reference:
        out["endpoint_over_reference_cpu"] = (
            out["endpoint_cpu_us_per_request"] / out["reference_cpu_us_per_request"]
        )
    return out


def client_probe(kind: str, url: str, requests: int, concurrency: int) -> dict[str, float]:
    """Runs inside a pinned subprocess: CPU per request of one upstream client library."""
    import uvloop

    payload = json.dumps(BODY).encode()
    target = f"{url}/v1/completions"
    per_worker = requests // concurrency

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    async def with_httpx() -> tuple[float, float]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:

            async def worker(n: int) -> None:
                for _ in range(n):
                    response = await client.post(target, content=payload)
                    await response.aread()

            await worker(50)
            start_cpu, start = cpu(), time.perf_counter()
            await asyncio.gather(*(worker(per_worker) for _ in range(concurrency)))
            return cpu() - start_cpu, time.perf_counter() - start

    async def with_aiohttp() -> tuple[float, float]:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=256)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def worker(n: int) -> None:
                for _ in range(n):
                    async with session.post(target, data=payload) as response:
                        await response.read()

            await worker(50)
            start_cpu, start = cpu(), time.perf_counter()
            await asyncio.gather(*(worker(per_worker) for _ in range(concurrency)))
            return cpu() - start_cpu, time.perf_counter() - start

    used, wall = uvloop.run(with_httpx() if kind == "httpx" else with_aiohttp())
    done = per_worker * concurrency
    return {"cpu_us_per_request": used / done * 1e6, "req_s": done / wall, "requests": done}


def compare_clients(requests: int, concurrency: int) -> dict[str, Any]:
    ep_core, load_core = cores()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    backend = spawn(
        ["-m", "slurmgate.testbed.stub_server", "--port", str(port), "--tokens-per-second", "0",
         "--max-concurrency", "1024"],
        load_core,
    )  # fmt: skip
    out: dict[str, Any] = {}
    try:
        wait_ready(f"{url}/health")
        for kind in ("httpx", "aiohttp"):
            probe = [
                sys.executable, str(Path(__file__).resolve()), "--client-probe", kind, "--url", url,
                "--requests", str(requests), "--concurrency", str(concurrency),
            ]  # fmt: skip
            if ep_core is not None:
                probe = ["taskset", "-c", str(ep_core), *probe]
            result = subprocess.run(
                probe, capture_output=True, text=True, check=True, timeout=120,
                env=dict(os.environ, PYTHONPATH=str(REPO)),
            )  # fmt: skip
            out[kind] = json.loads(result.stdout)
    finally:
        stop(backend)
    out["httpx_over_aiohttp_cpu"] = (
        out["httpx"]["cpu_us_per_request"] / out["aiohttp"]["cpu_us_per_request"]
    )
    return out


def markdown(results: dict[str, Any]) -> str:
    def ms(v: float) -> str:
        return f"{v * 1e3:.2f}"

    pinned = results["delay_20ms"]["pinned"]
    lines = [
        "# Logical endpoint benchmark",
        "",
        f"Run {results['when']} on {results['machine']['cpus']} CPUs ({results['machine']['cpu']}),"
        f" Python {results['machine']['python']}, load average "
        f"{results['machine']['load_average_at_start'][0]:.1f} at start (other work shares the "
        f"machine). Endpoint pinned to core {pinned['endpoint_core']}; stub and load generator "
        f"on core {pinned['load_and_stub_core']}. Closed loop, small JSON completions, keep-alive;"
        f" {results['delay_20ms']['rounds']} interleaved rounds per column, latency = median of "
        "the rounds. Produced by `benchmarks/bench_endpoint.py`.",
        "",
        "| backend | via | concurrency | direct req/s | via req/s | ratio | direct p50 ms "
        "| via p50 ms | added p50 ms | direct p99 ms | via p99 ms | proxy CPU us/req "
        "| proxy core busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [
        ("delay_20ms", "20 ms", "endpoint", "through_endpoint"),
        ("delay_20ms", "20 ms", "reference", "through_reference"),
        ("delay_0ms", "0 ms", "endpoint", "through_endpoint"),
        ("delay_0ms", "0 ms", "reference", "through_reference"),
    ]
    for key, label, name, through_key in rows:
        r = results[key]
        d, t = r["direct"], r[through_key]
        via = "slurmgate endpoint" if name == "endpoint" else "peer-style aiohttp proxy"
        lines.append(
            f"| {label} | {via} | {r['concurrency']} | {d['throughput']:.0f} "
            f"| {t['throughput']:.0f} | {r[name + '_throughput_ratio']:.3f} "
            f"| {ms(d['latency_p50'])} | {ms(t['latency_p50'])} | {r[name + '_added_p50_ms']:.2f} "
            f"| {ms(d['latency_p99'])} | {ms(t['latency_p99'])} "
            f"| {r[name + '_cpu_us_per_request']:.0f} | {r[name + '_core_utilisation']:.0%} |"
        )
    cpu20 = results["delay_20ms"]["endpoint_cpu_us_per_request"]
    peak = results["delay_0ms"]
    cpu0 = peak["endpoint_cpu_us_per_request"]
    clients = results["upstream_clients"]
    lines += [
        "",
        f"Endpoint CPU per request against the peer figure (DataDesigner's aiohttp proxy, "
        f"{PEER_CPU_US:.0f} us): {cpu0:.0f} us at peak = {cpu0 / PEER_CPU_US:.2f}x, "
        f"{cpu20:.0f} us with the 20 ms backend = {cpu20 / PEER_CPU_US:.2f}x. "
        f"One core's capacity at that cost: {1e6 / cpu0:.0f} req/s. Against the peer-style "
        "aiohttp proxy measured in this run on the same core: "
        f"{peak['endpoint_over_reference_cpu']:.2f}x its CPU per request (it does no routing, "
        "retries, limits or header hygiene). CPU per request falls as load rises (more requests "
        "per event-loop wake-up), so the 20 ms row, at lower load, costs more per request.",
        "",
        "## Upstream client, chosen by measurement",
        "",
        "| client | CPU us/request | req/s (one core) |",
        "|---|---|---|",
        f"| httpx.AsyncClient | {clients['httpx']['cpu_us_per_request']:.0f} "
        f"| {clients['httpx']['req_s']:.0f} |",
        f"| aiohttp.ClientSession | {clients['aiohttp']['cpu_us_per_request']:.0f} "
        f"| {clients['aiohttp']['req_s']:.0f} |",
        "",
        f"httpx costs {clients['httpx_over_aiohttp_cpu']:.1f}x the CPU of aiohttp per request, "
        "so the endpoint uses aiohttp upstream (uvicorn + httptools + uvloop downstream).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--client-probe", choices=["httpx", "aiohttp"])
    parser.add_argument("--reference-proxy", type=int, metavar="PORT")
    parser.add_argument("--url")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=6.0)
    add_output_flags(parser, "1.5 s per column and 600 requests per client probe")
    ns = parser.parse_args()
    warmup = 1.0
    if ns.smoke:
        ns.duration, ns.requests, warmup = min(ns.duration, 1.5), min(ns.requests, 600), 0.3
    if ns.reference_proxy:
        reference_proxy(ns.reference_proxy, ns.url)
        return
    if ns.client_probe:
        print(json.dumps(client_probe(ns.client_probe, ns.url, ns.requests, ns.concurrency)))
        return
    _, load_core = cores()
    if load_core is not None:
        os.sched_setaffinity(0, {load_core})
    else:
        print("warning: fewer than 2 cores; nothing is pinned", file=sys.stderr)
    started = time.monotonic()
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_model,
            "python": platform.python_version(),
            "load_average_at_start": os.getloadavg(),
        },
        "peer_cpu_us_per_request": PEER_CPU_US,
    }
    stub20 = [
        "--first-token-delay",
        "0.02",
        "--tokens-per-second",
        "0",
        "--max-concurrency",
        "1024",
    ]
    results["delay_20ms"] = compare(
        stub20, concurrency=8, duration=ns.duration, warmup=warmup, with_reference=True
    )
    stub0 = ["--tokens-per-second", "0", "--max-concurrency", "1024"]
    results["delay_0ms"] = compare(
        stub0, concurrency=64, duration=ns.duration, warmup=warmup, with_reference=True
    )
    results["upstream_clients"] = compare_clients(ns.requests, ns.concurrency)
    results["bench_seconds"] = time.monotonic() - started
    results["smoke"] = ns.smoke
    out = write_results(ns, "endpoint", results, markdown(results))
    print(f"({results['bench_seconds']:.0f} s; wrote {out / 'endpoint.json'} and .md)")


if __name__ == "__main__":
    main()

"""The endpoint as a process of its own, with a loopback side door that tells what it holds.

``python tests/security/pd_probe.py PROBE_PORT FLAGS...`` serves the endpoint as
``python -m slurmgate.runtime.endpoint FLAGS...`` does (the same flags, server and event loop),
so the process's memory is the endpoint's. Each connection to ``127.0.0.1:PROBE_PORT`` gets one
JSON line: every lane's counts, the gates, the client connections and the requests still open
on them, the requests ended, and the longest the event loop was held (a task sleeping 10 ms at
a time measures it). A connection that first sends ``full`` also gets the tasks started since
the first report and the upstream connections neither closed nor idle in a pool; that walks
every object, so it is asked only once the load is over.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
import time
from typing import Any

from slurmgate.runtime.endpoint.app import EndpointServer
from slurmgate.runtime.endpoint.config import parse_config
from slurmgate.runtime.endpoint.upstream import UpstreamConnection

TICK = 0.01


class Stalls:
    """The longest the event loop was held, beyond a sleep of TICK: its worst stall."""

    def __init__(self) -> None:
        self.longest = 0.0

    async def watch(self) -> None:
        while True:
            started = time.monotonic()
            await asyncio.sleep(TICK)
            self.longest = max(self.longest, time.monotonic() - started - TICK)


def held(server: EndpointServer, stalls: Stalls) -> dict[str, Any]:
    """What the endpoint holds now; cheap enough to ask every few milliseconds."""
    ep = server.endpoint
    stats = ep.stats
    return {
        # active, queued, awaiting an answer's start, cut off: each lane's, all 0 when idle
        "lanes": [
            [lane.active, lane.queued, len(lane.awaiting), len(lane.cut_off)] for lane in ep.lanes
        ],
        "gates": [gate._value for gate in ep.links.gates],
        "per_lane": max(1, ep.config.pool_size // len(ep.lanes)),
        "connections": len(ep.connections),
        "requests_open": sum(
            (conn.active is not None) + (conn.parsing is not None) + len(conn.waiting)
            for conn in ep.connections
        ),
        # every request ends in one status, or in a stream its lane broke
        "ended": sum(stats.statuses.values()) + stats.broken_streams,
        "statuses": {str(status): count for status, count in sorted(stats.statuses.items())},
        "idle_upstreams": sum(len(pool.idle) for pool in ep.links.pools),
        # a slow reader filled its socket, and the lane streaming to it was paused
        "client_write_pauses": stats.client_write_pauses,
        "lane_reads_paused": stats.lane_reads_paused,
        "fds": len(os.listdir("/proc/self/fd")),
        "longest_stall": stalls.longest,
    }


def leaks(server: EndpointServer, since: set[asyncio.Task[Any]]) -> dict[str, Any]:
    """Tasks started after ``since`` and still alive, and upstream connections in use."""
    me = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task not in since and task is not me]
    idle = {id(conn) for pool in server.endpoint.links.pools for conn in pool.idle}
    gc.collect()
    live = [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, UpstreamConnection) and not obj.closed and id(obj) not in idle
    ]
    return {"new_tasks": [repr(task) for task in tasks], "live_upstreams": len(live)}


async def run(probe_port: int, argv: list[str]) -> None:
    server = EndpointServer(parse_config(argv))
    await server.start()
    stalls = Stalls()
    watching = asyncio.create_task(stalls.watch())
    since: set[asyncio.Task[Any]] = set()

    async def report(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not since:  # the first report: what runs before any request
            since.update(asyncio.all_tasks() - {asyncio.current_task()})
        ask = (await reader.readline()).strip()
        state = held(server, stalls)
        if ask == b"full":
            state |= leaks(server, since)
        writer.write(json.dumps(state).encode() + b"\n")
        await writer.drain()
        writer.close()

    probe = await asyncio.start_server(report, "127.0.0.1", probe_port)
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
    await stopping.wait()
    watching.cancel()
    probe.close()
    await server.stop()


if __name__ == "__main__":
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run(int(sys.argv[1]), sys.argv[2:]))

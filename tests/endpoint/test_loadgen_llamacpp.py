"""The chat load generator's TTFT, inter-token and end-to-end latency against a real engine's
own per-request timings: llama.cpp's server (xllamacpp's wheel) on the generated tiny model.

llama.cpp ends each streamed chat answer with a ``timings`` object measured inside the server
(``prompt_ms``, ``predicted_ms``, ``predicted_per_token_ms``, ``predicted_n``; see
https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md). What a client
measures contains the server's work, so it can be no shorter; and the gaps between tokens are
the server's time per token, plus delivery jitter. No model hub is reachable here, so the model
is written by `write_tiny_model`.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from slurmgate.runtime.loadgen.chat import run_chat_load
from slurmgate.runtime.loadgen.workload import ChatLoadSpec, Lengths
from slurmgate.testbed.llamacpp_server import launch_command
from slurmgate.testbed.localproc import free_port, stop_group
from slurmgate.testbed.tiny_gguf import MODEL_NAME, write_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ready llama.cpp server on the tiny model, with two slots."""
    model = write_tiny_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    port = free_port()
    argv = [
        *launch_command(model, parallel=2, ctx_size=1024, python=sys.executable),
        *["--host", "127.0.0.1", "--port", str(port), "-a", MODEL_NAME, "-lv", "1"],
    ]
    proc = subprocess.Popen(argv, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        with httpx.Client(trust_env=False, timeout=2) as client:
            while True:
                assert proc.poll() is None, f"the server exited with {proc.returncode}"
                assert time.monotonic() < deadline, "llama.cpp was not ready in 60 s"
                with contextlib.suppress(httpx.TransportError):
                    if client.get(url + "/health").status_code == 200:
                        break
                time.sleep(0.02)
        yield url
    finally:
        stop_group(proc)


@pytest.mark.serial  # compares client-side gaps with the server's: a busy neighbour adds jitter
def test_client_latencies_agree_with_the_servers_own_timings(llama: str) -> None:
    spec = ChatLoadSpec(
        url=llama,
        model=MODEL_NAME,
        concurrency=2,
        duration=None,
        requests=10,
        prompt_tokens=Lengths.parse("uniform:8,32", "--prompt-tokens"),
        output_tokens=Lengths.parse("uniform:48,96", "--output-tokens"),
        seed=1,
        label="llamacpp",
    )
    report = asyncio.run(run_chat_load(spec))
    assert (report.ok, report.errors, report.throttled) == (10, {}, 0)
    assert report.tokens_from == "usage"
    rows = report.server_timed
    assert len(rows) == 10  # every request's server timings are kept beside the client's
    for row in rows:
        # the usage, the chunks and the server agree on the tokens generated
        assert row["output_tokens"] == row["content_chunks"] == row["server_predicted_n"]
        assert 48 <= row["output_tokens"] <= 96  # ignore_eos: max_tokens tokens each
        # the client's clock contains the server's work
        assert row["ttft"] * 1e3 >= row["server_prompt_ms"]
        assert row["e2e"] * 1e3 >= row["server_prompt_ms"] + row["server_predicted_ms"]
    # the client's mean gap between tokens is the server's time per token (median over requests)
    ratio = statistics.median(
        row["itl_mean"] * 1e3 / row["server_predicted_per_token_ms"] for row in rows
    )
    assert 0.75 <= ratio <= 1.25, ratio
    client_itl = statistics.fmean(row["itl_mean"] for row in rows) * 1e3
    server_itl = statistics.fmean(row["server_predicted_per_token_ms"] for row in rows)
    assert client_itl == pytest.approx(server_itl, rel=0.25, abs=0.2)

    # The report's table (the run's load artifact) shows the engine's own figures beside them.
    table = {row["metric"]: row for row in report.table()}
    engine_prompt = table["engine's prompt time (ms)"]
    engine_token = table["engine's time per token (ms)"]
    prompt_ms = sorted(row["server_prompt_ms"] for row in rows)
    assert float(engine_prompt["p50"]) == pytest.approx(prompt_ms[4], abs=0.051)  # nearest rank
    assert float(engine_token["mean"]) == pytest.approx(server_itl, abs=0.051)
    assert float(table["TTFT (ms)"]["p50"]) >= float(engine_prompt["p50"])
    print(report.render())  # the closing-note figures: client and engine, same requests

"""A client's load reports become Prefect artifacts: tables, a latency histogram, results."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from pathlib import Path

import pytest
from prefect import flow
from prefect.artifacts import Artifact

from slurmgate.runtime.loadgen.chat import run_chat_load
from slurmgate.runtime.loadgen.report import report_path_in, write_report
from slurmgate.runtime.loadgen.workload import ChatLoadSpec, Lengths
from slurmgate.runtime.results.raw import read_sa_bench, sa_bench_result
from slurmgate.runtime.results.records import save_record
from slurmgate.serving import ThreadedServer
from slurmgate.tasks.load_reports import publish_load_reports, publish_results
from slurmgate.testbed.stub_server import StubApp, StubState, parse_settings


def test_each_report_is_a_table_and_an_e2e_histogram_image(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stub = StubApp(StubState(parse_settings(["--tokens-per-second", "1000"])))
    with ThreadedServer(stub, lifespan="off") as server:
        spec = ChatLoadSpec(
            url=server.base_url,
            concurrency=3,
            duration=None,
            requests=12,
            output_tokens=Lengths.parse("uniform:4,12", "--output-tokens"),
            label="Chat",
        )
        report = asyncio.run(run_chat_load(spec))
    assert report.ok == 12
    write_report(report, report_path_in(tmp_path, report.label))
    (tmp_path / "loadgen-broken-1.json").write_text('{"label": "broken"')  # a cut-short file

    @flow(name="publish-load-reports-test")
    def publish() -> int:
        return publish_load_reports(tmp_path, "sg-test-run")

    assert publish() == 1
    assert any("loadgen-broken-1.json skipped" in r.getMessage() for r in caplog.records)

    table = Artifact.get("load-chat")
    assert table is not None and table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    by_metric = {row["metric"]: row for row in rows}
    assert set(by_metric) >= {"TTFT (ms)", "ITL (ms)", "e2e (ms)", "requests/s", "429 (throttled)"}
    assert by_metric["ok / sent"]["mean"] == "12 / 12"
    assert float(by_metric["e2e (ms)"]["p99"]) == pytest.approx(report.e2e["p99"] * 1e3, abs=0.06)
    assert "uniform:4,12" in (table.description or "")

    image = Artifact.get("load-chat-e2e")
    assert image is not None and image.type == "image"
    url = str(image.data)
    assert url.startswith("data:image/png;base64,")
    png = base64.b64decode(url.split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (480, 192)  # IHDR: 6 x 2.4 inches at 80 dpi
    assert "12 requests" in (image.description or "")


def test_no_reports_publish_nothing(tmp_path: Path) -> None:
    @flow(name="publish-no-load-reports-test")
    def publish() -> int:
        return publish_load_reports(tmp_path / "missing", "sg-test-run")

    assert publish() == 0


def test_each_benchmark_result_is_a_table_per_concurrency(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bench = Path(__file__).resolve().parents[1] / "data" / "results" / "vllm-bench"
    for name, via in (
        ("results_concurrency_4_gpus_12_ctx_4_gen_8.json", "frontend"),
        ("results_concurrency_8_gpus_12_ctx_4_gen_8.json", "slurmgate"),
    ):
        raw, latencies = read_sa_bench(bench / name)
        save_record(sa_bench_result(raw, latencies, url="http://10.0.0.5:8000", via=via), tmp_path)
    (tmp_path / "result-sa-bench-conc9-frontend.json").write_text('{"tool": "sa-bench"')

    @flow(name="publish-benchmark-results-test")
    def publish() -> int:
        return publish_results(tmp_path, "sg-test-run")

    assert publish() == 2
    assert any("result-sa-bench-conc9-frontend.json" in r.getMessage() for r in caplog.records)

    served = Artifact.get("result-sa-bench-c4-frontend")
    assert served is not None and served.type == "table"
    rows = json.loads(served.data) if isinstance(served.data, str) else served.data
    by_metric = {row["metric"]: row for row in rows}
    assert set(by_metric) == {
        "TTFT",
        "ITL",
        "E2E",
        "requests/s",
        "output tok/s",
        "total tok/s",
        "failed / sent",
    }
    raw, _ = read_sa_bench(bench / "results_concurrency_4_gpus_12_ctx_4_gen_8.json")
    assert by_metric["failed / sent"]["mean"] == "0 / 16"
    assert by_metric["output tok/s"]["mean"] == f"{raw.output_throughput:.1f}"
    assert "the frontend directly" in (served.description or "")
    assert "publishable" in (served.description or "")

    refused = Artifact.get("result-sa-bench-c8-slurmgate")
    assert refused is not None
    assert "slurmgate's endpoint" in (refused.description or "")
    assert "refused" in (refused.description or "") and "12/40" in (refused.description or "")

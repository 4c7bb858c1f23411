"""The admission's Prometheus metrics and the Grafana dashboard: the dashboard loads as Grafana's
own types read it, and every series its panels query is in the exposition a real tick on the
emulator (its pool mapped to the bundled cluster's partition) leaves behind."""

from __future__ import annotations

import json
import logging
import re
import socket
from pathlib import Path

import httpx
import pytest
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.models import dashboard, prometheus
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from slurmgate.admission.metrics import AdmissionMetrics
from slurmgate.admission.tick import reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.testbed.emulator.testing import running_emulator

DASHBOARD = (
    Path(__file__).resolve().parents[2] / "examples" / "grafana" / "admission-dashboard.json"
)
SERIES = re.compile(r"\bslurmgate_[a-z_]+\b")
PANEL_TYPES = {"timeseries", "stat", "table", "bargauge", "gauge"}


def panel_series() -> dict[str, set[str]]:
    """Each panel's title -> the slurmgate series its queries name."""
    doc = json.loads(DASHBOARD.read_text())
    return {
        p["title"]: {name for t in p["targets"] for name in SERIES.findall(t["expr"])}
        for p in doc["panels"]
    }


def test_the_dashboard_loads_as_grafana_reads_it() -> None:
    doc = json.loads(DASHBOARD.read_text())
    plugins.register_default_plugins()  # the Prometheus query type among them
    loaded = dashboard.Dashboard.from_json(doc)
    assert loaded.title == "slurmgate admission" and loaded.uid == "slurmgate-admission"
    assert isinstance(loaded.schema_version, int) and loaded.schema_version >= 36
    assert loaded.panels is not None and len(loaded.panels) == len(doc["panels"]) >= 8
    ids = [p.id_val for p in loaded.panels if isinstance(p, dashboard.Panel)]
    assert len(ids) == len(set(ids)) == len(loaded.panels)
    for panel in loaded.panels:
        assert isinstance(panel, dashboard.Panel) and panel.type_val in PANEL_TYPES, panel.title
        grid = panel.grid_pos
        assert grid is not None and grid.x + grid.w <= 24 and grid.h > 0, panel.title
        assert panel.targets, panel.title
        for target in panel.targets:
            assert isinstance(target, prometheus.Dataquery), panel.title  # decoded as PromQL
            assert target.expr and target.ref_id, panel.title
            assert SERIES.search(target.expr), f"{panel.title}: {target.expr}"
    # the datasource is a variable the importer picks, not this machine's
    assert doc["templating"]["list"][0] == {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_every_panel_queries_series_a_real_tick_exposes(
    slurm_cluster: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    textfile = tmp_path / "slurmgate.prom"
    monkeypatch.setenv("SLURMGATE_METRICS_TEXTFILE", str(textfile))
    settings = AdmissionSettings(
        PRIORITY_SCHEDULER_ENABLED=True,
        NODE_SLOT_SCHEDULER_ENABLED=True,
        orphan_grace_s=0,
        pool_partitions={"x": "debug"},
    )
    gate = ["ci-attempt-1"]
    with running_emulator({"x": 4}) as emu:
        three = emu.admin.add_job(
            ["self-hosted", "cluster:x", "nodes:3", "ci-job-2.000-a", *gate], 600
        )
        emu.admin.add_job(["self-hosted", "cluster:x", "nodes:2", "ci-job-1.000-b", *gate], 600)
        async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), emu.token) as gh:
            report = await reconcile_tick(direct_steps(gh, settings=settings), settings)
            limit = gh.rate_limit
            assert limit is not None  # the emulator sends x-ratelimit-* as GitHub does
            # what the reconcile flow records after each tick (flows/reconcile.record_metrics)
            metrics = AdmissionMetrics()
            metrics.record_report(
                report,
                0.42,
                api_calls=gh.calls.total,
                rate_limit=(limit.remaining, limit.limit),
                log=logging.getLogger("test_metrics"),
            )
    assert [a.job_id for a in report.anchored] == [three["id"]]
    server, thread = start_http_server(free_port(), "127.0.0.1", registry=metrics.registry)
    try:
        host, port = server.server_address[:2]
        scraped = httpx.get(f"http://{host}:{port}/metrics", timeout=10).text
    finally:
        server.shutdown()
        thread.join(5)
    samples = {
        sample.name: sample
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
    }
    for title, names in panel_series().items():
        missing = {name for name in names if name not in samples}
        assert not missing, f"panel {title!r} queries {missing}, which the tick did not expose"

    def value(name: str, **labels: str) -> float:
        found = [
            s.value
            for family in text_string_to_metric_families(scraped)
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    assert value("slurmgate_leased_nodes", pool="cluster:x") == 3
    assert value("slurmgate_blocked_jobs", pool="cluster:x", reason="no-free-capacity") == 1
    assert value("slurmgate_slurm_usable_nodes", pool="cluster:x") == 4  # Slurm's view
    assert value("slurmgate_runners_online", pool="cluster:x") == 4  # beside the runners'
    assert value("slurmgate_queued_to_anchored_seconds_count", pool="cluster:x") >= 1
    assert value("slurmgate_github_rate_limit_remaining") > 0
    # under a worker: the same exposition, written for node_exporter's textfile collector
    written = {f.name for f in text_string_to_metric_families(textfile.read_text())}
    assert {"slurmgate_blocked_jobs", "slurmgate_tick_duration_seconds"} <= written


def test_serve_refuses_a_metrics_port_without_the_admission_loop() -> None:
    from slurmgate.deployments.serve import main

    with pytest.raises(SystemExit) as exited:
        main(["--metrics-port", "9464"])
    assert exited.value.code == 2

"""The short soak: ten simulated minutes of two controllers, random faults and SIGKILLs on the
emulator, with every invariant checked after every tick (the long one is benchmarks/bench_soak.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmgate.testbed.soak import SoakConfig, run_soak


@pytest.mark.serial  # 30 s of wall-clock pace: one at a time, or too few ticks admit anything
def test_a_short_soak_breaks_no_invariant(tmp_path: Path) -> None:
    config = SoakConfig(
        seed=3,
        sim_s=600.0,
        speed=20.0,  # 30 s of wall time
        runtime_scale=0.1,  # jobs of a few minutes, so some finish and are released
        kill_mean_s=120.0,
    )
    report = run_soak(config, log_dir=tmp_path)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("*.log")))
    assert report.violations_total == 0, (report.evidence, logs)
    assert report.checks >= report.ticks >= 4
    assert set(report.ticks_by_controller) == {"a", "b"}
    assert all(ticks > 0 for ticks in report.ticks_by_controller.values())
    assert report.admissions > 0 and report.admissions_reported > 0
    assert sum(report.faults_injected.values()) > 0 and report.client_retries > 0
    # jobs finished, and each finished job's lease was released within two ticks (the checker
    # counts a late one as a lease-not-released violation)
    assert report.jobs_completed > 0 and report.releases > 0
    assert report.kills_mid_tick >= 1 and report.kills_mid_tick == report.restarts


def test_a_soak_shorter_than_a_controller_start_waits_for_its_ticks_in_flight() -> None:
    # 120 simulated seconds at 400x is 0.3 s of wall time, less than a controller takes to
    # import and make its first tick, as a loaded machine makes any short soak: the harness
    # waits for the ticks in flight rather than reporting a soak of no ticks.
    config = SoakConfig(
        seed=5, sim_s=120.0, speed=400.0, runtime_scale=0.1, fault_rate=0.0, kill_mean_s=None
    )
    report = run_soak(config)
    assert report.ticks >= 1 and report.checks >= report.ticks
    assert report.violations_total == 0, report.evidence
    assert report.kills_mid_tick == 0 and report.wall_s < 60

"""A newcomer's walk on the emulator, as typed: an 18-runner pool, three jobs, one tick, the board.

Every step is a real `slurmgate` process: the emulator serves, `emulator queue` queues a 10-, a
9- and an 8-node job (highest priority first), `reconcile --once` admits the 10, blocks the 9
and backfills the 8 into the 8 runners left, and `status` and `emulator jobs` show it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLURMGATE = [sys.executable, "-m", "slurmgate.cli"]


def test_the_emulator_walk_admits_blocks_and_backfills(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect"),  # no PREFECT_API_URL: the temporary server
        GITHUB_TOKEN="anything",
        PRIORITY_SCHEDULER_ENABLED="true",
        NODE_SLOT_SCHEDULER_ENABLED="true",
        SLURMGATE_STATE_DIR=str(tmp_path / "state"),
        SLURMGATE_MIN_WRITE_INTERVAL_S="0",  # the emulator needs no spacing between writes
        COLUMNS="80",
    )
    env.pop("DO_NOT_TRACK", None)  # the commands must be quiet without it

    def slurmgate(*args: str) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [*SLURMGATE, *args], capture_output=True, text=True, timeout=180, cwd=REPO, env=env
        )
        assert out.returncode == 0, out.stderr
        assert "Traceback" not in out.stderr and "ERROR" not in out.stderr, out.stderr
        return out

    emulator = subprocess.Popen(
        [*SLURMGATE, "emulator", "--port", "0", "--pool", "cluster:h100=18"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert emulator.stderr is not None
        match = re.search(r"on (http://127\.0\.0\.1:\d+)", emulator.stderr.readline())
        assert match
        url = match.group(1)
        jobs = {
            nodes: int(
                slurmgate(
                    "emulator", "queue", "--url", url, "--duration", "600",
                    "--labels", f"self-hosted,cluster:h100,nodes:{nodes},ci-job-{score}-n{nodes}",
                ).stdout
            )
            for nodes, score in ((10, "3.000"), (9, "2.000"), (8, "1.000"))
        }  # fmt: skip

        tick = slurmgate("reconcile", "--once", "--api-url", url, "--repo", "acme/gpu-ci")
        summary = json.loads(tick.stdout)
        assert (summary["admitted"], summary["blocked"], summary["errors"]) == (2, 1, 0)

        board = slurmgate("status", "--api-url", url, "--repo", "acme/gpu-ci").stdout
        assert "pool cluster:h100" in board
        assert "runners 18, online 18, leased 18" in board
        assert f"blocked: job {jobs[9]} (9n): no-free-capacity" in board

        listed = slurmgate("emulator", "jobs", "--url", url).stdout
        status = {int(line.split()[0]): line.split()[1] for line in listed.splitlines()}
        assert status == {jobs[10]: "in_progress", jobs[9]: "queued", jobs[8]: "in_progress"}
    finally:
        emulator.terminate()
        emulator.wait(timeout=10)

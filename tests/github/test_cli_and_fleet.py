"""`slurmgate emulator` from the command line, and the fleet builders behind it."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from slurmgate.testbed.emulator import (
    EmulatorInputError,
    build_state,
    fleet_from_job_mix,
    parse_pool,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
JOB_MIX = REPO_ROOT / "slurmgate" / "data" / "inferencex-job-mix.csv"


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurmgate.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


def test_emulator_command_serves_the_fleet() -> None:
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "slurmgate.cli", "emulator",
            "--port", "0", "--repo", "octo/bench",
            "--pool", "cluster:h100=3", "--pool", "b200=2", "--legacy", "1", "--token", "tok",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        banner = proc.stderr.readline()  # printed once the port is bound
        match = re.search(r"on (http://127\.0\.0\.1:(\d+))", banner)
        assert match, banner
        base = match.group(1)
        assert "cluster:h100=3, cluster:b200=2, legacy=1" in banner
        url = f"{base}/repos/octo/bench/actions/runners"
        deadline = time.monotonic() + 20
        while True:
            try:
                response = httpx.get(url, headers={"Authorization": "Bearer tok"})
                break
            except httpx.TransportError:
                assert proc.poll() is None, "emulator exited"
                assert time.monotonic() < deadline, "emulator did not answer"
                time.sleep(0.1)
        runners = response.json()["runners"]
        assert [r["name"] for r in runners] == [
            "h100-01", "h100-02", "h100-03", "b200-01", "b200-02", "legacy-01",
        ]  # fmt: skip
        assert [lb["name"] for lb in runners[0]["labels"]] == [
            "self-hosted", "Linux", "X64", "cluster:h100",
        ]  # fmt: skip
        assert [lb["name"] for lb in runners[-1]["labels"]] == ["self-hosted", "Linux", "X64"]
        assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
        # a second emulator on the same port: one line, exit 2
        busy = _cli("emulator", "--port", match.group(2), "--pool", "p=1")
        assert busy.returncode == 2
        assert busy.stderr.strip().splitlines() == [
            line for line in busy.stderr.strip().splitlines() if line.startswith("error: ")
        ]
        assert "cannot listen" in busy.stderr and "pick another --port" in busy.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["emulator", "--pool", "h100"], "--pool 'h100' is not cluster:NAME=COUNT"),
        (["emulator", "--pool", "cluster:h100=x"], "cluster:NAME=COUNT"),
        (["emulator", "--repo", "nobody", "--pool", "p=1"], "repo 'nobody' is not OWNER/NAME"),
        (["emulator", "--port", "99999", "--pool", "p=1"], "--port 99999"),
        (["emulator", "--port", "abc"], "--port"),
        (["emulator", "--legacy", "-2"], "--legacy -2 is negative"),
        (["emulator"], "the fleet is empty"),
        (["emulator", "--job-mix", "missing.csv"], "missing.csv"),
        (["emulator", "--nonsense"], "No such option"),
        (["frobnicate"], "No such command"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(args: list[str], fragment: str) -> None:
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and fragment in lines[0]
    assert "Traceback" not in result.stderr


def test_help_shows_an_example() -> None:
    result = _cli("emulator", "--help")
    assert result.returncode == 0
    assert "Example: slurmgate emulator --port" in " ".join(result.stdout.split())


def test_fleet_from_the_real_job_mix() -> None:
    pools = fleet_from_job_mix(JOB_MIX)
    assert pools == {
        "b200-dgxc": 10,
        "b200-nscale": 9,
        "b300-nv": 17,
        "gb200-nv": 4,
        "gb300-nv": 3,
        "h100-dgxc": 20,
        "h200-dgxc": 14,
        "mi355x-amds": 9,
    }


def test_fleet_takes_the_max_count_per_pool(tmp_path: Path) -> None:
    mix = tmp_path / "mix.csv"
    mix.write_text(
        "row,cluster_pool,runner_label_count_at_snapshot\n"
        "1,cluster:a,3\n2,cluster:a,5\n3,cluster:b,2\n4,,7\n5,cluster:c,\n"
    )
    assert fleet_from_job_mix(mix) == {"a": 5, "b": 2}
    bad = tmp_path / "bad.csv"
    bad.write_text("row,pool\n1,a\n")
    with pytest.raises(EmulatorInputError, match="cluster_pool"):
        fleet_from_job_mix(bad)


def test_parse_pool_and_build_state() -> None:
    assert parse_pool("cluster:h100=8") == ("h100", 8)
    assert parse_pool("b200=0") == ("b200", 0)
    with pytest.raises(EmulatorInputError, match="cluster:NAME=COUNT"):
        parse_pool("=3")
    state = build_state("a/b", {"cluster:x": 12}, legacy=1)
    names = [r.name for r in state.runners.values()]
    assert names[0] == "x-01" and names[11] == "x-12" and names[12] == "legacy-01"
    assert all(not r.busy and r.status == "online" for r in state.runners.values())


def test_emulator_verbs_drive_a_running_emulator() -> None:
    """Queue, dispatch, offline/online and complete by hand, the way a newcomer drives it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmgate.cli", "emulator", "--port", "0", "--pool", "h100=2"],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        match = re.search(r"on (http://127\.0\.0\.1:\d+)", proc.stderr.readline())
        assert match
        url = match.group(1)
        queued = _cli("emulator", "queue", "--url", url, "--labels", "self-hosted, cluster:h100")
        assert queued.returncode == 0 and queued.stderr == "", queued.stderr
        job_id = int(queued.stdout)
        state = httpx.get(f"{url}/_emulator/state").json()
        job = next(j for j in state["jobs"] if j["id"] == job_id)
        assert job["labels"] == ["self-hosted", "cluster:h100"]
        assert (job["status"], job["runner_name"]) == ("in_progress", "h100-01")
        listed = _cli("emulator", "jobs", "--url", url).stdout
        assert f"{job_id}  in_progress  h100-01" in listed

        off = _cli("emulator", "offline", "h100-02", "--url", url)
        assert off.returncode == 0 and off.stdout.strip() == "runner 2 (h100-02) offline"
        assert httpx.get(f"{url}/_emulator/state").json()["runners"][1]["status"] == "offline"
        assert _cli("emulator", "online", "2", "--url", url).stdout.strip().endswith("online")

        done = _cli("emulator", "complete", str(job_id), "--conclusion", "failure", "--url", url)
        assert done.stdout.strip() == f"job {job_id} completed (failure)"
        state = httpx.get(f"{url}/_emulator/state").json()
        assert next(j for j in state["jobs"] if j["id"] == job_id)["conclusion"] == "failure"

        for args, code, fragment in [
            (["offline", "h100-99"], 2, "no runner named 'h100-99'"),
            (["complete", "12345"], 2, "no job 12345"),
            (["queue", "--labels", " , "], 2, "--labels is empty"),
        ]:
            out = _cli("emulator", *args, "--url", url)
            assert out.returncode == code and out.stderr.splitlines() == [
                line for line in out.stderr.splitlines() if fragment in line
            ], out.stderr
            assert len(out.stderr.splitlines()) == 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    gone = _cli("emulator", "queue", "--labels", "x", "--url", url)
    assert gone.returncode == 1 and len(gone.stderr.splitlines()) == 1
    assert f"cannot reach the emulator at {url}" in gone.stderr and "Traceback" not in gone.stderr


def test_a_verb_waits_for_an_emulator_that_is_still_starting() -> None:
    """`slurmgate emulator … &` then `slurmgate emulator queue …` at once, as the README does:
    the verb retries the refused connection until the server answers, instead of failing."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    queue = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slurmgate.cli",
            "emulator",
            "queue",
            "--url",
            url,
            "--labels",
            "self-hosted,cluster:h100",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2.5)  # the verb has met a refused connection by now
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slurmgate.cli",
            "emulator",
            "--port",
            str(port),
            "--pool",
            "h100=1",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        out, err = queue.communicate(timeout=30)
        assert queue.returncode == 0 and err == "", err
        job_id = int(out)
        state = httpx.get(f"{url}/_emulator/state").json()
        assert [j["id"] for j in state["jobs"]] == [job_id]
    finally:
        server.terminate()
        server.wait(timeout=10)

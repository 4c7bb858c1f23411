"""Commands that run a flow, on a machine without network and without telemetry settings: they
succeed without an ERROR line or a traceback, and each says in one line where its runs go.

Everything runs inside a fresh network namespace (`unshare --net`, loopback only), so Prefect's
telemetry cannot reach the internet, exactly as on an offline machine: the GitHub emulator and
a `prefect server start` (what the README tells users to run) are started inside it too.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EMULATOR_PORT = 8787  # a new namespace has no listener: any port is free
PREFECT_PORT = 4200
API_LINE = "prefect: flow runs go to "
TEMPORARY = API_LINE + "a temporary local Prefect server (its runs, logs and artifacts vanish"
ON_SERVER = API_LINE + f"the Prefect API at http://127.0.0.1:{PREFECT_PORT}/api"

# Each step is `name: command`; the script writes NAME.out, NAME.err and NAME.rc. The first runs
# beside the others (it waits ~20 s for its temporary server while the user's server starts).
GH = f"--api-url http://127.0.0.1:{EMULATOR_PORT} --repo acme/gpu-ci"
STEPS = {
    "reconcile-temporary": f"slurmgate reconcile --once {GH}",
    "status": f"slurmgate status {GH}",
    "reconcile-server": f"PREFECT_API_URL={{api}} slurmgate reconcile --once {GH}",
    "demo-server": (
        "PREFECT_API_URL={api} slurmgate demo --mode direct --skip-runtime --live no "
        "--load 0.01 --never-fits 0 --duration 0.5 --workdir demo"
    ),
}

SCRIPT = """
set -u
ip link set lo up
slurmgate emulator --port {emulator_port} --pool cluster:h100=4 >emulator.log 2>&1 &
# the user's own server, in its own home: its database is not the temporary server's (a copy of
# the suite's migrated template, as every other test server starts from)
python -c 'import pathlib, sys; from slurmgate.prefect_db import seed_prefect_database as seed
seed(pathlib.Path(sys.argv[1]))' server-home
PREFECT_HOME="$PWD/server-home" python -m prefect server start --host 127.0.0.1 \
    --port {prefect_port} >prefect.log 2>&1 &
wait_for() {{
    python - "$1" <<'EOF'
import sys, time, httpx
deadline = time.monotonic() + 120
while True:
    try:
        httpx.get(sys.argv[1], timeout=2)
        break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"{{sys.argv[1]}} did not answer")
    time.sleep(0.3)
EOF
}}
wait_for http://127.0.0.1:{emulator_port}/
{steps}
"""


def offline_env(tmp_path: Path) -> dict[str, str]:
    """This environment without any Prefect or telemetry setting, a fresh Prefect home."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PREFECT_") and k not in ("DO_NOT_TRACK", "CI")
    }
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        SLURMGATE_STATE_DIR=str(tmp_path / "state"),
        GITHUB_TOKEN="offline-token",
        PYTHONUNBUFFERED="1",
    )
    return env


def script(steps: dict[str, str]) -> str:
    api = f"http://127.0.0.1:{PREFECT_PORT}/api"
    lines = []
    for index, (name, command) in enumerate(steps.items()):
        if "{api}" in command:
            lines.append(f"wait_for {api}/health")
        step = f"{command.format(api=api)} >{name}.out 2>{name}.err; echo $? >{name}.rc"
        lines.append(f"({step}) & beside=$!" if index == 0 else step)
    lines.append("wait $beside")
    return SCRIPT.format(
        emulator_port=EMULATOR_PORT, prefect_port=PREFECT_PORT, steps="\n".join(lines)
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="needs root, unshare and ip (iproute2) for a network namespace",
)
def test_flow_commands_offline_are_quiet_and_say_where_runs_go(tmp_path: Path) -> None:
    done = subprocess.run(
        # a PID namespace too: when the script ends, the servers it started end with it
        ["unshare", "--net", "--pid", "--fork", "--kill-child", "bash", "-c", script(STEPS)],
        cwd=tmp_path,
        env=offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    outputs = {}
    for name in STEPS:
        rc_file = tmp_path / f"{name}.rc"
        assert rc_file.exists(), f"{name} did not run: {done.stderr[-2000:]}"
        out = (tmp_path / f"{name}.out").read_text() + (tmp_path / f"{name}.err").read_text()
        outputs[name] = out
        assert rc_file.read_text().strip() == "0", f"{name}:\n{out[-3000:]}"
        assert "ERROR" not in out and "Traceback" not in out, f"{name}:\n{out[-3000:]}"
        assert "Error logging to API" not in out, f"{name}:\n{out[-3000:]}"

    def api_lines(name: str) -> list[str]:
        return [line for line in outputs[name].splitlines() if line.startswith(API_LINE)]

    # a flow's runs go to the temporary server, said once, with how to keep them
    [line] = api_lines("reconcile-temporary")
    assert line.startswith(TEMPORARY) and "set PREFECT_API_URL" in line, line
    assert (
        "prefect: starting a temporary Prefect server… ready in " in outputs["reconcile-temporary"]
    )
    assert '"board_written": true' in outputs["reconcile-temporary"]
    # or to the server PREFECT_API_URL names
    assert api_lines("reconcile-server") == [ON_SERVER]
    assert api_lines("demo-server") == [ON_SERVER]
    assert "starting a temporary" not in outputs["reconcile-server"] + outputs["demo-server"]
    demo_out = (tmp_path / "demo-server.out").read_text()
    assert demo_out.rstrip().endswith("demo: OK"), demo_out[-2000:]
    assert "8 jobs queued, 8 admitted" in demo_out
    # status reads GitHub directly and runs no flow: no Prefect at all
    assert api_lines("status") == []
    assert "h100" in outputs["status"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_says_what_starts_and_how_long_it_took(monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmgate import progress as progress_module

    piped = io.StringIO()
    with progress_module.progress("starting a thing", stream=piped):
        pass
    assert piped.getvalue() == "starting a thing… ready in 0 s\n"
    # on a terminal the line grows while it waits: never a silent gap of more than a tick
    monkeypatch.setattr(progress_module, "TICK_S", 0.05)
    terminal = _Terminal()
    with progress_module.progress("starting a thing", stream=terminal):
        time.sleep(0.3)
    text = terminal.getvalue()
    assert text.startswith("starting a thing… 0 s…") and text.endswith(" ready in 0 s\n"), text
    failed = io.StringIO()
    with pytest.raises(RuntimeError), progress_module.progress("starting", stream=failed):
        raise RuntimeError("boom")
    assert failed.getvalue() == "starting… failed after 0 s\n"


def test_a_prefect_api_that_does_not_answer_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    env = offline_env(tmp_path)
    env.update(PREFECT_API_URL="http://127.0.0.1:9/api", SLURMGATE_PREFECT_API_WAIT_S="0")
    done = subprocess.run(
        [str(BIN / "slurmgate"), "demo", "--mode", "direct", "--skip-runtime", "--live", "no"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: the Prefect API at http://127.0.0.1:9/api does not answer (ConnectError: "
        "connection refused); start it (prefect server start) or point PREFECT_API_URL at a "
        "running server"
    ], done.stderr

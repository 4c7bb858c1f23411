"""Site hooks without Slurm: the spec's checks, and the guard around real shell processes
(a failing command, a hang past the timeout, the environment, a SIGKILLed controller)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.hooks import HookInvocation, run_plain
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.credentials import RunCredentials
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError

from .conftest import assert_no_orphans, example_data, processes_with


def kill_marked(marker: str) -> None:
    """SIGKILL what a failed test left with `marker` in its environment (and the guards)."""
    for line in processes_with(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)


def _spec(hooks: dict[str, Any], **extra: Any) -> AllocationSpec:
    data = example_data()
    data["hooks"] = hooks
    data.update(extra)
    return AllocationSpec.from_data(data)


def _problem(hooks: Any) -> tuple[str, str, str]:
    data = example_data()
    data["hooks"] = hooks
    with pytest.raises(SpecError) as info:
        AllocationSpec.from_data(data)
    return info.value.problems[0]


# -- the spec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hooks,field,words",
    [
        ({"prolog": {"commands": []}}, "hooks.prolog.commands", "at least one"),
        ({"prolog": {"commands": ["true"] * 33}}, "hooks.prolog.commands", "in a script"),
        ({"prolog": {"commands": ["  "]}}, "hooks.prolog.commands", "command 0 is empty"),
        ({"prolog": {"commands": ["x" * 5000]}}, "hooks.prolog.commands", "in a script"),
        ({"epilog": {"commands": ["true"], "timeout_s": 0}}, "hooks.epilog.timeout_s", "above 0"),
        ({"epilog": {"commands": ["true"], "timeout_s": 1e6}}, "hooks.epilog.timeout_s", "a day"),
        ({"prolog": "echo hi"}, "hooks.prolog", "commands: [COMMAND"),
        ({"prolog": {"comands": ["true"]}}, "hooks.prolog.commands", "add it"),
        ({"postlog": {"commands": ["true"]}}, "hooks.postlog", "spelling"),
        (
            {"prolog": {"commands": ["true"], "env": {"HF_TOKEN": "hf_plain"}}},
            "hooks.prolog.env",
            "{from_env: NAME}",
        ),
        (
            {"prolog": {"commands": ["true"], "env": {"SLURMGATE_ENDPOINT_TOKEN": "x"}}},
            "hooks.prolog.env",
            "remove SLURMGATE_ENDPOINT_TOKEN",
        ),
        (
            {"epilog": {"commands": ["true"], "env": {"SLURMGATE_RUN_OUTCOME": "ok"}}},
            "hooks.epilog.env",
            "set by the runtime",
        ),
        ({"prolog": {"commands": ["true"], "env": {"A-B": "1"}}}, "hooks.prolog.env", "letters"),
    ],
)
def test_bad_hook_input_names_the_field_and_the_fix(hooks: Any, field: str, words: str) -> None:
    where, message, fix = _problem(hooks)
    assert where == field
    assert words in f"{message} — {fix}"


def test_hook_secrets_are_references_resolved_on_this_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SITE_STAGE_TOKEN", "stage-token-value")
    spec = _spec(
        {"prolog": {"commands": ["true"], "env": {"STAGE_TOKEN": {"from_env": "SITE_STAGE_TOKEN"}}}}
    )
    assert "hooks.prolog.env.STAGE_TOKEN: controller variable SITE_STAGE_TOKEN" in (
        spec.secret_references()
    )
    credentials = RunCredentials.resolve(spec)
    assert credentials.hook_env["prolog"] == {"STAGE_TOKEN": "stage-token-value"}
    assert "stage-token-value" in credentials.secret_values
    # The flow-run parameter keeps the reference only.
    assert "stage-token-value" not in json.dumps(spec.model_dump(mode="json"))


# -- the guard ----------------------------------------------------------------------------------


def _invocation(
    tmp_path: Path, commands: list[str], timeout_s: float = 30.0, **env: str
) -> HookInvocation:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700, exist_ok=True)
    return HookInvocation(
        "prolog", run_dir, commands, {"PATH": os.environ["PATH"], **env}, timeout_s
    )


def test_the_first_failing_command_ends_the_hook(tmp_path: Path) -> None:
    lines: list[str] = []
    invocation = _invocation(tmp_path, ["echo one", "false", "echo never"])
    run_plain(invocation, lines.append)
    outcome = invocation.outcome()
    assert outcome.returncode == 1 and not outcome.ok
    assert "prolog| one" in lines and "prolog| never" not in lines
    assert "slurmgate: prolog command 2 of 3 exited 1" in invocation.log_tail()


def test_a_hang_is_stopped_at_the_timeout_with_everything_it_started(tmp_path: Path) -> None:
    marker = f"hook-marker-{secrets.token_hex(4)}"
    invocation = _invocation(
        tmp_path,
        [
            "echo starting",
            # a background child, a daemon in a session of its own, and the foreground sleep
            "sleep 300 & (setsid sleep 301 > /dev/null 2>&1 &); sleep 302",
        ],
        timeout_s=1.5,
        HOOK_MARKER=marker,
    )
    t0 = time.monotonic()
    run_plain(invocation, lambda line: None)
    elapsed = time.monotonic() - t0
    outcome = invocation.outcome()
    assert outcome.timed_out and not outcome.ok, outcome
    assert "timed out after 1.5 s" in outcome.describe()
    assert elapsed < 10, elapsed
    assert_no_orphans(marker, within=2.0)


def test_processes_left_running_by_a_finished_hook_are_stopped(tmp_path: Path) -> None:
    marker = f"hook-marker-{secrets.token_hex(4)}"
    invocation = _invocation(
        tmp_path, ["(setsid sleep 303 > /dev/null 2>&1 &)", "echo done"], HOOK_MARKER=marker
    )
    run_plain(invocation, lambda line: None)
    outcome = invocation.outcome()
    assert outcome.ok and outcome.leftovers == 1, outcome
    assert_no_orphans(marker, within=2.0)


def test_a_leftover_still_on_its_way_to_a_session_of_its_own_is_counted(tmp_path: Path) -> None:
    """A background `sh` that has not yet run `setsid` when the shell exits is still in the
    hook's process group, so the group's SIGTERM kills it (and its `sleep`) first: it was
    left running all the same, and is counted (with its `sleep`, once that has forked)."""
    marker = f"hook-marker-{secrets.token_hex(4)}"
    invocation = _invocation(
        tmp_path,
        ["(sh -c 'sleep 2; exec setsid sleep 304' > /dev/null 2>&1 &)", "echo done"],
        HOOK_MARKER=marker,
    )
    run_plain(invocation, lambda line: None)
    outcome = invocation.outcome()
    assert outcome.ok and outcome.leftovers in (1, 2), outcome
    assert_no_orphans(marker, within=2.0)


def test_the_hook_gets_its_own_env_and_no_controller_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_API_KEY", "pnu_controller_key_1234")
    monkeypatch.setenv("SITE_CREDENTIAL", "site-credential-5678")
    monkeypatch.setenv("ENDPOINT_TOKEN_SRC", "endpoint-token-9012")
    spec = _spec(
        {
            "prolog": {
                "commands": [
                    '[ "${#STAGE_TOKEN}" = 20 ] && echo token-arrived',
                    "echo value=$STAGE_TOKEN",
                    "env | cut -d= -f1 | sort | tr '\\n' ' '",
                ],
                "env": {"STAGE_TOKEN": {"from_env": "SITE_CREDENTIAL"}, "STAGE_DIR": "/x"},
            }
        },
        endpoint_token={"from_env": "ENDPOINT_TOKEN_SRC"},
    )
    logged: list[str] = []
    run = AllocationRun(spec, runs_root=tmp_path / "runs", log=logged.append)
    outcome = run.run_hook("prolog")
    assert outcome is not None and outcome.ok, run.hooks
    text = "\n".join(logged)
    assert "prolog| token-arrived" in text
    # The value reached the hook, never the log, the hook's log file or the record.
    assert "prolog| value=***" in text
    names = next(line for line in logged if "STAGE_DIR" in line).split()
    assert {"STAGE_TOKEN", "STAGE_DIR", "SLURMGATE_HOOK", "SLURMGATE_RUN_ID"} <= set(names)
    assert not {"PREFECT_API_KEY", "SITE_CREDENTIAL", "SLURMGATE_ENDPOINT_TOKEN"} & set(names)
    for path in run.run_dir.iterdir():
        content = path.read_text(errors="replace")
        for value in ("site-credential-5678", "pnu_controller_key_1234", "endpoint-token-9012"):
            assert value not in content, path
    record = json.loads(run.record_path.read_text())
    assert record["hooks"]["prolog"]["returncode"] == 0


def test_a_failing_prolog_fails_the_run_with_its_output_tail(tmp_path: Path) -> None:
    spec = _spec(
        {
            "prolog": {"commands": ["echo staging weights", "echo 'quota exceeded' >&2; exit 3"]},
            "epilog": {"commands": ["echo epilog ran for $SLURMGATE_RUN_OUTCOME"]},
        }
    )
    run = AllocationRun(spec, runs_root=tmp_path / "runs", log=lambda line: None)
    with pytest.raises(RunFailed) as info:
        run.prolog()
    message = str(info.value)
    assert message.startswith("prolog: the prolog exited 3")
    assert "nothing was launched" in message
    assert "staging weights" in message and "quota exceeded" in message
    # The epilog runs after cleanup, once, and says how the run went; it never raises.
    run.note_failure(info.value)
    run.cleanup()
    run.cleanup()
    assert run.hooks["epilog"].ok
    assert "epilog ran for failed" in (run.run_dir / "hook-epilog.log").read_text()
    assert run.supervisor.steps == []  # nothing was launched


def test_a_failing_epilog_is_reported_and_does_not_fail_the_run(tmp_path: Path) -> None:
    spec = _spec({"epilog": {"commands": ["exit 7"]}})
    run = AllocationRun(spec, runs_root=tmp_path / "runs", log=lambda line: None)
    run.finish(None)  # no exception: cleanup was complete
    assert run.status == "succeeded"
    assert run.result().hooks["epilog"].startswith("exited 7 after")
    assert json.loads(run.record_path.read_text())["hooks"]["epilog"]["returncode"] == 7


CONTROLLER = """
import sys
from pathlib import Path
from slurmgate.runtime.hooks import HookInvocation, run_plain
inv = HookInvocation("prolog", Path(sys.argv[1]), ["echo started", "sleep 304"],
                     {"PATH": "/usr/bin:/bin", "HOOK_MARKER": sys.argv[2]}, 600.0)
run_plain(inv, lambda line: print(line, flush=True))
"""


def test_a_sigkilled_guard_leaves_no_hook_process(tmp_path: Path) -> None:
    """The guard alone is SIGKILLed (an OOM kill): it cannot stop its hook, so the runner
    stops what is left of the hook's session and the outcome says the guard died."""
    marker = f"hook-marker-{secrets.token_hex(4)}"
    invocation = _invocation(tmp_path, ["echo started; sleep 305 & sleep 306"], HOOK_MARKER=marker)
    lines: list[str] = []
    runner = threading.Thread(target=run_plain, args=(invocation, lines.append))
    runner.start()
    try:
        deadline = time.monotonic() + 10.0
        while len([p for p in processes_with(marker) if "sleep 30" in p]) < 2:
            assert time.monotonic() < deadline, "the hook's sleeps never started"
            time.sleep(0.05)
        guards = [
            int(p.split(":", 1)[0])
            for p in processes_with(str(invocation.run_dir))
            if "slurmgate.runtime.hooks" in p
        ]
        assert len(guards) == 1, guards
        os.kill(guards[0], signal.SIGKILL)
        runner.join(timeout=10.0)
        assert not runner.is_alive()
        outcome = invocation.outcome()
        assert outcome.returncode is None and not outcome.ok
        assert outcome.leftovers == 3, outcome  # the hook's bash and both sleeps
        assert "its guard died" in outcome.describe()
        assert "3 process(es) it left running were stopped" in outcome.describe()
        assert_no_orphans(marker, within=2.0)
    finally:
        kill_marked(marker)
        runner.join(timeout=10.0)


def test_a_sigkilled_controller_leaves_no_hook_process(tmp_path: Path) -> None:
    marker = f"hook-marker-{secrets.token_hex(4)}"
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    controller = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, str(run_dir), marker],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert controller.stdout is not None
        assert controller.stdout.readline().strip() == "prolog| started"
        # "started" is printed before the shell forks the sleep, so wait for it to exist
        deadline = time.monotonic() + 10.0
        while not any("sleep 304" in p for p in processes_with(marker)):
            assert time.monotonic() < deadline, "the hook's sleep never started"
            time.sleep(0.05)
        controller.send_signal(signal.SIGKILL)
        controller.wait()
        assert_no_orphans(marker, within=3.0)
        assert_no_orphans(str(run_dir), within=5.0)  # the guard too, once it has said why
        result = json.loads((run_dir / "hook-prolog.json").read_text())
        assert result["stopped_by"] == "parent exited"
    finally:
        controller.kill()
        controller.wait()
        kill_marked(marker)
        kill_marked(str(run_dir))

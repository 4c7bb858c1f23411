"""The lane launcher: a Python program with variables set from files, run as `python` would run it.

It sets each variable inside its process (C's getenv finds it, as Dynamo's Rust runtime reads
it), so neither the environment exec handed it (/proc/PID/environ) nor argv holds the text;
the program sees the argv, sys.path and `__main__` it would have without the launcher.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.steps import lane_launcher
from slurmgate.runtime.steps.lane_launcher import launcher_argv, split_python

PY = sys.executable


@pytest.mark.parametrize(
    ("command", "head", "program"),
    [
        ("/venv/bin/python -m dynamo.frontend --http-port 1", "/venv/bin/python",
         "-m dynamo.frontend --http-port 1"),
        ("python3 -u -X dev -m m -c", "python3 -u -X dev", "-m m -c"),
        ("python3.11 -Wd -mdynamo.mocker", "python3.11 -Wd", "-m dynamo.mocker"),
        ("python -um m a", "python -u", "-m m a"),
        ("python -Xdev -c pass x", "python -Xdev", "-c pass x"),
        ("python -I serve.py -m", "python -I", "serve.py -m"),
        ("python --check-hash-based-pycs always -m m", "python --check-hash-based-pycs always",
         "-m m"),
        ("python -m", None, None),
        ("python -", None, None),
        ("python -- serve.py", None, None),
        ("python", None, None),
        ("dynamo-run in=http", None, None),
        ("numactl -m 0 python3 -m dynamo.sglang", None, None),
        ("bash -c python", None, None),
        ("", None, None),
    ],
)  # fmt: skip
def test_it_takes_a_python_program_in_any_of_its_forms_and_nothing_else(
    command: str, head: str | None, program: str | None
) -> None:
    argv = command.split()
    wrapped = launcher_argv(argv, "/lane/lane-launcher.py", [("K", "/lane/k.pem")])
    if head is None or program is None:
        assert split_python(argv) is None and wrapped is None
    else:
        assert split_python(argv) == (head.split(), program.split())
        launcher = ["/lane/lane-launcher.py", "K=/lane/k.pem", "--"]
        assert wrapped == [*head.split(), *launcher, *program.split()]


# What a program sees of how it was started, and whether SG_SECRET reaches it and where.
PROBE = """
import ctypes, json, os, sys
getenv = ctypes.CDLL(None).getenv
getenv.restype = ctypes.c_char_p
with open("/proc/self/environ", "rb") as f:
    exec_environment = f.read()
with open("/proc/self/cmdline", "rb") as f:
    cmdline = f.read()
value = getenv(b"SG_SECRET")
body = value.splitlines()[1] if value else b"SG_SECRET"
print(json.dumps({
    "argv": sys.argv,
    "path0": sys.path[0],
    "name": __name__,
    "main_is_this": sys.modules["__main__"].__dict__ is globals(),
    "getenv": value.decode() if value else None,
    "os_environ": "SG_SECRET" in os.environ,
    "exec_environment": b"SG_SECRET" in exec_environment or body in exec_environment,
    "cmdline": body in cmdline,
}))
"""
SECRET = (
    "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49\n-----END PRIVATE KEY-----\n"
)


@pytest.fixture
def lane(tmp_path: Path) -> Path:
    """A lane's directory with the launcher and a key file, and a probe module beside it."""
    where = tmp_path / "lane"
    where.mkdir(mode=0o700)
    shutil.copy(lane_launcher.__file__, where / lane_launcher.FILE_NAME)
    (where / "key.pem").write_text(SECRET)
    (tmp_path / "probe.py").write_text(PROBE)
    return where


def _run(argv: list[str], cwd: Path) -> Any:
    env = {k: v for k, v in os.environ.items() if k not in ("SG_SECRET", "PYTHONPATH")}
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("form", ["module", "code", "script"])
def test_the_program_runs_as_python_would_run_it_and_the_text_is_set_inside_only(
    lane: Path, form: str
) -> None:
    cwd = lane.parent
    program = {
        "module": ["-m", "probe", "--flag", "x"],
        "code": ["-c", PROBE, "--flag", "x"],
        "script": [str(cwd / "probe.py"), "--flag", "x"],
    }[form]
    plain = _run([PY, *program], cwd)
    argv = launcher_argv(
        [PY, *program], str(lane / lane_launcher.FILE_NAME), [("SG_SECRET", str(lane / "key.pem"))]
    )
    assert argv is not None
    launched = _run(argv, cwd)
    assert plain["getenv"] is None
    assert launched["getenv"] == SECRET
    assert not launched["os_environ"] and not launched["exec_environment"]
    assert not launched["cmdline"]
    same = ("argv", "path0", "name", "main_is_this")
    assert {k: launched[k] for k in same} == {k: plain[k] for k in same}
    assert launched["argv"][1:] == ["--flag", "x"] and launched["name"] == "__main__"


def test_an_unreadable_file_stops_it_before_the_program_runs(lane: Path) -> None:
    missing = lane / "gone.pem"
    out = subprocess.run(
        [
            PY,
            str(lane / lane_launcher.FILE_NAME),
            f"ETCD_AUTH_CA={missing}",
            "--",
            "-c",
            "print(1)",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == lane_launcher.EXIT_UNREADABLE
    assert out.stdout == ""
    assert f"ETCD_AUTH_CA: cannot read {missing}: No such file or directory" in out.stderr


def test_it_stands_alone_on_the_standard_library(lane: Path) -> None:
    """The lane's Python is the engine's (Dynamo's venv): no site-packages, no slurmgate."""
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith('slurmgate')))"
    out = subprocess.run(
        [PY, "-I", "-S", str(lane / lane_launcher.FILE_NAME), f"K={lane / 'key.pem'}", "--",
         "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[]\n"

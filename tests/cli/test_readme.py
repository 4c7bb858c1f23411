"""The README as a newcomer uses it: every shell block runs as written, in order, in one shell.

The blocks run in one `bash` process, one after another, the way a person pastes them into one
terminal: an activated venv, an exported variable or a background server carries over to the
next block. The shell starts with nothing of the test session's: a fresh HOME, no SLURM_CONF,
no Prefect or slurmgate variables, no telemetry switches and no venv on PATH, so a block that
works here only because the suite set something up fails here. Each block must succeed and print
no `ERROR` line and no Python traceback, and nothing a block started may outlive the README.

A block can opt out only with an HTML comment right above it, `<!-- readme-test: skip=WHY -->`,
and WHY must be one of `SKIPS`: commands another part of the suite runs (the test command is this
test's own runner; the benchmarks run with `--smoke` in test_benchmarks.py) or commands that need
the reader's own GitHub organisation and cluster.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer

from slurmgate.testbed.demo import processes_with_env

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

SKIPS = {
    "ci": "the two top-level commands: `make test` runs this test; `make demo` takes ~5 min",
    "bench": "tests/cli/test_benchmarks.py runs each benchmark command with --smoke",
    "real-site": "needs the reader's own GitHub organisation, runners and Slurm cluster",
}
SHELL_LANGS = {"bash", "sh", "shell"}
BLOCK = re.compile(
    r"(?:<!--\s*readme-test:\s*(?P<directive>[^>]*?)\s*-->[ \t]*\n)?"
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[ \t]*\n(?P<body>.*?)^(?P=indent)```",
    re.S | re.M,
)
MARK = "::readme-block::"
RUN_TIMEOUT_S = 900
# Variables a newcomer's shell does not have; the README must get by without them.
SCRUBBED_PREFIXES = ("PREFECT_", "SLURM", "SLURMGATE_", "PYTEST", "VIRTUAL_ENV", "COV_")
SCRUBBED = {"DO_NOT_TRACK", "GITHUB_TOKEN", "PYTHONPATH", "PYTHONHOME"}


# What the README's prose says each block shows, keyed by the block's first line: the run must
# print it (regular expressions), so the prose cannot drift from what the commands do.
CLAIMS: dict[str, list[str]] = {
    "slurmgate emulator --pool cluster:h100=18 &": [
        r'"admitted": 2, .*"blocked": 1',
        r"runners 18, online 18, leased 18",
        r"blocked: job 50002 \(9n\): no-free-capacity",
        r"50001\s+in_progress",
        r"50002\s+queued",
        r"50003\s+in_progress",
    ],
    "slurmgate emulator complete 50001": [
        r"release job=50001 .*reason=job-finished",
        r'"admitted": 1',
        r"50002\s+in_progress",
    ],
    "slurmgate cluster up": [
        r"client\| client ok: 8 completions",
        r"run sg-local-stub-\w+ succeeded on node1,node2,node3; its step logs and record.json",
        r"client\| stream: \d+ chunks, then \[DONE\]",
        r"run sg-llamacpp-local-\w+ succeeded on node1,node2; its step logs and record.json",
        r"client\| pd: 4 completions and a stream of 3 chunks through http://",
        r"client\| routed: 4 completions and a stream of 3 chunks through http://",
        r"client\| client ok: 10 disaggregated requests",
        r"run sg-local-pd-\w+ succeeded on node1,node2,node3,node4; its step logs and record.json",
        r"left running: it was already running when `slurmgate cluster up` ran",
    ],
    'eval "$(slurmgate emulator app': [r"cluster:h100"],
    "slurmgate init --api-url": [
        r"saved slurmgate-github-scope/default .* and slurmgate-admission-policy/default",
        r"Deployment 'reconcile/reconcile' successfully created",
        r"release job=50002 .*reason=ci-job-ended",
        r"Flow run 'release-lease-j50002' - Finished in state Completed\(\)",
        r"Worker '.+' stopped!",
    ],
}


@dataclass(frozen=True)
class ShellBlock:
    index: int
    section: str
    body: str
    skip: str | None


def readme_shell_blocks(text: str | None = None) -> list[ShellBlock]:
    """The README's fenced shell blocks, in order, with their section and skip directive."""
    text = README.read_text() if text is None else text
    blocks: list[ShellBlock] = []
    for match in BLOCK.finditer(text):
        if match["lang"] not in SHELL_LANGS:
            continue
        headings = re.findall(r"^##+ (.+)$", text[: match.start()], flags=re.M)
        directive = (match["directive"] or "").strip()
        skip = None
        if directive:
            key, _, value = directive.partition("=")
            assert key.strip() == "skip" and value.strip() in SKIPS, (
                f"README block {len(blocks) + 1}: unknown directive {directive!r}; "
                f"use skip=<one of {sorted(SKIPS)}>"
            )
            skip = value.strip()
        body = textwrap.dedent(match["body"])
        blocks.append(ShellBlock(len(blocks) + 1, headings[-1] if headings else "", body, skip))
    return blocks


def test_the_readme_skips_only_what_runs_elsewhere() -> None:
    blocks = readme_shell_blocks()
    assert len([b for b in blocks if b.skip is None]) >= 3, "the README lost its shell blocks"
    for block in blocks:
        commands = [
            line.strip()
            for line in block.body.splitlines()
            if line.strip() and not line.strip().startswith("#")
        ]
        if block.skip == "ci":
            assert all(re.match(r"make (demo|test)\b", c) for c in commands), block
        elif block.skip == "bench":
            assert all(
                re.match(r"\.venv/bin/python benchmarks/bench_\w+\.py", c) for c in commands
            ), block
        elif block.skip == "real-site":
            site_walks = ("your first real deployment", "adopting on a real organisation")
            assert block.section.lower() in site_walks, (
                f"block {block.index} in {block.section!r}: only the walks to a real site "
                f"({', '.join(site_walks)}) may hold commands that need the reader's own site"
            )


def _newcomer_env(home: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in SCRUBBED and not k.startswith(SCRUBBED_PREFIXES)
    }
    venv_bin = str(REPO / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p != venv_bin
    )
    env["HOME"] = str(home)
    env.pop("XDG_CACHE_HOME", None)
    env.pop("XDG_CONFIG_HOME", None)
    return env


def _script(blocks: list[ShellBlock]) -> str:
    # `set -m`: job control as in a terminal, so `cmd &` keeps SIGINT (a non-interactive shell
    # would start background jobs with SIGINT ignored, and Prefect's worker stops on SIGINT).
    parts = ["exec 2>&1", "set -eo pipefail", "set -m"]
    for block in blocks:
        parts.append(f"printf '\\n{MARK}{block.index}\\n'")
        parts.append(block.body)
    parts.append(f"printf '\\n{MARK}end\\n'")
    return "\n".join(parts) + "\n"


def _processes_with_home(home: Path) -> dict[int, str]:
    """Pid -> command line of each process whose environment holds HOME=home: everything the
    README's shell started."""
    found: dict[int, str] = {}
    for pid in processes_with_env("HOME", str(home)):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            found[pid] = cmdline.decode(errors="replace")[:200]
    return found


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _split(output: str) -> dict[str, str]:
    pieces = output.split(MARK)
    by_block: dict[str, str] = {"before": pieces[0]}
    for piece in pieces[1:]:
        key, _, rest = piece.partition("\n")
        by_block[key.strip()] = rest
    return by_block


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_every_readme_shell_block_runs_as_written(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """The README's blocks, in order, from a newcomer's shell; see the module docstring."""
    runnable = [b for b in readme_shell_blocks() if b.skip is None]
    home = tmp_path / "home"
    home.mkdir()
    script = tmp_path / "readme.sh"
    script.write_text(_script(runnable))
    log = tmp_path / "readme.log"
    started = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(
            ["bash", str(script)],
            cwd=REPO,
            env=_newcomer_env(home),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(2)  # what the last block stopped gets a moment to exit
            left = _processes_with_home(home)
            _kill(left)
    elapsed = time.monotonic() - started
    output = log.read_text(errors="replace")
    by_block = _split(output)
    last = max((k for k in by_block if k.isdigit()), key=int, default="before")
    assert rc == 0, (
        f"README block {last} failed (rc={rc}) after {elapsed:.0f} s; its output:\n"
        + by_block.get(last, output)[-4000:]
    )
    assert "end" in by_block, output[-4000:]
    for block in runnable:
        text = by_block[str(block.index)]
        noisy = [
            line
            for line in text.splitlines()
            if re.search(r"\bERROR\b", line) or "Traceback (most recent call last)" in line
        ]
        assert not noisy, (
            f"README block {block.index} ({block.section}) succeeded but printed errors:\n"
            + "\n".join(noisy[:10])
        )
    first_lines = {block.body.strip().splitlines()[0]: block for block in runnable}
    for first_line, claims in CLAIMS.items():
        matching = [b for line, b in first_lines.items() if line.startswith(first_line)]
        assert matching, f"no README block starts with {first_line!r} any more: update CLAIMS"
        shown = by_block[str(matching[0].index)]
        for claim in claims:
            assert re.search(claim, shown), (
                f"README block {matching[0].index} ({matching[0].section}) did not show "
                f"{claim!r}; its output:\n{shown[-3000:]}"
            )
    assert not left, f"the README's commands left {len(left)} process(es) running: " + "; ".join(
        f"{pid}: {command}" for pid, command in left.items()
    )


# ---- the first real deployment -----------------------------------------------------------

# What the checklist must walk a site through, each as a pattern its text must match.
FIRST_DEPLOYMENT_TOPICS = {
    "credentials: an App or a token, with the permissions": r"GitHub App.*token.*permissions",
    "the runner permission": r"Administration: read and write.*Self-hosted runners: read and",
    "the App walk": r'"Adopting on a real organisation"',
    "one runner per node with its pool label": r"one per Slurm node.*`cluster:<pool>`",
    "why the anchor needs the Slurm client": r"anchor runner.*`salloc` and `srun`",
    "blocks, and which flags win": r"`slurmgate init`.*policy block's flags win over the worker's",
    "the worker on the login node": r"worker, on the login node",
    "SLURM_CONF": r"SLURM_CONF",
    "the GRES the spec asks for": r"--gres=gpu:<gpus_per_node>",
    "the same Python on every node": r"every compute node sees at the same path.*`python` field",
    "the ports": r"`base_port`.*`rendezvous_base_port`.*`endpoint_port`",
    "offline clusters": r"--analytics-off.*no way out",
    "the relay behind HTTPS": r"webhook relay.*TLS proxy.*HTTPS URL",
}


def first_real_deployment() -> str:
    text = README.read_text()
    section = re.search(r"^## Your first real deployment\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert section, "the README has no '## Your first real deployment' section"
    return section[1]


def test_the_first_real_deployment_covers_each_step() -> None:
    checklist = " ".join(first_real_deployment().split())
    missing = [
        t for t, pattern in FIRST_DEPLOYMENT_TOPICS.items() if not re.search(pattern, checklist)
    ]
    assert missing == [], f"'Your first real deployment' no longer covers: {missing}"


def test_the_spec_fields_the_checklist_names_exist_with_those_defaults() -> None:
    """A field renamed in the spec, or a default port changed, must change the checklist."""
    from slurmgate.runtime.spec.allocation import AllocationSpec
    from slurmgate.runtime.spec.deployment import DeploymentSpec
    from slurmgate.runtime.spec.slurm_options import SlurmSpec

    checklist = first_real_deployment()
    fields = {**AllocationSpec.model_fields, **DeploymentSpec.model_fields}
    named = set(re.findall(r"`(slurm\.[a-z_]+|[a-z]+_[a-z_]+|python)`", checklist))
    assert {"python", "slurm.partition", "slurm.account", "slurm.qos", "base_port"} <= named
    for name in sorted(named):
        if name.startswith("slurm."):
            assert name.removeprefix("slurm.") in SlurmSpec.model_fields, name
        else:
            assert name in fields, f"the checklist names `{name}`, which no spec has"
    ports = dict(re.findall(r"`([a-z_]+_port)`[^)0-9]*?(\d{4,5})", checklist))
    assert set(ports) == {"base_port", "rendezvous_base_port", "endpoint_port"}, ports
    for port, said in ports.items():
        assert DeploymentSpec.model_fields[port].default == int(said), port


# ---- the command list --------------------------------------------------------------------


def cli_commands() -> set[str]:
    """Every command path of `slurmgate --help`, groups expanded: `cluster up`, `status`, …"""
    from slurmgate.cli.app import app

    paths: set[str] = set()

    def walk(command: object, prefix: tuple[str, ...]) -> None:
        subcommands = getattr(command, "commands", None)
        if prefix and (not subcommands or getattr(command, "invoke_without_command", False)):
            paths.add(" ".join(prefix))
        if subcommands:
            for name, sub in subcommands.items():
                if not getattr(sub, "hidden", False):
                    walk(sub, (*prefix, name))

    walk(typer.main.get_command(app), ())
    return paths


def readme_command_list() -> set[str]:
    """The commands the README's "Command line" section names as `slurmgate …`."""
    text = README.read_text()
    section = re.search(r"^## Command line\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert section, "the README has no '## Command line' section"
    return {
        " ".join(m.split())
        for m in re.findall(r"`slurmgate ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)*)", section[1])
    }


def test_every_command_of_the_help_is_in_the_readme_and_no_other() -> None:
    documented = readme_command_list()
    commands = cli_commands()
    assert commands - documented == set(), (
        f"commands missing from the README's 'Command line': {sorted(commands - documented)}"
    )
    assert documented - commands == set(), (
        f"the README lists commands `slurmgate --help` does not have: "
        f"{sorted(documented - commands)}"
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("## A\n```bash\necho hi\n```\n", [("A", "echo hi\n", None)]),
        ("## B\n<!-- readme-test: skip=bench -->\n```bash\nx\n```\n", [("B", "x\n", "bench")]),
        ("## C\n```yaml\na: 1\n```\n```text\nno\n```\n", []),
        (
            "## D\n1. x\n   <!-- readme-test: skip=real-site -->\n"
            "   ```bash\n   a \\\n     b\n   ```\n",
            [("D", "a \\\n  b\n", "real-site")],
        ),
    ],
)
def test_the_block_parser(text: str, expected: list[tuple[str, str, str | None]]) -> None:
    assert [(b.section, b.body, b.skip) for b in readme_shell_blocks(text)] == expected

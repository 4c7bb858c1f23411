"""A lane's Python program with variables set from its files, the text never in exec's environment.

Dynamo 1.6.1's etcd client reads its certificate and key only as PEM text from its environment
(ETCD_AUTH_CA, ETCD_AUTH_CLIENT_CERT, ETCD_AUTH_CLIENT_KEY). Put there by exec, the text would
sit in /proc/PID/environ for the life of the process. The node worker starts such a lane as

    PYTHON [OPTIONS] LANE_DIR/lane-launcher.py VAR=PATH... -- (-m MODULE | -c CODE | SCRIPT) ARGS

(this file, copied into the lane's private directory): it reads each PATH, sets VAR to its text
inside the process with `os.putenv` (the C environment, which the Rust runtime's `getenv`
reads), then runs the program as `PYTHON [OPTIONS] -m MODULE ARGS` would. Neither argv nor the
block exec was handed holds the text; `os.environ` stays as exec made it, so a child started
with a copy of it does not get the text either (Dynamo's frontend re-execs itself so with
DYN_FRONTEND_JEMALLOC, and runs this launcher again). A child started with the C environment as
it stands (`subprocess` without `env=`, multiprocessing's spawn) inherits the variables.

Self-contained, the standard library only, Python 3.8 and later: it runs under the lane's own
Python (Dynamo's venv), which has no slurmgate.
"""

from __future__ import annotations

import builtins
import os
import re
import runpy
import sys
import types

FILE_NAME = "lane-launcher.py"
SEPARATOR = "--"
EXIT_USAGE = 64
EXIT_UNREADABLE = 66
# The interpreter's long option that takes the next argument as its value.
_VALUED_LONG = {"--check-hash-based-pycs"}
_INTERPRETER = re.compile(r"python[0-9.]*")


def split_python(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """`PYTHON [OPTIONS] (-m MODULE | -c CODE | SCRIPT) ARGS` as (the interpreter and its
    options, the program and its args), its options read as the interpreter reads them
    (`-um MODULE`, `-X dev`, `-Wd`); None for any other command, or a program on stdin."""
    if not argv or not _INTERPRETER.fullmatch(os.path.basename(argv[0])):
        return None
    i = 1
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            return argv[:i], argv[i:]  # a script
        if arg in ("-", "--"):
            return None
        if arg.startswith("--"):
            i += 2 if arg in _VALUED_LONG else 1
            continue
        for j in range(1, len(arg)):
            flag, value = arg[j], arg[j + 1 :]
            if flag in "mc":
                head = argv[:i] + ([arg[:j]] if j > 1 else [])
                program = [f"-{flag}", *([value] if value else []), *argv[i + 1 :]]
                return (head, program) if len(program) > 1 else None
            if flag in "XW":
                i += 0 if value else 1  # its value: the rest of the argument, or the next
                break
        i += 1
    return None


def launcher_argv(
    argv: list[str], launcher: str, env_files: list[tuple[str, str]]
) -> list[str] | None:
    """`argv` (a Python program, `split_python`) started through `launcher` (this file's
    path), which sets each variable to the text of its file; None for another command."""
    split = split_python(argv)
    if split is None:
        return None
    head, program = split
    return [*head, launcher, *(f"{var}={path}" for var, path in env_files), SEPARATOR, *program]


def _main_module() -> types.ModuleType:
    """A fresh `__main__` for a `-c` program, as the interpreter gives one."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    return main


def _run(program: list[str]) -> None:
    """Run `program` as the interpreter would after its options, in this process."""
    kind, rest = program[0], program[1:]
    safe = sys.flags.isolated or getattr(sys.flags, "safe_path", False)
    if kind == "-m":
        # runpy sets argv[0] to the module's file, as `-m` does
        sys.argv = ["-m", *rest[1:]]
        if not safe:
            sys.path[0] = os.getcwd()
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    elif kind == "-c":
        sys.argv = ["-c", *rest[1:]]
        if not safe:
            sys.path[0] = ""
        exec(compile(rest[0], "<string>", "exec"), _main_module().__dict__)
    else:
        sys.argv = list(program)
        if not safe:
            sys.path[0] = os.path.dirname(os.path.abspath(kind))
        runpy.run_path(kind, run_name="__main__")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    if SEPARATOR not in argv:
        _say(f"usage: {FILE_NAME} VAR=PATH... -- (-m MODULE | -c CODE | SCRIPT) [ARGS]")
        return EXIT_USAGE
    cut = argv.index(SEPARATOR)
    pairs, program = argv[:cut], argv[cut + 1 :]
    if not program or any("=" not in p or p.startswith("=") for p in pairs):
        _say(f"{FILE_NAME}: expected VAR=PATH... -- PROGRAM, got {argv[: cut + 2]}")
        return EXIT_USAGE
    for pair in pairs:
        var, path = pair.split("=", 1)
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            _say(f"{FILE_NAME}: {var}: cannot read {path}: {exc.strerror}")
            return EXIT_UNREADABLE
        os.putenv(var, text)
    _run(program)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

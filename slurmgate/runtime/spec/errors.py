"""The spec's one error: its problems worded as `field: message — fix`, from pydantic's too."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from slurmgate.errors import InputError


class SpecError(InputError):
    """A spec problem, worded as `field: message — fix`."""

    def __init__(self, problems: list[tuple[str, str, str]]) -> None:
        self.problems = problems
        super().__init__("\n".join(f"{f}: {m} — {fix}" for f, m, fix in problems))


# One problem of a spec: (field, message, fix).
Problem = tuple[str, str, str]

_PROBLEM = re.compile(
    r"^(?:Value error, )?(?P<field>[\w\[\].]+): (?P<msg>.*) — fix: (?P<fix>.*)$", re.S
)


def problem(field: str, message: str, fix: str) -> ValueError:
    # Readable as it stands (Prefect shows pydantic's message for bad flow parameters), and
    # parseable back into its parts for SpecError.
    return ValueError(f"{field}: {message} — fix: {fix}")


def spec_error_from(exc: ValidationError, source: str = "spec") -> SpecError:
    """Turn a pydantic ValidationError into a SpecError naming each field and its fix."""
    problems: list[tuple[str, str, str]] = []
    for err in exc.errors():
        loc = _loc(err.get("loc", ()))
        msg = str(err.get("msg", ""))
        m = _PROBLEM.match(msg) if err.get("type") == "value_error" else None
        if m:
            field, message, fix = m.group("field"), m.group("msg"), m.group("fix")
            where = f"{loc}.{field}" if loc and field != loc.rsplit(".", 1)[-1] else loc or field
            if field.startswith("deployments["):
                where = field
            problems.append((where, message, fix))
        elif err.get("type") == "extra_forbidden":
            problems.append((loc, "unknown key", "remove it or check its spelling"))
        elif err.get("type") == "missing":
            problems.append((loc, "is required", "add it"))
        elif err.get("type") == "literal_error" and loc.endswith("schema_version"):
            problems.append((loc, f"unsupported version {err.get('input')!r}", "use 1"))
        else:
            problems.append((loc or source, msg, "fix the value"))
    return SpecError(problems)


def _loc(loc: tuple[Any, ...] | Any) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out

"""The error family: one root, bad input on one side, failures of outside systems on the other.

Every error slurmgate raises on purpose derives from `SlurmgateError`, through one of two
families a caller can tell apart without knowing the module that raised it:

- `InputError` (also a `ValueError`): what a user, a spec, a label or a document said is
  wrong; the message names the field and the fix. Retrying cannot help.
- `ExternalError` (also a `RuntimeError`): GitHub, Slurm, a child process or the machine did
  not do what was asked. Some of these are transient; the subclass says which.
"""

from __future__ import annotations


class SlurmgateError(Exception):
    """The root of every error slurmgate raises on purpose."""


class InputError(SlurmgateError, ValueError):
    """Bad input: the message names the field and how to fix it."""


class ExternalError(SlurmgateError, RuntimeError):
    """An outside system (GitHub, Slurm, a process, the machine) failed or refused."""

    transient = False
    """Worth another attempt (a server fault, a rate limit, a timeout); a refusal is not."""


class NotFoundError(ExternalError):
    """The outside system says the thing asked for does not exist (for example HTTP 404)."""


def is_transient(exc: BaseException) -> bool:
    """Errors worth another attempt: transient outside failures and timeouts, never bad input."""
    return isinstance(exc, TimeoutError) or (isinstance(exc, ExternalError) and exc.transient)


def one_line(exc: BaseException) -> str:
    """`Type: message` folded onto one line, for logs and records."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())

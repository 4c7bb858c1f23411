"""Where slurmgate keeps its files (the state home, the runs home), and which it may trust."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from slurmgate.errors import InputError
from slurmgate.settings.home import HomeSettings

STATE_DIR_ENV = "SLURMGATE_STATE_DIR"


def state_dir() -> Path:
    """Where the controller keeps its ETag cache: $SLURMGATE_STATE_DIR, else ~/.cache/slurmgate."""
    configured = (HomeSettings.text("state_dir") or "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "slurmgate"


def default_runs_root() -> Path:
    """Where run directories (logs, record.json) live: $SLURMGATE_RUNS_DIR, else the state
    home's runs/ (~/.cache/slurmgate/runs when neither is set)."""
    configured = HomeSettings.text("runs_dir")
    if configured:
        return Path(configured)
    return state_dir() / "runs"


def presets_dir() -> Path | None:
    """The folder of the site's presets ($SLURMGATE_PRESETS_DIR, ~ expanded), or None."""
    configured = (HomeSettings.text("presets_dir") or "").strip()
    return Path(configured).expanduser() if configured else None


def legacy_runs_root() -> Path:
    """Where runs lived before the runs home followed the state home: ~/.cache/slurmgate/runs."""
    return Path.home() / ".cache" / "slurmgate" / "runs"


def runs_roots() -> list[Path]:
    """The runs homes a reaper reads: the runs home, then the legacy one when it differs and
    exists, so runs started before SLURMGATE_STATE_DIR moved the runs home are still reaped."""
    home = default_runs_root()
    legacy = legacy_runs_root()
    if legacy != home and legacy.is_dir():
        return [home, legacy]
    return [home]


class UntrustedRecord(InputError):
    """A record file this user did not write, or one others could have changed: never acted on."""


def check_trusted(path: Path, st: os.stat_result) -> None:
    """Raise UntrustedRecord unless `st` is a regular file of this user that only it can write.

    A reaper kills process groups and cancels jobs a record names, so a record planted by
    someone else (or rewritable by them) must not steer it.
    """
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedRecord(f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise UntrustedRecord(f"{path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedRecord(
            f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})"
        )

"""Home settings: where slurmgate keeps its state (the state home) and its runs (the runs home)."""

from __future__ import annotations

from pathlib import Path

from slurmgate.settings.part import Part, variable


class HomeSettings(Part):
    """The two homes; `slurmgate.paths` resolves them (the runs home defaults under the state
    home)."""

    state_dir: Path | None = variable(
        "SLURMGATE_STATE_DIR",
        "The state home: ETag caches, the job-event store, the bundled cluster's record "
        "(~ expanded; unset: ~/.cache/slurmgate).",
    )
    runs_dir: Path | None = variable(
        "SLURMGATE_RUNS_DIR",
        "The runs home: one directory per allocation run, with its record.json and logs "
        "(unset: the state home's runs/).",
    )
    presets_dir: Path | None = variable(
        "SLURMGATE_PRESETS_DIR",
        "The one folder whose spec files (and srt-slurm recipes) a run started from the Prefect "
        "UI or API may name as its preset (`spec_file`, or `recipe_file`); unset: no preset is "
        "read.",
    )

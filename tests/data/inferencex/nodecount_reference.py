"""InferenceX's own node-count reading of a role's settings: the reference slurmgate matches.

Copied from SemiAnalysisAI/InferenceX, commit fd835b37e,
utils/matrix_logic/generate_sweep_configs.py (`_worker_node_override`, `recipe_node_count`),
under the Apache License 2.0 (Copyright the InferenceX authors). Two changes, both marked:
`Fields` is the one member these functions use, and the recipe folder is a parameter instead of
the generator's checkout. Tests compare slurmgate's `node_count` with these on hostile settings.
"""

# ruff: noqa
# mypy: ignore-errors
import enum
import re
from pathlib import Path

import yaml


class Fields(enum.Enum):  # changed: validation.Fields, reduced to the member used here
    ADDITIONAL_SETTINGS = "additional-settings"


def _worker_node_override(worker: dict, setting_name: str) -> int | None:
    """Read an explicit role node count from additional settings."""
    pattern = re.compile(rf"^{re.escape(setting_name)}=(\d+)$")
    values = []
    for setting in worker.get(Fields.ADDITIONAL_SETTINGS.value, []) or []:
        match = pattern.match(setting)
        if match:
            values.append(int(match.group(1)))
    if not values:
        return None
    if len(set(values)) != 1 or values[0] <= 0:
        raise ValueError(f"Conflicting or invalid {setting_name} settings: {values}")
    return values[0]


def recipe_node_count(prefill: dict, decode: dict, recipe_root: Path) -> int | None:  # changed
    """Read the authoritative node count from a checked-in srt-slurm recipe."""
    config_files = {
        setting.split("=", 1)[1]
        for worker in (prefill, decode)
        for setting in (worker.get(Fields.ADDITIONAL_SETTINGS.value, []) or [])
        if setting.startswith("CONFIG_FILE=")
    }
    if not config_files:
        return None
    if len(config_files) != 1:
        raise ValueError(f"Conflicting CONFIG_FILE settings: {sorted(config_files)}")

    relative_path = config_files.pop().removeprefix("recipes/")
    recipe_path = recipe_root / relative_path  # changed: the generator's checkout
    if not recipe_path.exists():
        # Some srt-slurm recipes live only in the runtime image. Their master
        # config topology remains the best available scheduling estimate.
        return None

    resources = yaml.safe_load(recipe_path.read_text())["resources"]
    if "agg_nodes" in resources:
        return int(resources["agg_nodes"])
    if "prefill_nodes" in resources and "decode_nodes" in resources:
        return int(resources["prefill_nodes"]) + int(resources["decode_nodes"])
    raise ValueError(f"Recipe has no supported node resource fields: {recipe_path}")

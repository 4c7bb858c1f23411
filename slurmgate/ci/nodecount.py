"""How many Slurm nodes one deployment matrix row needs (the `nodes:N` a CI job requests).

Precedence (docs/seed.md, node count): an explicit aggregate `num-nodes`, else a checked-in recipe's
`resources`, else per-role `PREFILL_NODES`/`DECODE_NODES` overrides, else per-role GPU topology
`ceil(num-worker x tp x pp x pcp-size / gpus-per-node)`. Pure apart from reading recipe YAML.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurmgate.documents import DocumentError, read_yaml
from slurmgate.errors import InputError
from slurmgate.runtime.spec import recipes, variants

ROLES = ("prefill", "decode")
_OVERRIDE_KEYS = {"prefill": "PREFILL_NODES", "decode": "DECODE_NODES"}
_CONFIG_FILE = "CONFIG_FILE"


class NodeCountError(InputError):
    """A row whose node count cannot be derived; the message names the field and the fix."""


class UnknownGpusPerNode(NodeCountError):
    """The GPUs per node of a role's hardware are unknown: a fact from outside the row.

    Everything else the rules read is the row's own claim, and a bad claim is the row's error.
    This one is different: a re-run of a row written before node counts existed may name runner
    labels the hardware table no longer has, so `slurmgate labels` falls back instead of failing.
    """


def _positive_int(value: object, field: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NodeCountError(f"{field} must be a positive integer, got {value!r}; {fix}")
    return value


def _settings(role: Mapping[str, Any], where: str) -> list[str]:
    """A role's `additional-settings`: KEY=VALUE strings, read exactly as InferenceX reads them
    (no whitespace is trimmed: `CONFIG_FILE =x` names no recipe there, so none here either)."""
    raw = role.get("additional-settings") or []
    if not isinstance(raw, list):
        raise NodeCountError(
            f"{where}.additional-settings must be a list of KEY=VALUE strings, got {raw!r}"
        )
    for item in raw:
        if not isinstance(item, str):
            # InferenceX's generator stops on it (a string method on a non-string)
            raise NodeCountError(
                f"{where}.additional-settings holds {item!r}, not a KEY=VALUE string; quote it"
            )
    return raw


def _near_misses(roles: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse a setting that looks like a node-count setting but that InferenceX's generator
    does not read as one (`PREFILL_NODES= 2`, `CONFIG_FILE =x`, a leading space, `DECODE_NODES`
    in the prefill role): it would silently count another number than the row's writer meant,
    and with `CONFIG_FILE` a smaller one. What the generator does read, it reads the same here."""
    for name, role in roles.items():
        own = _OVERRIDE_KEYS[name]
        for setting in _settings(role, name):
            key, equals, value = setting.partition("=")
            known = key.strip().upper()
            if known not in (*_OVERRIDE_KEYS.values(), _CONFIG_FILE):
                continue
            if known == _CONFIG_FILE:
                exact = key == _CONFIG_FILE and equals and value and value == value.strip()
                form = f"{_CONFIG_FILE}=recipes/<file>.yaml"
            elif known != own:
                role_of = next(r for r, k in _OVERRIDE_KEYS.items() if k == known)
                raise NodeCountError(
                    f"{name}.additional-settings sets {known}, which InferenceX reads only in "
                    f"{role_of}'s settings; move it to {role_of}.additional-settings"
                )
            else:
                exact = re.match(rf"^{re.escape(own)}=(\d+)$", setting) is not None
                form = f"{own}=<n>"
            if not exact:
                raise NodeCountError(
                    f"{name}.additional-settings {setting!r} is not read as {known} by "
                    f"InferenceX's generator; write {form} with no spaces"
                )


def _roles(row: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    roles: dict[str, Mapping[str, Any]] = {}
    for name in ROLES:
        role = row.get(name)
        if role is None:
            continue
        if not isinstance(role, Mapping):
            raise NodeCountError(f"{name} must be a mapping of worker settings, got {role!r}")
        roles[name] = role
    return roles


def gpu_family(label: str) -> str:
    """`cluster:gb200-nv` -> `gb200`: the label without `cluster:`, up to its first dash."""
    name = label.removeprefix("cluster:")
    return name.split("-", 1)[0]


def gpus_per_node(label: str, hardware: Mapping[str, int], where: str = "runner") -> int:
    """GPUs per node for a runner or hardware label: the exact record, else its GPU family."""
    if label in hardware:
        return _positive_int(
            hardware[label], f"hardware[{label!r}]", "fix the gpus-per-node record"
        )
    family = gpu_family(label)
    values = {count for other, count in hardware.items() if gpu_family(other) == family}
    if not values:
        raise UnknownGpusPerNode(
            f"{where} {label!r} has no gpus-per-node record and no record of its GPU family "
            f"{family!r}; add {label!r} to the hardware table"
        )
    if len(values) > 1:
        raise UnknownGpusPerNode(
            f"{where} {label!r} has no gpus-per-node record and its GPU family {family!r} is "
            f"ambiguous ({sorted(values)}); add an exact record for {label!r}"
        )
    return _positive_int(values.pop(), f"gpus-per-node of family {family!r}", "fix the record")


def _hardware_pair(roles: Mapping[str, Mapping[str, Any]]) -> None:
    """Both roles name their `hardware`, or neither does (InferenceX's matrix validation): one
    role on other hardware than the runner's and the other on the runner's is a typo, not a
    heterogeneous job, and its node count would be read off the wrong GPUs per node."""
    if len(roles) < len(ROLES):
        return
    named = [name for name in ROLES if roles[name].get("hardware")]
    if len(named) == 1:
        other = next(name for name in ROLES if name not in named)
        raise NodeCountError(
            f"{named[0]}.hardware is set but {other}.hardware is not; hardware must be given "
            f"for both prefill and decode, or neither (then both run on the row's runner)"
        )


def is_recipe(data: Mapping[str, Any]) -> bool:
    """An srt-slurm recipe (a `resources:` section, or 2.x's `schema:`), not a matrix row."""
    return isinstance(data.get("resources"), Mapping) or data.get("schema") is not None


def recipe_node_count(recipe: object, name: str) -> int:
    """A recipe's Slurm nodes as InferenceX counts them: agg_nodes, else prefill_nodes plus
    decode_nodes; `name` says which recipe in errors. A file of variants (`base:`) holds
    several jobs: it is refused, listing the selectors that name one."""
    if isinstance(recipe, dict) and variants.has_variants(recipe):
        try:
            variants.select(recipe, None, name)
        except recipes.RecipeError as exc:
            raise NodeCountError(str(exc)) from None
    if isinstance(recipe, dict) and recipe.get("schema") is not None:
        # srt-slurm 2.0's `roles:` layout (InferenceX migrated its recipes to it)
        try:
            recipe = recipes.expanded(recipe, name)
        except recipes.RecipeError as exc:
            raise NodeCountError(str(exc)) from None
    resources = recipe.get("resources") if isinstance(recipe, Mapping) else None
    if not isinstance(resources, Mapping):
        raise NodeCountError(
            f"{name} has no resources section; add resources.agg_nodes "
            "or resources.prefill_nodes and resources.decode_nodes"
        )
    fix = "write a whole number of nodes in the recipe"
    if resources.get("agg_nodes") is not None:
        return _positive_int(resources["agg_nodes"], f"{name} resources.agg_nodes", fix)
    if resources.get("prefill_nodes") is None and resources.get("decode_nodes") is None:
        raise NodeCountError(
            f"{name} resources has neither agg_nodes nor prefill_nodes/decode_nodes; "
            "add the node counts to the recipe"
        )
    given = [key for key in ("prefill_nodes", "decode_nodes") if resources.get(key) is not None]
    if len(given) == 1:
        # InferenceX's generator refuses such a recipe; counting the missing side as 0 would
        # under-count the job and over-admit its pool
        missing = "decode_nodes" if given == ["prefill_nodes"] else "prefill_nodes"
        raise NodeCountError(
            f"{name} resources gives {given[0]} but not {missing}; add "
            f"resources.{missing} (0 when that role has no nodes), or resources.agg_nodes"
        )
    total = 0
    for key in ("prefill_nodes", "decode_nodes"):
        value = resources[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise NodeCountError(f"{name} resources.{key} is {value!r}; {fix}")
        total += value
    return _positive_int(total, f"{name} prefill_nodes + decode_nodes", fix)


def _recipe_nodes(roles: Mapping[str, Mapping[str, Any]], recipe_root: Path | None) -> int | None:
    configs = {
        setting.split("=", 1)[1]
        for name, role in roles.items()
        for setting in _settings(role, name)
        if setting.startswith(f"{_CONFIG_FILE}=")
    }
    if not configs:
        return None
    if len(configs) > 1:
        raise NodeCountError(
            f"{_CONFIG_FILE} differs between roles ({', '.join(sorted(configs))}); "
            "both roles must name the same recipe"
        )
    if recipe_root is None:
        return None
    config = configs.pop()
    relative, selector = config.removeprefix("recipes/"), None
    root = recipe_root.resolve()
    if ":" in relative and not (root / relative).is_file():
        # one variant of a file with a base: section, `FILE.yaml:selector` as srtctl reads it
        relative, selector = relative.rsplit(":", 1)
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise NodeCountError(
            f"{_CONFIG_FILE}={config} points outside the recipe folder; name a file under recipes/"
        )
    if not path.is_file():
        return None  # the recipe lives only in the runtime image: fall through to the roles
    try:
        recipe = read_yaml(path)
        if selector is not None:
            if not isinstance(recipe, dict):
                raise NodeCountError(f"recipe {config}: not a mapping of recipe keys")
            recipe = variants.select(recipe, selector, f"recipe recipes/{relative}")
    except DocumentError as exc:
        raise NodeCountError(f"recipe {config}: {exc}") from None
    except recipes.RecipeError as exc:
        raise NodeCountError(str(exc)) from None
    return recipe_node_count(recipe, f"recipe {config}")


def _overrides(roles: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """Each role's own PREFILL_NODES / DECODE_NODES, matched as InferenceX's generator matches
    them: the whole setting is `KEY=<digits>` (its `re` pattern, so any Unicode decimal digit),
    only in that role's settings, and every match of a role must agree and be positive."""
    result: dict[str, int] = {}
    for role_name, role in roles.items():
        key = _OVERRIDE_KEYS[role_name]
        pattern = re.compile(rf"^{re.escape(key)}=(\d+)$")
        values = []
        for setting in _settings(role, role_name):
            match = pattern.match(setting)
            if match:
                values.append(int(match.group(1)))
        if not values:
            continue
        if len(set(values)) > 1:
            shown = ", ".join(str(v) for v in sorted(set(values)))
            raise NodeCountError(
                f"{role_name}.additional-settings sets {key} to different values ({shown}); "
                f"keep one value"
            )
        if values[0] < 1:
            raise NodeCountError(
                f"{key}={values[0]} is not a positive integer; write {key}=<n> with n >= 1"
            )
        result[role_name] = values[0]
    return result


def _topology(
    name: str, role: Mapping[str, Any], runner: object, hardware: Mapping[str, int]
) -> int:
    factors = []
    for key in ("num-worker", "tp", "pp", "pcp-size"):
        value = role.get(key, 0 if key == "num-worker" else 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise NodeCountError(
                f"{name}.{key} must be a non-negative integer, got {value!r}; fix the row"
            )
        factors.append(value)
    gpus = math.prod(factors)
    if gpus == 0:
        return 0
    label = role.get("hardware") or runner
    if not isinstance(label, str) or not label:
        raise UnknownGpusPerNode(
            f"{name} needs {gpus} GPUs but neither {name}.hardware nor runner names the "
            "hardware; set runner (or the role's hardware) to a known label"
        )
    return math.ceil(gpus / gpus_per_node(label, hardware, where=f"{name}.hardware"))


def node_count(
    row: Mapping[str, Any],
    hardware: Mapping[str, int],
    recipe_root: Path | None = None,
) -> int:
    """Total Slurm nodes of one matrix row.

    `hardware` maps runner/hardware labels to GPUs per node; `recipe_root` is the folder that
    `CONFIG_FILE=recipes/...` paths are relative to (None: recipes are not checked in).
    """
    disagg = bool(row.get("disagg", False))
    roles = _roles(row)
    _hardware_pair(roles)
    multinode = bool(row.get("multinode", bool(roles)))
    if "num-nodes" in row:
        if disagg:
            raise NodeCountError(
                "num-nodes is not valid for disaggregated entries; remove num-nodes, "
                "the prefill and decode allocations determine the total"
            )
        if not multinode:
            raise NodeCountError(
                "num-nodes is only valid when multinode=true and disagg=false; remove num-nodes"
            )
        return _positive_int(
            row["num-nodes"], "num-nodes", "write the aggregate entry's Slurm node count"
        )
    if not roles:
        if multinode:
            raise NodeCountError(
                "a multinode row needs num-nodes or prefill/decode roles; add one of them"
            )
        return 1
    _near_misses(roles)
    recipe = _recipe_nodes(roles, recipe_root)
    if recipe is not None:
        return recipe
    overrides = _overrides(roles)
    total = 0
    unknown: UnknownGpusPerNode | None = None
    for name, role in roles.items():
        if name in overrides:
            total += overrides[name]
            continue
        try:
            total += _topology(name, role, row.get("runner"), hardware)
        except UnknownGpusPerNode as exc:
            # check the other role's claims first: a bad claim is an error, not a missing fact
            unknown = unknown or exc
    if unknown is not None:
        raise unknown
    return _positive_int(total, "node count", "give the row at least one worker")

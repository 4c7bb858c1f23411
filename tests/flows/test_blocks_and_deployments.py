"""Blocks (secret token, clear errors, used by the flow) and the deployment definitions."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from flowcheck import assert_invariants, fleet, job_labels, lease_of_job
from prefect import Flow
from pydantic import ValidationError

from slurmgate.blocks import AdmissionPolicyBlock, GitHubScopeBlock
from slurmgate.flows.reconcile import reconcile
from slurmgate.github.scope import ScopeError

REPO = Path(__file__).resolve().parents[2]
TOKEN = "ghp_blockSECRETvalue0123456789"


def test_scope_block_validates_and_hides_the_token() -> None:
    block = GitHubScopeBlock(repo="acme/gpu-ci", token=TOKEN)
    assert TOKEN not in repr(block) and TOKEN not in str(block.model_dump())
    assert block.token.get_secret_value() == TOKEN
    with pytest.raises(ValidationError, match="exactly one of repo"):
        GitHubScopeBlock(repo="acme/gpu-ci", org="acme", token=TOKEN)
    with pytest.raises(ValidationError, match="OWNER/NAME"):
        GitHubScopeBlock(repo="acme", token=TOKEN)
    with pytest.raises(ValidationError, match="api_url"):
        GitHubScopeBlock(api_url="ftp://x", repo="acme/gpu-ci", token=TOKEN)
    with pytest.raises(ValidationError, match="NODE_SLOT_SCHEDULER_ENABLED=true requires"):
        AdmissionPolicyBlock(node_slot_scheduler_enabled=True).to_settings()
    assert GitHubScopeBlock.get_block_type_slug() == "slurmgate-github-scope"
    assert AdmissionPolicyBlock.get_block_type_slug() == "slurmgate-admission-policy"


async def test_reconcile_with_saved_blocks(emulator_factory, monkeypatch) -> None:
    """The deployment path: scope and policy come from saved blocks, not the environment."""
    for flag in ("PRIORITY_SCHEDULER_ENABLED", "NODE_SLOT_SCHEDULER_ENABLED"):
        monkeypatch.delenv(flag)
    emu = emulator_factory({"a": 8})
    job_id = emu.admin.add_job(job_labels(6), duration_s=600)["id"]
    await GitHubScopeBlock(
        api_url=emu.url, repo=emu.repo, token=TOKEN, min_write_interval_s=0
    ).asave("bench-scope", overwrite=True)
    await AdmissionPolicyBlock(
        priority_scheduler_enabled=True, node_slot_scheduler_enabled=True
    ).asave("bench-policy", overwrite=True)

    summary = await reconcile(scope_block="bench-scope", policy_block="bench-policy")
    assert summary["admitted"] == 1
    assert len(lease_of_job(fleet(emu.admin.dump()), job_id)) == 6
    assert_invariants(emu.admin.dump())

    with pytest.raises(ScopeError, match="scope_block 'nope' could not be loaded"):
        await reconcile(scope_block="nope")


def test_prefect_yaml_defines_the_three_deployments() -> None:
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    by_name = {d["name"]: d for d in spec["deployments"]}
    assert set(by_name) == {"reconcile", "release-lease", "allocation"}
    reconcile_spec = by_name["reconcile"]
    assert reconcile_spec["schedules"][0]["interval"] == 30
    assert reconcile_spec["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    for deployment in by_name.values():
        # a module path, importable wherever slurmgate is installed: no checkout needed
        module, _, name = deployment["entrypoint"].rpartition(".")
        assert module.startswith("slurmgate.flows."), deployment["entrypoint"]
        flow = getattr(importlib.import_module(module), name)
        assert isinstance(flow, Flow), deployment["entrypoint"]
    assert "job_id" not in by_name["release-lease"].get("parameters", {})


def test_serve_builds_deployments_with_a_single_reconcile_slot() -> None:
    from slurmgate.deployments import serve

    deployments = {d.name: d for d in serve.build_deployments(interval_s=30)}
    assert {"reconcile", "release-lease"} <= set(deployments)
    limit = deployments["reconcile"].concurrency_limit
    assert limit == 1 or getattr(limit, "limit", None) == 1
    options = deployments["reconcile"].concurrency_options
    assert options is not None and options.collision_strategy.value == "CANCEL_NEW"


async def test_org_scope_reads_jobs_of_its_repos(tmp_path) -> None:
    block = GitHubScopeBlock(org="acme", repos=["acme/gpu-ci"], token=TOKEN)
    async with block.get_client() as client:
        assert client.scope.runners_path == "/orgs/acme/actions/runners"
        assert client.scope.job_repos == ("acme/gpu-ci",)
    with pytest.raises(ValueError, match="OWNER/NAME"):
        GitHubScopeBlock(org="acme", repos=["gpu-ci"], token=TOKEN).get_client()

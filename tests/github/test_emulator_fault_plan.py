"""The emulator's random fault plan: each kind's answer, what is applied, counts and the seed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.testbed.emulator.state import FaultPlan
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

RUNNERS = "/repos/acme/gpu-ci/actions/runners"


@pytest.fixture
def emu() -> Iterator[RunningEmulator]:
    with running_emulator(pools={"h100": 2}) as running:
        yield running


def _api(emu: RunningEmulator, timeout_s: float = 5.0) -> httpx.Client:
    return httpx.Client(base_url=emu.url, headers={"Authorization": "Bearer t"}, timeout=timeout_s)


def _labels(emu: RunningEmulator, runner_id: int) -> list[str]:
    with emu.state.lock:
        return [name for name, _ in emu.state.runners[runner_id].labels]


def test_server_error_refuses_without_applying(emu: RunningEmulator) -> None:
    emu.admin.set_fault_plan(1.0, kinds={"server-error": 1})
    with _api(emu) as api:
        answer = api.post(f"{RUNNERS}/1/labels", json={"labels": ["ci-lease-j1-a1-t1"]})
    assert answer.status_code in (500, 502, 503)
    assert "ci-lease-j1-a1-t1" not in _labels(emu, 1)
    assert emu.admin.fault_plan()["injected"] == {"server-error": 1}


@pytest.mark.parametrize(("kind", "status"), [("rate-limit", 429), ("secondary-limit", 403)])
def test_rate_limits_carry_a_compressed_retry_after(
    emu: RunningEmulator, kind: str, status: int
) -> None:
    emu.admin.set_fault_plan(1.0, kinds={kind: 1}, retry_after_s=0.25)
    with _api(emu) as api:
        answer = api.get(RUNNERS)
    assert answer.status_code == status
    assert answer.headers["retry-after"] == "0.25"
    if kind == "secondary-limit":
        assert "secondary rate limit" in answer.json()["message"]
    emu.admin.set_fault_plan(1.0, kinds={kind: 1}, retry_after_s=2)
    with _api(emu) as api:
        assert api.get(RUNNERS).headers["retry-after"] == "2"  # GitHub's whole seconds


def test_lost_answer_applies_the_write_then_answers_502(emu: RunningEmulator) -> None:
    emu.admin.set_fault_plan(1.0, kinds={"lost-answer": 1})
    with _api(emu) as api:
        answer = api.post(f"{RUNNERS}/1/labels", json={"labels": ["ci-lease-j1-a1-t1"]})
        assert answer.status_code == 502
        assert "ci-lease-j1-a1-t1" in _labels(emu, 1)
        assert api.get(RUNNERS).status_code == 502  # a read has nothing to apply


def test_timeout_applies_then_answers_after_the_delay(emu: RunningEmulator) -> None:
    emu.admin.set_fault_plan(1.0, kinds={"timeout": 1}, delay_s=1.0)
    with _api(emu, timeout_s=0.3) as api, pytest.raises(httpx.ReadTimeout):
        api.post(f"{RUNNERS}/1/labels", json={"labels": ["ci-job-1.000-x"]})
    assert "ci-job-1.000-x" in _labels(emu, 1)


def test_the_rate_and_the_seed_decide_which_requests_fail(emu: RunningEmulator) -> None:
    def statuses() -> list[int]:
        emu.admin.set_fault_plan(0.3, seed=7, kinds={"server-error": 1, "rate-limit": 1})
        with _api(emu) as api:
            return [api.get(f"{RUNNERS}/1").status_code for _ in range(200)]

    first, second = statuses(), statuses()
    assert first == second  # the same seed faults the same requests
    faulted = sum(status != 200 for status in first)
    assert 30 <= faulted <= 90
    injected = emu.admin.fault_plan()["injected"]
    assert sum(injected.values()) == faulted
    assert emu.admin.stats()["faults_injected"] == injected
    emu.admin.set_fault_plan(0.0)
    with _api(emu) as api:
        assert all(api.get(f"{RUNNERS}/1").status_code == 200 for _ in range(20))


def test_admin_plan_rejects_bad_input_naming_the_field(emu: RunningEmulator) -> None:
    with _api(emu) as api:
        for body, word in [
            ({"rate": 2}, "rate"),
            ({"rate": 0.1, "kinds": {"meteor": 1}}, "meteor"),
            ({"rate": "often"}, "rate"),
        ]:
            answer = api.put("/_emulator/fault-plan", json=body)
            assert answer.status_code == 400 and word in answer.json()["message"]


async def test_the_client_rides_out_every_kind() -> None:
    """Each kind on every other request: the client's retries still land each label once."""
    plan = FaultPlan(rate=0.5, seed=3, retry_after_s=0.05, delay_s=0.6)
    with running_emulator(pools={"h100": 4}, fault_plan=plan) as emu:
        client = GitHubClient(
            GitHubScope(repo=emu.repo, api_url=emu.url),
            emu.token,
            timeout_s=0.3,
            backoff_base_s=0.02,
            backoff_cap_s=0.1,
            max_retries=8,
        )
        async with client:
            started = time.monotonic()
            for runner_id in range(1, 5):
                await client.add_labels(runner_id, [f"ci-lease-j{runner_id}-a1-t1"])
                assert await client.remove_label(runner_id, f"ci-lease-j{runner_id}-a1-t1") in (
                    True,
                    False,  # a lost DELETE answer: the retry finds it gone (404), as GitHub does
                )
            runners = await client.list_runners(conditional=False)
        assert time.monotonic() - started < 30
        assert all(not r.lease_labels for r in runners)
        assert sum(emu.admin.fault_plan()["injected"].values()) > 0
        assert client.calls.retries > 0

"""The emulator's GitHub behaviour: dispatch, completion, faults, counters and the admin API."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

REPO = "/repos/acme/gpu-ci/actions"


def _wait(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def _job(emu: RunningEmulator, job_id: int) -> dict:
    return next(j for j in emu.admin.dump()["jobs"] if j["id"] == job_id)


def _runner(emu: RunningEmulator, runner_id: int) -> dict:
    return next(r for r in emu.admin.dump()["runners"] if r["id"] == runner_id)


# ---- dispatch -----------------------------------------------------------------------------------


def test_dispatch_needs_every_label_case_insensitive_and_lowest_id_wins(
    emu: RunningEmulator, api: httpx.Client
) -> None:
    job = emu.admin.add_job(["Self-Hosted", "CLUSTER:H100", "ci-job-1.000-x"], 30)
    assert _job(emu, job["id"])["status"] == "queued"  # no runner carries ci-job-1.000-x
    api.post(f"{REPO}/runners/3/labels", json={"labels": ["CI-JOB-1.000-X"]})
    api.post(f"{REPO}/runners/2/labels", json={"labels": ["ci-job-1.000-x"]})
    # runner 3 got the label first: the label write itself dispatched the job to it
    got = _job(emu, job["id"])
    assert got["status"] == "in_progress" and got["runner_id"] == 3
    assert got["runner_name"] == "h100-03" and got["started_at"] is not None
    assert _runner(emu, 3)["busy"] is True and _runner(emu, 2)["busy"] is False
    plain = emu.admin.add_job(["self-hosted", "cluster:h100"], 30)
    assert _job(emu, plain["id"])["runner_id"] == 1  # superset runner 1, lowest idle id


def test_busy_runner_is_not_dispatched_to(emu: RunningEmulator, api: httpx.Client) -> None:
    api.post(f"{REPO}/runners/5/labels", json={"labels": ["only-here"]})
    first = emu.admin.add_job(["only-here"], 0.3)
    second = emu.admin.add_job(["only-here"], 30)
    assert _job(emu, first["id"])["runner_id"] == 5
    assert _job(emu, second["id"])["status"] == "queued"
    _wait(lambda: _job(emu, second["id"])["status"] == "in_progress")
    finished = _job(emu, first["id"])
    assert finished["status"] == "completed" and finished["conclusion"] == "success"
    assert _job(emu, second["id"])["runner_id"] == 5


def test_offline_runner_is_not_dispatched_to(emu: RunningEmulator, api: httpx.Client) -> None:
    emu.admin.set_runner_status(6, "offline")
    api.post(f"{REPO}/runners/6/labels", json={"labels": ["b200-special"]})
    job = emu.admin.add_job(["b200-special"], 30)
    emu.admin.tick()
    assert _job(emu, job["id"])["status"] == "queued"
    assert api.get(f"{REPO}/runners/6").json()["status"] == "offline"
    emu.admin.set_runner_status(6, "online")
    assert _job(emu, job["id"])["runner_id"] == 6


def test_job_completes_after_its_duration(emu: RunningEmulator) -> None:
    start = time.monotonic()
    job = emu.admin.add_job(["cluster:b200"], 0.4)
    assert _job(emu, job["id"])["status"] == "in_progress"
    _wait(lambda: _job(emu, job["id"])["status"] == "completed")
    assert time.monotonic() - start >= 0.35
    done = _job(emu, job["id"])
    assert done["conclusion"] == "success" and done["completed_at"] is not None
    assert _runner(emu, done["runner_id"])["busy"] is False


def test_complete_and_cancel_through_the_admin_api(emu: RunningEmulator, api: httpx.Client) -> None:
    running = emu.admin.add_job(["cluster:b200"], 60)
    queued = emu.admin.add_job(["nowhere"], 60, run_id=running["run_id"])
    assert queued["run_id"] == running["run_id"]
    assert api.get(f"{REPO}/runs/{running['run_id']}").json()["status"] == "in_progress"
    emu.admin.complete_job(running["id"], conclusion="failure")
    assert _job(emu, running["id"])["conclusion"] == "failure"
    assert _runner(emu, _job(emu, running["id"])["runner_id"])["busy"] is False
    emu.admin.cancel_job(queued["id"])
    run = api.get(f"{REPO}/runs/{running['run_id']}").json()
    assert run["status"] == "completed" and run["conclusion"] == "failure"
    lonely = emu.admin.add_job(["nowhere"], 60)
    emu.admin.cancel_job(lonely["id"])
    run = api.get(f"{REPO}/runs/{lonely['run_id']}").json()
    assert (run["status"], run["conclusion"]) == ("completed", "cancelled")


def test_run_status_filter(emu: RunningEmulator, api: httpx.Client) -> None:
    queued = emu.admin.add_job(["nowhere"], 60)
    running = emu.admin.add_job(["cluster:h100"], 60)
    ids = lambda status: [  # noqa: E731
        r["id"] for r in api.get(f"{REPO}/runs", params={"status": status}).json()["workflow_runs"]
    ]
    assert ids("queued") == [queued["run_id"]]
    assert ids("in_progress") == [running["run_id"]]
    assert ids("completed") == []
    emu.admin.complete_job(running["id"])
    assert ids("completed") == ids("success") == [running["run_id"]]


# ---- faults -------------------------------------------------------------------------------------


def test_status_fault_matches_method_and_path(emu: RunningEmulator, api: httpx.Client) -> None:
    emu.admin.fault("status", method="POST", path="/repos/*/labels", count=1, status=502)
    assert api.get(f"{REPO}/runners/1/labels").status_code == 200
    assert api.post(f"{REPO}/runners/1/labels", json={"labels": ["x"]}).status_code == 502
    assert "x" not in [lb["name"] for lb in api.get(f"{REPO}/runners/1/labels").json()["labels"]]
    assert api.post(f"{REPO}/runners/1/labels", json={"labels": ["x"]}).status_code == 200


def test_rate_limit_fault_is_a_429_with_retry_after(
    emu: RunningEmulator, api: httpx.Client
) -> None:
    emu.admin.fault("rate_limit", count=2, retry_after_s=3)
    for _ in range(2):
        response = api.get(f"{REPO}/runners")
        assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert api.get(f"{REPO}/runners").status_code == 200


def test_latency_fault(emu: RunningEmulator, api: httpx.Client) -> None:
    emu.admin.fault("latency", ms=300, path=f"{REPO}/runners/2")
    start = time.monotonic()
    api.get(f"{REPO}/runners/2")
    assert time.monotonic() - start >= 0.3
    start = time.monotonic()
    api.get(f"{REPO}/runners/1")
    assert time.monotonic() - start < 0.3
    emu.admin.clear_faults()
    start = time.monotonic()
    api.get(f"{REPO}/runners/2")
    assert time.monotonic() - start < 0.3


def test_fail_nth_write_is_not_applied(emu: RunningEmulator, api: httpx.Client) -> None:
    emu.admin.fault("fail_nth_write", n=2, status=500)
    assert api.post(f"{REPO}/runners/1/labels", json={"labels": ["w1"]}).status_code == 200
    assert api.get(f"{REPO}/runners/1").status_code == 200  # reads are not writes
    assert api.post(f"{REPO}/runners/1/labels", json={"labels": ["w2"]}).status_code == 500
    assert api.delete(f"{REPO}/runners/1/labels/w1").status_code == 200
    names = [lb["name"] for lb in api.get(f"{REPO}/runners/1/labels").json()["labels"]]
    assert "w2" not in names and "w1" not in names
    assert emu.admin.stats()["writes"] == 3


@pytest.mark.parametrize("applied", [True, False])
def test_hang_nth_write(emu: RunningEmulator, applied: bool) -> None:
    emu.admin.fault("hang_nth_write", n=1, hang_s=1.0, applied=applied)
    with (
        httpx.Client(base_url=emu.url, headers={"Authorization": "Bearer t"}, timeout=0.3) as api,
        pytest.raises(httpx.ReadTimeout),
    ):
        api.post(f"{REPO}/runners/1/labels", json={"labels": ["hung"]})
    has_label = lambda: "hung" in [n for n, _ in emu.state.runners[1].labels]  # noqa: E731
    if applied:
        assert has_label()  # landed although the caller never saw the answer
    else:
        time.sleep(1.0)
        assert not has_label()


def test_stats_count_by_method_and_template(emu: RunningEmulator, api: httpx.Client) -> None:
    api.get(f"{REPO}/runners/1")
    api.get(f"{REPO}/runners/2")
    api.delete(f"{REPO}/runners/2/labels/absent")
    stats = emu.admin.stats()
    assert stats["requests"] == {
        "GET /repos/{owner}/{repo}/actions/runners/{runner_id}": 2,
        "DELETE /repos/{owner}/{repo}/actions/runners/{runner_id}/labels/{name}": 1,
    }
    assert stats["writes"] == 1 and stats["quota_used"] == 3
    assert stats["statuses"] == {"200": 2, "404": 1}
    emu.admin.reset_stats()
    assert emu.admin.stats()["total"] == 0


def test_admin_api_rejects_bad_input_naming_the_field(emu: RunningEmulator) -> None:
    with httpx.Client(base_url=emu.url + "/_emulator") as admin:
        bad = admin.post("/jobs", json={"duration_s": 1})
        assert bad.status_code == 400 and "labels" in bad.json()["message"]
        bad = admin.post("/faults", json={"kind": "meteor"})
        assert bad.status_code == 400 and "kind" in bad.json()["message"]
        bad = admin.post("/faults", json={"kind": "status", "remaining": None})
        assert bad.status_code == 400 and "'remaining' is unknown" in bad.json()["message"]
        assert "count" in bad.json()["message"]
        bad = admin.post("/runners/1/status", json={"status": "asleep"})
        assert bad.status_code == 400 and "status" in bad.json()["message"]
        assert admin.post("/jobs/424242/complete").status_code == 404
        assert admin.post("/jobs", content=b"{oops").status_code == 400
    created = emu.admin.add_runner("extra-01", ["cluster:extra"], status="offline")
    assert created["status"] == "offline" and created["id"] == 10
    assert [lb["type"] for lb in created["labels"]] == ["read-only"] * 3 + ["custom"]


# ---- webhooks (the job-change seam) ------------------------------------------------------------


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[tuple[dict[str, str], bytes]]]]:
    received: list[tuple[dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    server.shutdown()
    server.server_close()


def test_job_changes_send_signed_workflow_job_webhooks(
    receiver: tuple[str, list[tuple[dict[str, str], bytes]]],
) -> None:
    url, received = receiver
    with running_emulator(pools={"p": 1}, webhook_urls=[url], webhook_secret="s3cret") as emu:
        job = emu.admin.add_job(["cluster:p"], 0.2)
        _wait(lambda: len(received) == 3)
    actions = [json.loads(body)["action"] for _, body in received]
    assert actions == ["queued", "in_progress", "completed"]
    for headers, body in received:
        expected = "sha256=" + hmac.new(b"s3cret", body, hashlib.sha256).hexdigest()
        assert headers["x-hub-signature-256"] == expected
        assert headers["x-github-event"] == "workflow_job"
        assert json.loads(body)["workflow_job"]["id"] == job["id"]
    assert len({h["x-github-delivery"] for h, _ in received}) == 3


def test_webhooks_can_be_switched_on_at_run_time(
    receiver: tuple[str, list[tuple[dict[str, str], bytes]]],
) -> None:
    url, received = receiver
    with running_emulator(pools={"p": 1}) as emu:
        emu.admin.add_job(["nowhere"], 1)
        emu.admin.set_webhooks([url])  # unsigned: no secret given
        job = emu.admin.add_job(["nowhere"], 1)
        _wait(lambda: len(received) == 1)
        emu.admin.set_webhooks([])
        emu.admin.cancel_job(job["id"])
        time.sleep(0.2)
    assert len(received) == 1
    headers, body = received[0]
    assert json.loads(body)["workflow_job"]["id"] == job["id"]
    assert "x-hub-signature-256" not in headers


def _scale_run() -> list[tuple[int, int | None]]:
    """1,000 runners and 500 queued jobs, then label writes that open runners up."""
    from slurmgate.testbed.emulator import build_state

    state = build_state("a/b", {"a": 400, "b": 300, "c": 200, "d": 100})
    jobs = [
        state.add_job(["self-hosted", f"cluster:{'abcd'[i % 4]}", f"gate-{i}"], 60)
        for i in range(500)
    ]
    runners = list(state.runners.values())
    for i in range(0, 500, 3):
        pool = "abcd"[i % 4]
        # give the gate to the two highest-numbered runners of the job's pool
        holders = [r for r in runners if r.name.startswith(f"{pool}-")][-2:]
        for runner in reversed(holders):
            state.add_labels(runner, [f"GATE-{i}"])
    return [(job.id, job.runner_id) for job in jobs]


def test_dispatch_at_scale_is_correct_and_deterministic() -> None:
    first = _scale_run()
    assert first == _scale_run()
    dispatched = [(job_id, runner_id) for job_id, runner_id in first if runner_id is not None]
    # each gated pool's two gate holders take the first two gated jobs; later ones find them busy
    assert len(dispatched) == 8
    assert len({runner_id for _, runner_id in dispatched}) == 8
    # a label write dispatches at once: runner 400 got gate-0 first, so it took job 0
    assert dispatched[0] == (50001, 400)
    assert sorted(r for _, r in dispatched) == [399, 400, 699, 700, 899, 900, 999, 1000]


async def test_rerun_makes_a_new_attempt(
    emu: RunningEmulator, api: httpx.Client, validate: Callable[[httpx.Response], None]
) -> None:
    from slurmgate.github.client import GitHubClient
    from slurmgate.github.scope import GitHubScope

    first = emu.admin.add_job(["nowhere", "ci-attempt-1"], 5)
    with httpx.Client(base_url=emu.url + "/_emulator") as admin:
        refused = admin.post(f"/runs/{first['run_id']}/rerun")
        assert refused.status_code == 400 and "not completed" in refused.json()["message"]
    emu.admin.complete_job(first["id"], conclusion="failure")
    rerun = emu.admin.rerun(first["run_id"])
    assert rerun["run_attempt"] == 2 and len(rerun["job_ids"]) == 1
    new_id = rerun["job_ids"][0]
    latest = api.get(f"{REPO}/runs/{first['run_id']}/jobs")
    validate(latest)
    assert [j["id"] for j in latest.json()["jobs"]] == [new_id]
    assert latest.json()["jobs"][0]["run_attempt"] == 2
    everything = api.get(f"{REPO}/runs/{first['run_id']}/jobs", params={"filter": "all"})
    assert [j["id"] for j in everything.json()["jobs"]] == [first["id"], new_id]
    attempt1 = api.get(f"{REPO}/runs/{first['run_id']}/attempts/1/jobs")
    assert [j["id"] for j in attempt1.json()["jobs"]] == [first["id"]]
    run = api.get(f"{REPO}/runs/{first['run_id']}").json()
    assert (run["status"], run["run_attempt"]) == ("queued", 2)
    async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), emu.token) as gh:
        jobs = await gh.list_active_jobs()
    assert [(j.id, j.run_attempt) for j in jobs] == [(new_id, 2)]

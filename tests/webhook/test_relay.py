"""The webhook relay against a real Prefect server: verify, de-duplicate, post, read back."""

from __future__ import annotations

import json
import logging
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from relaykit import SECRET, deliver, find_events, job_payload, wait_for_events

from slurmgate.github.webhook import (
    DeliveryCache,
    RelaySettings,
    WorkflowJobDelivery,
    check_fresh,
    event_for,
    signature,
    verify_signature,
)
from slurmgate.testbed.localproc import free_port


def event_id(delivery: str) -> str:
    """The id the relay gives the event of a delivery (asserted against the relay's answer)."""
    from slurmgate.github.webhook import _NAMESPACE

    return str(uuid.uuid5(_NAMESPACE, delivery))


def test_signed_queued_delivery_becomes_a_prefect_event(relay_factory, prefect_api) -> None:
    relay = relay_factory()
    delivery = str(uuid.uuid4())
    response = deliver(relay.url, job_payload(91001), delivery=delivery)
    assert response.status_code == 202, response.text
    assert response.json()["id"] == event_id(delivery)
    events = wait_for_events(prefect_api, 1, id={"id": [event_id(delivery)]})
    assert len(events) == 1, "the event never reached Prefect"
    event = events[0]
    assert event["event"] == "github.workflow_job.queued"
    assert event["resource"]["prefect.resource.id"] == "github.repo.acme.gpu-ci"
    assert event["resource"]["github.workflow_job.id"] == "91001"
    assert event["payload"]["job_id"] == 91001
    assert event["payload"]["run_id"] == 777 and event["payload"]["run_attempt"] == 1
    assert event["payload"]["status"] == "queued"
    assert "nodes:2" in event["payload"]["labels"]
    related = {r["prefect.resource.id"] for r in event["related"]}
    assert "github.workflow_job.91001" in related


@pytest.mark.parametrize("action", ["in_progress", "completed"])
def test_every_workflow_job_action_is_relayed(relay_factory, prefect_api, action) -> None:
    relay = relay_factory()
    delivery = str(uuid.uuid4())
    assert deliver(relay.url, job_payload(91002, action), delivery=delivery).status_code == 202
    events = wait_for_events(prefect_api, 1, id={"id": [event_id(delivery)]})
    assert [e["event"] for e in events] == [f"github.workflow_job.{action}"]


def test_rejected_deliveries_post_nothing(relay_factory, prefect_api) -> None:
    relay = relay_factory(max_age_s=300)
    bad = {
        "unsigned": deliver(relay.url, job_payload(92001), secret=None, delivery="d-unsigned"),
        "wrong-secret": deliver(relay.url, job_payload(92002), secret="guess", delivery="d-wrong"),
        "garbage-signature": deliver(
            relay.url, job_payload(92003), signature="sha256=zz", delivery="d-garbage"
        ),
        "sha1-only": deliver(
            relay.url, job_payload(92004), signature="sha1=abc", delivery="d-sha1"
        ),
        "stale": deliver(relay.url, job_payload(92005, age_s=301), delivery="d-stale"),
        "future": deliver(relay.url, job_payload(92006, age_s=-3600), delivery="d-future"),
    }
    codes = {name: response.status_code for name, response in bad.items()}
    assert codes == {
        "unsigned": 401,
        "wrong-secret": 401,
        "garbage-signature": 401,
        "sha1-only": 401,
        "stale": 403,
        "future": 403,
    }
    # a signature made over a different body does not carry over (body tampering)
    body = json.dumps(job_payload(92007)).encode()
    tampered = deliver(
        relay.url, body.replace(b"92007", b"92008"), signature=signature(SECRET, body)
    )
    assert tampered.status_code == 401
    assert relay.stats["posted"] == 0
    # then a good one: once it is visible, the earlier ones would have been too
    good = str(uuid.uuid4())
    assert deliver(relay.url, job_payload(92009), delivery=good).status_code == 202
    assert wait_for_events(prefect_api, 1, id={"id": [event_id(good)]})
    rejected = [event_id(d) for d in ("d-unsigned", "d-wrong", "d-garbage", "d-sha1", "d-stale")]
    assert find_events(prefect_api, id={"id": [*rejected, event_id("d-future")]}) == []
    assert relay.stats["unauthorized"] == 5 and relay.stats["stale"] == 2


def test_a_stale_delivery_that_is_signed_is_still_rejected_before_dedupe(relay_factory) -> None:
    """A stale delivery does not occupy its id: a fresh redelivery with that id is accepted."""
    relay = relay_factory(max_age_s=60)
    assert deliver(relay.url, job_payload(92101, age_s=120), delivery="d-x").status_code == 403
    assert deliver(relay.url, job_payload(92101), delivery="d-x").status_code == 202


def test_duplicate_delivery_is_posted_once(relay_factory, prefect_api) -> None:
    relay = relay_factory()
    delivery = str(uuid.uuid4())
    first = deliver(relay.url, job_payload(93001), delivery=delivery)
    again = deliver(relay.url, job_payload(93001), delivery=delivery)
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.json() == {"outcome": "duplicate", "duplicate": True}
    assert wait_for_events(prefect_api, 1, id={"id": [event_id(delivery)]})
    events = find_events(prefect_api, any_resource={"id": ["github.workflow_job.93001"]})
    assert len(events) == 1
    assert relay.stats["posted"] == 1 and relay.stats["duplicates"] == 1


def test_other_events_are_acknowledged_and_ignored(relay_factory) -> None:
    relay = relay_factory()
    ping = deliver(relay.url, {"zen": "Keep it simple."}, event="ping")
    push = deliver(relay.url, {"ref": "refs/heads/main"}, event="push")
    assert (ping.status_code, push.status_code) == (200, 202)
    assert push.json()["outcome"] == "ignored"
    # unsigned non-workflow_job events are not acknowledged either
    assert deliver(relay.url, {"ref": "x"}, event="push", secret=None).status_code == 401
    assert relay.stats["posted"] == 0 and relay.stats["ignored"] == 1


def test_bad_payloads_get_400_naming_the_field(relay_factory) -> None:
    relay = relay_factory()
    no_job = deliver(relay.url, {"action": "queued", "repository": {"full_name": "a/b"}})
    assert no_job.status_code == 400 and "workflow_job" in no_job.json()["detail"]
    payload = job_payload(94001)
    del payload["repository"]
    no_repo = deliver(relay.url, payload)
    assert no_repo.status_code == 400 and "repository: Field required" in no_repo.json()["detail"]
    payload = job_payload(94002)
    payload["repository"]["full_name"] = "acme/gpu-ci/../x"  # would shape the resource id
    odd_repo = deliver(relay.url, payload)
    assert odd_repo.status_code == 400 and "is not OWNER/NAME" in odd_repo.json()["detail"]
    assert deliver(relay.url, b"not json").status_code == 400
    assert relay.stats["posted"] == 0


def test_prefect_down_answers_503_and_a_redelivery_can_succeed(relay_factory, prefect_api) -> None:
    down = relay_factory(prefect_api_url=f"http://127.0.0.1:{free_port()}/api", post_timeout_s=2)
    delivery = str(uuid.uuid4())
    assert deliver(down.url, job_payload(95001), delivery=delivery).status_code == 503
    # the id was forgotten: GitHub's redelivery (same id) is posted, not dropped as a duplicate
    assert deliver(down.url, job_payload(95001), delivery=delivery).status_code == 503
    assert down.stats["duplicates"] == 0 and down.stats["post_failed"] == 2


def test_secret_never_reaches_logs_or_answers(relay_factory, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    relay = relay_factory()
    answers = [
        deliver(relay.url, job_payload(96001)),
        deliver(relay.url, job_payload(96002), secret="wrong"),
        deliver(relay.url, job_payload(96003), secret=None),
        deliver(relay.url, job_payload(96004, age_s=10_000)),
    ]
    assert [a.status_code for a in answers] == [202, 401, 401, 403]
    assert "rejected" in caplog.text and "posted" in caplog.text  # the relay did log
    assert SECRET not in caplog.text
    assert all(SECRET not in a.text for a in answers)
    settings = RelaySettings(
        secret=SECRET, prefect_api_url="http://x/api", prefect_auth_string="u:p"
    )
    assert SECRET not in repr(settings) and "u:p" not in repr(settings)


# ---- pure parts --------------------------------------------------------------------------------


def test_verify_signature_accepts_only_the_exact_hmac() -> None:
    body = b'{"a":1}'
    good = signature("s3cret", body)
    assert verify_signature("s3cret", body, good)
    assert verify_signature("s3cret", body, f"  {good} ")
    assert not verify_signature("s3cret", body + b" ", good)
    assert not verify_signature("other", body, good)
    assert not verify_signature("s3cret", body, None)
    assert not verify_signature("s3cret", body, good.upper())


def test_delivery_cache_is_bounded_in_size_and_age() -> None:
    """Keys are ids and body digests; a claim of several is all or nothing."""
    now = [0.0]
    cache = DeliveryCache(max_entries=3, ttl_s=10, clock=lambda: now[0])
    assert all(cache.claim(d) for d in "abc")
    assert not cache.claim("a")
    assert cache.claim("d") and len(cache) == 3  # "a" evicted: the oldest goes first
    assert cache.claim("a")
    now[0] = 11.0
    assert cache.claim("b") and len(cache) == 1  # everything older than the TTL expired
    assert not cache.claim("new-id", "b")  # one known key makes the delivery a duplicate
    assert cache.claim("new-id") and len(cache) == 2  # and the unknown one was not recorded
    cache.forget("new-id", "b")
    assert len(cache) == 0


def fresh(payload: dict[str, object], now: datetime) -> None:
    check_fresh(WorkflowJobDelivery.model_validate(payload), now, max_age_s=300, skew_s=60)


def test_freshness_uses_the_newest_job_timestamp() -> None:
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    payload = job_payload(1, "completed")
    job = payload["workflow_job"]
    job["created_at"] = job["started_at"] = "2026-01-01T00:00:00Z"  # queued long ago
    job["completed_at"] = "2026-01-01T11:59:00Z"  # but completed a minute ago
    fresh(payload, now)
    job["completed_at"] = None
    with pytest.raises(ValueError, match="old"):
        fresh(payload, now)
    # a job that waited before it was queued: its start time dates the queued delivery
    payload["action"] = "queued"
    job["started_at"] = "2026-01-01T11:58:30Z"
    fresh(payload, now)
    job["created_at"] = job["started_at"] = "2026-01-01T12:05:00Z"
    with pytest.raises(ValueError, match="future"):
        fresh(payload, now)
    for name in ("created_at", "started_at"):
        job[name] = None
    with pytest.raises(ValueError, match="missing"):
        fresh(payload, now)


def test_event_ids_are_stable_per_delivery() -> None:
    now = datetime.now(UTC) - timedelta(seconds=1)
    delivery = WorkflowJobDelivery.model_validate(job_payload(5))
    a = event_for(delivery, "delivery-1", now)
    b = event_for(delivery, "delivery-1", now)
    c = event_for(delivery, "delivery-2", now)
    assert a["id"] == b["id"] != c["id"]

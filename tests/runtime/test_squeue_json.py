"""The all-users listing (`squeue --all --json`) read without Slurm: Slurm 22.05's shape and the
data parser's (23.11 on) give the same jobs; any other shape, and a listing over its bound,
stop the read with an error that says so."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slurmgate.slurm import commands as slurm
from slurmgate.slurm.commands import QueuedJob

from .squeue_json import FakeSlurm, job_22_05, job_24_05, listing_22_05, listing_24_05, text_22_05

RUN_COMMENT = "slurmgate run=sg-a-0badc0de controller=login1/4242/99 beat=1796000000"
FORGED = "x\n4243\x1fsg-victim\x1fvictim\x1fRUNNING\x1f" + RUN_COMMENT  # the forgery test's

# (job id, name, user, uid, comment, 22.05's state word, the data parser's state list)
JOBS: list[tuple[int, str, str, int, str, str, list[str]]] = [
    (101, "sg-a-0badc0de", "runner", 1001, RUN_COMMENT, "RUNNING", ["RUNNING"]),
    (102, "sg-forger", "forger", 1002, FORGED, "RUNNING", ["RUNNING"]),
    (103, "sg-b-00000001", "runner", 1001, "", "PENDING", ["PENDING"]),
    (104, "sg-c-00000002", "alice", 1003, "", "CONFIGURING", ["RUNNING", "CONFIGURING"]),
    (105, "batch", "bob", 1004, "a/b note", "SUSPENDED", ["SUSPENDED"]),
    (106, "ending", "bob", 1004, "", "COMPLETING", ["COMPLETED", "COMPLETING"]),
    (107, "done", "bob", 1004, "", "COMPLETED", ["COMPLETED"]),
    (108, "again", "bob", 1004, "", "REQUEUED", ["PENDING", "REQUEUED"]),
    (109, "stopped", "bob", 1004, "", "CANCELLED", ["CANCELLED"]),
    (110, "oom", "bob", 1004, "", "OUT_OF_MEMORY", ["OUT_OF_MEMORY"]),
]
ACTIVE = [
    QueuedJob(str(i), name, user, state, comment, uid)
    for i, name, user, uid, comment, state, _ in JOBS
    if state in {"RUNNING", "PENDING", "CONFIGURING", "SUSPENDED"}
]


def listing_of(shape: str) -> str:
    """JOBS as `squeue --all --json` prints them in `shape`."""
    if shape == "22.05":
        return text_22_05(
            listing_22_05(
                *(
                    job_22_05(i, name, user, uid, state=old, comment=comment or None)
                    for i, name, user, uid, comment, old, _ in JOBS
                )
            )
        )
    return json.dumps(
        listing_24_05(
            *(
                job_24_05(i, name, user, uid, state=new, comment=comment)
                for i, name, user, uid, comment, _, new in JOBS
            )
        ),
        indent=2,
    )


@pytest.mark.parametrize("shape", ["22.05", "24.05"])
def test_both_shapes_list_the_same_active_jobs(fake_slurm: FakeSlurm, shape: str) -> None:
    fake_slurm.listing(listing_of(shape))
    jobs = slurm.jobs_of_all_users()
    assert jobs == ACTIVE
    # the forger's comment is one string of its own job: its newline and the job it names
    # forge no job of the listing
    (forger,) = [j for j in jobs if j.job_id == "102"]
    assert forger.comment == FORGED and forger.user == "forger" and forger.user_id == 1002
    assert "4243" not in {j.job_id for j in jobs}
    assert fake_slurm.calls() == [["squeue", "--all", "--json"]]


def test_22_05_nulls_read_as_empty_and_a_nameless_uid_as_its_number(
    fake_slurm: FakeSlurm,
) -> None:
    # 22.05 prints an unset string as null: a job without a name or a comment, and a uid the
    # host's passwd cannot name (uid_to_string_or_null)
    fake_slurm.listing(text_22_05(listing_22_05(job_22_05(201, None, None, 4321))))
    assert slurm.jobs_of_all_users() == [QueuedJob("201", "", "4321", "RUNNING", "", 4321)]


def test_data_parser_numbers_with_flags_are_read_for_ids(fake_slurm: FakeSlurm) -> None:
    job = job_24_05(301, "sg-d-00000003", "runner", 1001)
    job["job_id"] = {"set": True, "infinite": False, "number": 301}
    job["user_id"] = {"set": True, "infinite": False, "number": 1001}
    fake_slurm.listing(listing_24_05(job))
    assert slurm.jobs_of_all_users() == [
        QueuedJob("301", "sg-d-00000003", "runner", "RUNNING", "", 1001)
    ]


def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(job: dict[str, Any]) -> None:
        job[field] = value

    return change


def _drop(field: str) -> Callable[[dict[str, Any]], None]:
    def change(job: dict[str, Any]) -> None:
        del job[field]

    return change


# One field of one job in a shape no Slurm prints, and the field the error must name.
UNKNOWN_JOB_SHAPES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "state as an object": (_set("job_state", {"current": ["RUNNING"]}), "job_state"),
    "state as a number": (_set("job_state", 1), "job_state"),
    "state list without a base": (_set("job_state", ["CONFIGURING"]), "job_state"),
    "state list with two bases": (_set("job_state", ["RUNNING", "PENDING"]), "job_state"),
    "state list of objects": (_set("job_state", [{"state": "RUNNING"}]), "job_state"),
    "state word unknown": (_set("job_state", "RUNNING_LATE"), "job_state"),
    "state lower case": (_set("job_state", "running"), "job_state"),
    "state missing": (_drop("job_state"), "job_state"),
    "job id as text": (_set("job_id", "101"), "job_id"),
    "job id null": (_set("job_id", None), "job_id"),
    "job id zero": (_set("job_id", 0), "job_id"),
    "job id a boolean": (_set("job_id", True), "job_id"),
    "job id unset": (_set("job_id", {"set": False, "infinite": False, "number": 0}), "job_id"),
    "job id with more keys": (
        _set("job_id", {"set": True, "infinite": False, "number": 1, "unit": "s"}),
        "job_id",
    ),
    "user id missing": (_drop("user_id"), "user_id"),
    "user id as text": (_set("user_id", "1001"), "user_id"),
    "user id negative": (_set("user_id", -1), "user_id"),
    "user id infinite": (_set("user_id", {"set": False, "infinite": True, "number": 0}), "user_id"),
    "name a number": (_set("name", 5), "name"),
    "user name a list": (_set("user_name", ["runner"]), "user_name"),
    "comment split by author": (_set("comment", {"job": RUN_COMMENT}), "comment"),
}


@pytest.mark.parametrize("shape", ["22.05", "24.05"])
@pytest.mark.parametrize("case", sorted(UNKNOWN_JOB_SHAPES))
def test_a_job_of_unknown_shape_stops_the_read(
    fake_slurm: FakeSlurm, shape: str, case: str
) -> None:
    """Never a job skipped: a reaper that read nothing would cancel nothing and say nothing."""
    change, field = UNKNOWN_JOB_SHAPES[case]
    document = json.loads(listing_of(shape))
    change(document["jobs"][0])
    fake_slurm.listing(document)
    with pytest.raises(slurm.SlurmAnswerUnreadable) as raised:
        slurm.jobs_of_all_users()
    message = str(raised.value)
    assert message.startswith("`squeue --all --json` listed job #0 with ")
    assert f" with {field} " in message and slurm.UNREADABLE_ANSWER in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "something other than JSON"),
        ("squeue: error: Invalid user\n", "something other than JSON"),
        ('{"jobs": [', "something other than JSON"),
        ("[]", "JSON without a jobs list"),
        ('{"meta": {}, "errors": []}', "JSON without a jobs list"),
        ('{"jobs": {"101": {}}}', "JSON without a jobs list"),
        ('{"jobs": [[101, "sg-a"]]}', "listed job #0 with an entry [101,"),
    ],
)
def test_a_listing_of_unknown_shape_stops_the_read(
    fake_slurm: FakeSlurm, text: str, said: str
) -> None:
    fake_slurm.listing(text)
    with pytest.raises(slurm.SlurmAnswerUnreadable, match=slurm.UNREADABLE_ANSWER) as raised:
        slurm.jobs_of_all_users()
    assert said in str(raised.value)


@pytest.mark.parametrize("shape", ["22.05", "24.05"])
def test_errors_slurm_lists_stop_the_read(fake_slurm: FakeSlurm, shape: str) -> None:
    document = json.loads(listing_of(shape))
    error = {"error": "Unable to contact slurm controller", "error_number": 1007}
    document["errors"] = [{**error, "source": "slurm_load_jobs", "description": "connect"}]
    fake_slurm.listing(document)
    with pytest.raises(slurm.SlurmError, match="answered with errors: Unable to contact") as e:
        slurm.jobs_of_all_users()
    assert not isinstance(e.value, slurm.SlurmAnswerUnreadable)


def test_the_listing_is_read_under_its_bound(fake_slurm: FakeSlurm) -> None:
    # valid JSON past the bound (64 MiB of leading spaces): without the bound it would read as
    # an empty listing, and a reaper would cancel nothing
    fake_slurm.listing(listing_24_05(), pad=slurm.MAX_SQUEUE_JSON_BYTES)
    with pytest.raises(slurm.SlurmError, match="answered more than 64 MiB"):
        slurm.jobs_of_all_users()


def test_real_shaped_listings_differ_only_as_slurm_prints_them() -> None:
    """The two fixtures are the two shapes: a guard on the helpers the tests above rely on."""
    old = json.loads(listing_of("22.05"))
    new = json.loads(listing_of("24.05"))
    assert isinstance(old["jobs"][0]["job_state"], str) and old["jobs"][0]["time_limit"] is None
    assert new["jobs"][0]["job_state"] == ["RUNNING"]
    assert new["jobs"][0]["time_limit"] == {"set": False, "infinite": True, "number": 0}
    assert "\\/" in listing_of("22.05")  # json-c escapes slashes


def test_an_all_users_reap_stops_loudly_on_a_listing_it_cannot_read(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    """Not "0 run(s) reaped": the command fails, naming the field and what to report."""
    job = job_24_05(401, "sg-e-00000004", "runner", 1001, comment=RUN_COMMENT)
    job["job_state"] = {"current": ["RUNNING"], "reason": "None"}
    fake_slurm.listing(listing_24_05(job))
    argv = [sys.executable, "-m", "slurmgate.cli", "allocation", "reap", "--all-users"]
    out = subprocess.run(
        [*argv, "--runs-dir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1, out
    assert "reaped" not in out.stdout
    warning, error = out.stderr.splitlines()
    said = "SlurmAnswerUnreadable: `squeue --all --json` listed job #0 with job_state "
    assert warning.startswith(f"warning: reap of other users' runs deferred: {said}")
    assert error.startswith(
        f"error: reap stopped: {said}"
        '{"current": ["RUNNING"], "reason": "None"}, in a shape slurmgate does not read; '
    )
    assert error.endswith("report this with `squeue --version`")

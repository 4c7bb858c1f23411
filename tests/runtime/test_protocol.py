"""The node worker's messages to the controller: each kind's line, and the bounded parser."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmgate.runtime.steps import protocol

EVERY_KIND: list[protocol.Message] = [
    protocol.PreflightPassed(host="node1", cpus=32, gpus=8),
    protocol.PreflightCheckFailed(host="node1", check="port", detail="port 8000 is not bindable"),
    protocol.LaneStarted(host="node2", lane="chat-replica-00000-rank-00000"),
    protocol.LaneSpawnFailed(host="node2", lane="chat-r1", detail="No such file or directory"),
    protocol.LaneExited(host="node3", lane="chat-r0", status=-9, uptime_s=61.5),
]


@pytest.mark.parametrize("message", EVERY_KIND, ids=lambda m: m.kind)
def test_every_kind_is_one_prefixed_compact_json_line_that_parses_back(
    message: protocol.Message,
) -> None:
    line = protocol.encode(message)
    assert line.startswith(protocol.PREFIX) and "\n" not in line
    body = json.loads(line[len(protocol.PREFIX) :])
    assert body["kind"] == message.kind and ": " not in line
    assert list(protocol.parse(f"noise\n{line}\nmore noise\n")) == [message]


def test_messages_are_found_among_human_lines_and_when_srun_joins_lines() -> None:
    ok, failed = EVERY_KIND[0], EVERY_KIND[1]
    log = (
        "[node-worker node1] started lane x pid 1 gpus 0\n"
        + protocol.encode(ok)
        + protocol.encode(failed)
        + "srun: error: node1: task 0: Exited with exit code 70\n"
    )
    assert list(protocol.parse(log)) == [ok, failed]
    assert protocol.messages(log, protocol.PreflightCheckFailed) == [failed]


def test_an_uptime_travels_in_tenths_and_free_text_is_bounded() -> None:
    exited = protocol.LaneExited(host="n", lane="l", status=1, uptime_s=59.96)
    (back,) = protocol.parse(protocol.encode(exited))
    assert isinstance(back, protocol.LaneExited) and back.uptime_s == 60.0
    long = protocol.PreflightCheckFailed(host="n", check="port", detail="x" * 50_000)
    (cut,) = protocol.parse(protocol.encode(long))
    assert isinstance(cut, protocol.PreflightCheckFailed)
    assert len(cut.detail) == protocol.DETAIL_CHARS


@pytest.mark.parametrize(
    "body",
    [
        "{not json",
        "[1, 2]",
        '{"kind": "lane-teleported", "host": "n"}',
        '{"host": "n", "lane": "l"}',
        '{"kind": "lane-exited", "host": "n", "lane": "l", "status": "1", "uptime_s": 1}',
        '{"kind": "lane-exited", "host": "n", "lane": "l", "status": true, "uptime_s": 1}',
        '{"kind": "lane-exited", "host": "n", "lane": "l", "status": 1, "uptime_s": NaN}',
        '{"kind": "preflight-ok", "host": "n", "cpus": 1}',
        "[" * 20_000,
        '{"kind": "lane-started", "host": "n", "lane": "' + "l" * 10_000 + '"}',
    ],
)
def test_a_line_that_is_not_a_known_well_formed_message_is_skipped(body: str) -> None:
    started = protocol.encode(protocol.LaneStarted(host="n", lane="l"))
    log = f"{protocol.PREFIX}{body}\n{started}\n"
    assert list(protocol.parse(log)) == [protocol.LaneStarted(host="n", lane="l")]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(max_size=200),
            st.just(protocol.PREFIX),
            st.sampled_from([protocol.encode(m) for m in EVERY_KIND]),
        ),
        max_size=20,
    )
)
def test_the_parser_never_raises(pieces: list[str]) -> None:
    found = list(protocol.parse("".join(pieces)))
    assert all(isinstance(m, tuple(type(k) for k in EVERY_KIND)) for m in found)

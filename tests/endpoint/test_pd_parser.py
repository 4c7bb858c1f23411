"""The PD endpoint's parser process: the same answers as ``pd.pairable``, from a lean child."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slurmgate.runtime.endpoint import pd, pdparser

SPOOF = {"prompt": "x", "bootstrap_host": "10.9.9.9", "bootstrap_port": 1, "bootstrap_room": 3}
BIG = "y" * (pdparser.INLINE_BYTES + 1)  # a prompt that makes a body go to the child


@pytest.mark.parametrize(
    "body",
    [
        json.dumps({"prompt": BIG, "max_tokens": 4}).encode(),  # the answer: "stripped"
        b" \r\n" + json.dumps({"prompt": BIG}).encode() + b"\t\n",
        b"\xef\xbb\xbf" + json.dumps({"prompt": BIG}).encode(),  # rebuilt: a byte order mark
        json.dumps({"prompt": BIG}).encode("utf-16"),
        json.dumps({**SPOOF, "prompt": BIG}).encode(),  # rebuilt: the client's fields dropped
        json.dumps({"prompt": [BIG, "z"]}).encode(),  # a batch of two
        json.dumps({"input_ids": [[1, 2]] * 3}).encode(),
        json.dumps([{"prompt": BIG}]).encode(),  # refused: not an object
        b"\x00" + json.dumps({"prompt": BIG}).encode(),  # refused: not JSON
        json.dumps({"prompt": ["a"] * (pd.MAX_BATCH + 1)}).encode(),  # refused: batch too large
        b'{"prompt":' + b"[" * (pd.MAX_CONTAINERS + 1) + b"}",  # refused before the parse
        b"{}",
    ],
    ids=[
        "plain",
        "space",
        "bom",
        "utf16",
        "spoofed",
        "batch",
        "batched-ids",
        "array",
        "nul",
        "batch-over",
        "brackets",
        "empty",
    ],
)
async def test_the_child_answers_as_pairable_does(body: bytes) -> None:
    parser = pdparser.ChildParser(time_limit=30)
    try:
        assert await parser.parse(body) == pd.pairable(body)
        assert parser.started == 1
    finally:
        parser.close()
    assert parser.process is not None and parser.process.returncode is not None


def test_the_child_loads_the_standard_library_and_pd_only() -> None:
    """It starts as the endpoint starts it (``-I -S``: no site-packages, no environment), so
    it starts fast, and nothing of the endpoint's runs in it."""
    code = pdparser._CODE.replace("main(int(sys.argv[2]))", "print(' '.join(sys.modules))")
    loaded = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, pdparser._ROOT, "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    ours = {name for name in loaded if name.split(".")[0] not in sys.stdlib_module_names}
    assert ours == {
        "__main__",
        "slurmgate",
        "slurmgate.runtime",
        "slurmgate.runtime.endpoint",
        "slurmgate.runtime.endpoint.pd",
        "slurmgate.runtime.endpoint.pdworker",
    }

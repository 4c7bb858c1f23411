"""Hostile YAML: a few hundred bytes of chained aliases, recursive anchors and deep nesting are
refused in one line, within 2 s, by every command that reads a spec, a recipe or a matrix row."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slurmgate.cli.app import app
from slurmgate.documents import MAX_ALIASES, DocumentError, parse_yaml

# Nine lines, 324 bytes: every list holds nine aliases of the one before, 9**9 leaves in all.
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)
REFUSED_WITHIN = 2.0  # seconds; walking every path through its shared nodes took over 10 s


def test_the_bomb_is_small() -> None:
    assert len(BOMB.encode()) < 512 and BOMB.count("\n") == 9


@pytest.mark.serial  # a wall-clock bound: one at a time
def test_chained_aliases_are_refused_before_anything_walks_them() -> None:
    started = time.monotonic()
    with pytest.raises(DocumentError, match=r"expands to more than .* nodes once its aliases"):
        parse_yaml(BOMB, "bomb.yaml")
    assert time.monotonic() - started < REFUSED_WITHIN


def test_a_recursive_anchor_is_refused() -> None:
    with pytest.raises(DocumentError, match="recursive YAML alias"):
        parse_yaml("a: &a [1, *a]\n", "loop.yaml")


def test_too_many_aliases_are_refused_even_when_each_is_small() -> None:
    text = "a: &a 1\nb: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\n"
    with pytest.raises(DocumentError, match=f"more than {MAX_ALIASES} YAML aliases"):
        parse_yaml(text, "many.yaml")


def test_ordinary_anchors_and_merge_keys_still_read() -> None:
    text = "base: &base {image: x, gpus: 8}\nprefill:\n  <<: *base\n  gpus: 4\ndecode: *base\n"
    assert parse_yaml(text, "ok.yaml") == {
        "base": {"image": "x", "gpus": 8},
        "prefill": {"image": "x", "gpus": 4},
        "decode": {"image": "x", "gpus": 8},
    }


def test_deep_nesting_is_refused() -> None:
    with pytest.raises(DocumentError, match="nests deeper"):
        parse_yaml("a: " + "[" * 80 + "]" * 80, "deep.yaml")


@pytest.mark.parametrize(
    "argv",
    [
        ["spec", "from-recipe", "{path}"],
        ["node-count", "{path}"],
        ["labels", "{path}", "--runner", "x"],
        ["allocation", "run", "--recipe", "{path}"],
    ],
    ids=["from-recipe", "node-count", "labels", "allocation-run"],
)
@pytest.mark.serial  # a wall-clock bound: one at a time
def test_every_command_refuses_the_bomb_in_one_line(tmp_path: Path, argv: list[str]) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(BOMB)
    started = time.monotonic()
    result = CliRunner().invoke(app, [a.format(path=path) for a in argv])
    assert time.monotonic() - started < REFUSED_WITHIN
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "aliases" in lines[0], result.output
    assert "Traceback" not in result.output

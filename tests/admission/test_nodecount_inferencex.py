"""Node-count settings read as InferenceX's own generator reads them, or refused by name.

InferenceX's functions (tests/data/inferencex/nodecount_reference.py, copied from its
generator) decide what a setting means; slurmgate must count the same nodes, or refuse a
setting the generator would silently ignore, never count another number.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest

from slurmgate.ci.nodecount import NodeCountError, node_count

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "inferencex" / "nodecount_reference.py"
_spec = importlib.util.spec_from_file_location("inferencex_nodecount", REFERENCE)
assert _spec is not None and _spec.loader is not None
inferencex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(inferencex)

GPUS = 8
HARDWARE = {"b300": GPUS}
RECIPE = "recipes/x.yaml"  # resources: 3 prefill nodes + 4 decode nodes


def inferencex_count(prefill: dict[str, Any], decode: dict[str, Any], root: Path) -> int:
    """InferenceX's `multinode_node_count` on a b300 row, through its own setting readers."""
    recipe = inferencex.recipe_node_count(prefill, decode, root)
    if recipe is not None:
        return int(recipe)
    total = 0
    for name, worker in (("prefill", prefill), ("decode", decode)):
        override = inferencex._worker_node_override(worker, f"{name.upper()}_NODES")
        total += override if override is not None else math.ceil(worker["tp"] / GPUS)
    return total


def row(prefill: list[str], decode: list[str]) -> dict[str, Any]:
    return {
        "runner": "b300",
        "multinode": True,
        "disagg": True,
        "prefill": {"num-worker": 1, "tp": 8, "additional-settings": prefill},
        "decode": {"num-worker": 1, "tp": 16, "additional-settings": decode},
    }


MATCHED = "matched"
# (prefill settings, decode settings, what slurmgate does): the probed malformed cases and the
# well-formed ones around them. "refused": the generator ignores the setting and counts the
# topology (2 + 1 = 3), which the row's writer did not mean.
CASES = [
    (["PREFILL_NODES=2"], ["DECODE_NODES=1"], MATCHED),
    (["PREFILL_NODES= 2"], [], "refused"),
    (["PREFILL_NODES =2"], [], "refused"),
    ([" PREFILL_NODES=2"], [], "refused"),
    (["PREFILL_NODES=2 "], [], "refused"),
    (["PREFILL_NODES=2=3"], [], "refused"),
    (["PREFILL_NODES"], [], "refused"),
    (["prefill_nodes=2"], [], "refused"),
    (["PREFILL_NODES=\u0663"], [], MATCHED),  # ARABIC-INDIC DIGIT THREE: a decimal digit
    (["PREFILL_NODES=\u00b2"], [], "refused"),  # SUPERSCRIPT TWO: a digit, not a decimal one
    (["PREFILL_NODES=2\n"], [], MATCHED),  # `$` matches before a final newline
    (["PREFILL_NODES=02", "PREFILL_NODES=2"], [], MATCHED),
    (["DECODE_NODES=1"], [], "refused"),  # the decode role's variable in the prefill role
    ([], ["PREFILL_NODES=5"], "refused"),
    ([f"CONFIG_FILE={RECIPE}"], [], MATCHED),
    ([f"CONFIG_FILE ={RECIPE}"], [], "refused"),  # counted fewer nodes than InferenceX before
    ([f"CONFIG_FILE= {RECIPE}"], [], "refused"),
    ([f" CONFIG_FILE={RECIPE}"], [], "refused"),
    (["CONFIG_FILE="], [], "refused"),  # the generator stops on it
    ([f"CONFIG_FILE={RECIPE}", "PREFILL_NODES=1"], [], MATCHED),  # the recipe wins
    (["CONFIG_FILE=recipes/absent.yaml"], ["DECODE_NODES=2"], MATCHED),  # not checked in
]


@pytest.mark.parametrize(("prefill", "decode", "outcome"), CASES)
def test_settings_count_as_inferencex_counts_them_or_are_refused(
    tmp_path: Path, prefill: list[str], decode: list[str], outcome: str
) -> None:
    (tmp_path / "x.yaml").write_text("resources:\n  prefill_nodes: 3\n  decode_nodes: 4\n")
    the_row = row(prefill, decode)
    try:
        expected: int | None = inferencex_count(the_row["prefill"], the_row["decode"], tmp_path)
    except OSError:
        expected = None  # the generator stops (`CONFIG_FILE=` reads the recipe folder itself)
    if outcome == MATCHED:
        assert node_count(the_row, HARDWARE, tmp_path) == expected
    else:
        with pytest.raises(NodeCountError, match="additional-settings") as caught:
            node_count(the_row, HARDWARE, tmp_path)
        assert "\n" not in str(caught.value)
        # the generator ignored the setting (the topology's 1 + 2), or stopped on it
        assert expected in (3, None)

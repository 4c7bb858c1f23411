"""Cut InferenceX's AMD multi-node disaggregated configs out of its master config, verbatim.

Run from the repository root with InferenceX's files at commit 843c6254f (see
slurmgate/data/inferencex-amd/SOURCE.md):

    python scripts/inferencex-amd.py --master configs/amd-master.yaml \
        --models benchmarks/multi_node/amd_utils/models.yaml

It keeps each top-level block of the master config whose `framework` is `sglang-disagg` or
`atom-disagg` with `multinode: true` (the job mix's 48 AMD rows), byte for byte, in the order
upstream has them, and copies the launch scripts' models.yaml unchanged; both go to
slurmgate/data/inferencex-amd/. Nothing is reformatted: the blocks keep their comments.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import yaml

OUT = Path("slurmgate/data/inferencex-amd")
FRAMEWORKS = ("sglang-disagg", "atom-disagg")
HEADER = (
    "# Excerpt of SemiAnalysisAI/InferenceX configs/amd-master.yaml at commit 843c6254f\n"
    "# (Apache-2.0): its multi-node disaggregated blocks, verbatim. See SOURCE.md; written by\n"
    "# scripts/inferencex-amd.py.\n"
)
_KEY = re.compile(r"^([A-Za-z0-9][^:\s]*):\s*$")


def blocks(text: str) -> dict[str, str]:
    """Each top-level key's block: its line and every indented or blank line after it."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines(keepends=True):
        match = _KEY.match(line)
        if match:
            current = found.setdefault(match.group(1), [])
            current.append(line)
        elif line[:1] in (" ", "\n", "\r", "") and current is not None:
            current.append(line)
        else:  # a comment at column 0 ends the block (it heads the next one)
            current = None
    return {key: "".join(lines).rstrip() + "\n" for key, lines in found.items()}


def excerpt(text: str) -> str:
    data = yaml.safe_load(text)
    keep = [
        key
        for key, block in blocks(text).items()
        if data[key].get("framework") in FRAMEWORKS and data[key].get("multinode") is True
    ]
    return HEADER + "\n" + "\n".join(blocks(text)[key] for key in keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", type=Path, required=True, help="configs/amd-master.yaml")
    parser.add_argument("--models", type=Path, required=True, help="amd_utils/models.yaml")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "amd-master-disagg.yaml").write_text(excerpt(args.master.read_text()))
    (OUT / "models.yaml").write_bytes(args.models.read_bytes())


if __name__ == "__main__":
    main()

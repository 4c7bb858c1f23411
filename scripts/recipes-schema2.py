"""Write the schema-2 forms of a representative subset of the shipped InferenceX recipes.

Run from the repository root: `python scripts/recipes-schema2.py`. It reads each recipe of
SUBSET under tests/data/inferencex-recipes/ (schema 1, as InferenceX checked them in), folds it
into srt-slurm 2.0's layout with `slurmgate.runtime.spec.recipes.to_schema2` and writes it under
tests/data/inferencex-recipes-schema2/ at the same path. tests/ci/test_recipes.py checks that
the files are what this prints and that both forms give the same spec and node count.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from slurmgate.runtime.spec import recipes

ROOT = Path("tests/data/inferencex-recipes")
OUT = Path("tests/data/inferencex-recipes-schema2")
# One recipe per shape of the job mix: engine x frontend x mode, with and without a dedicated
# infra node and a setup script.
SUBSET = (
    "sglang/deepseek-v4/8k1k/disagg-b200-low-latency-1p1d-tp8-tp8-mtp.yaml",
    "sglang/deepseek-v4/agentic/agg-gb300-tp4-mtp-kvoffload.yaml",
    "sglang/deepseek-v4/agentic/disagg-gb300-12p4d-dep8-dep16-c1536-mtp-kvoffload.yaml",
    "sglang/glm5.2/gb200-fp4/agentic/agg-gb200-tp8-c2-mtp.yaml",
    "sglang/qwen3.5/gb200-fp4/agentic/agg-gb200-tp2ep2-mtp-hicache.yaml",
    "sglang/qwen3.5/gb200-fp8/8k1k/4p1d-dep4-dep16.yaml",
    "trtllm/qwen3.5/gb300-fp4/disagg/8k1k/mtp/ctx2dep2_gen15tp4_mtp3_c90.yaml",
    "vllm/deepseek-v4/8k1k/agg-gb200-low-latency-mtp2.yaml",
    "vllm/deepseek-v4/8k1k/disagg-b200-1p1d-dep8-dep8-mtp.yaml",
    "vllm/kimi-k3/agentic/agg-b200-tp8pp2-agentic.yaml",
    "vllm/minimax-m3/gb200-fp4/agentic/disagg-1p1d-dep8-dep4-agentic.yaml",
)
HEADER = (
    "# Schema-2 form of InferenceX's {path} (see ../inferencex-recipes/SOURCE.md), written by\n"
    "# scripts/recipes-schema2.py with slurmgate's v1 -> v2 migration.\n"
)


def schema2_text(relative: str) -> str:
    """The schema-2 file for one recipe of the subset."""
    data = recipes.load(ROOT / relative)
    body = yaml.safe_dump(recipes.to_schema2(data, relative), sort_keys=False, width=100)
    return HEADER.format(path=relative) + body


if __name__ == "__main__":
    for relative in SUBSET:
        target = OUT / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(schema2_text(relative))
        print(target)

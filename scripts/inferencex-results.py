"""Copy InferenceX's result scripts, byte for byte, from an InferenceX clone.

Run from the repository root: `python scripts/inferencex-results.py --git-dir PATH`, PATH being
the git directory of a clone of SemiAnalysisAI/InferenceX (a bare one will do) that holds
`COMMIT`. Every file of `FILES` is written to tests/data/inferencex-results/<its path>, with
InferenceX's LICENSE, and the manifest table of that folder's SOURCE.md (path, commit, git blob
id) is printed on stdout. The tests run these scripts on slurmgate's result files: InferenceX's
own code is the judge of the format.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

OUT = Path("tests/data/inferencex-results")
# InferenceX main at the job mix's snapshot (slurmgate/data/SOURCE.md)
COMMIT = "843c6254ff69b567f772f6a5fd97675af3d04431"
FILES = (
    # one fixed-sequence-length result file -> its agg_<name>.json (the multi-node template
    # runs it once per concurrency file)
    "utils/process_result.py",
    # every agg_*.json of a directory -> one agg_<exp>.json list
    "utils/collect_results.py",
    # aiperf's profile_export_aiperf.json -> pass, or the error-rate bound it broke
    "utils/agentic/validation/validate_agentic_result.py",
    # aiperf's per-request export (+ aggregate, server metrics) -> the agentic aggregate
    # $RESULT_FILENAME.json; run as `python -m utils.agentic.aggregation.process_agentic_result`
    # (relative imports), so the package files and every module it imports come with it
    "utils/agentic/__init__.py",
    "utils/agentic/aggregation/__init__.py",
    "utils/agentic/aggregation/process_agentic_result.py",
    "utils/agentic/aggregation/aggregation_common.py",
    "utils/agentic/aggregation/request_metrics.py",
    "utils/agentic/aggregation/trace_metadata.py",
    "utils/agentic/aggregation/server_log_metrics.py",
    "utils/agentic/aggregation/server_metrics.py",
    "utils/agentic/aggregation/backends/__init__.py",
    "utils/agentic/aggregation/backends/base.py",
    "utils/agentic/aggregation/backends/atom.py",
    "utils/agentic/aggregation/backends/dynamo_vllm.py",
    "utils/agentic/aggregation/backends/sglang.py",
    "utils/agentic/aggregation/backends/vllm.py",
    "utils/agentic/validation/__init__.py",
    "LICENSE",
)


def _git(git_dir: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--git-dir", required=True, help="git directory of an InferenceX clone")
    git_dir = parser.parse_args().git_dir
    if _git(git_dir, "cat-file", "-e", f"{COMMIT}^{{commit}}").returncode != 0:
        print(f"{git_dir}: commit {COMMIT} is missing; fetch it", file=sys.stderr)
        return 2
    table = ["| file | commit | git blob |", "|---|---|---|"]
    for path in FILES:
        found = _git(git_dir, "rev-parse", "--verify", "--quiet", f"{COMMIT}:{path}")
        if found.returncode != 0:
            print(f"not in InferenceX at {COMMIT[:8]}: {path}", file=sys.stderr)
            return 1
        blob_id = found.stdout.decode().strip()
        target = OUT / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_git(git_dir, "cat-file", "blob", blob_id).stdout)
        table.append(f"| `{path}` | `{COMMIT[:8]}` | `{blob_id}` |")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

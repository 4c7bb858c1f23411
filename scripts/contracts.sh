#!/usr/bin/env bash
# The contract between the parts (pyproject.toml's [tool.importlinter]), checked by import-linter
# on the package as it installs: the Prefect layer's folders are `slurmgate.*` subpackages, so it
# reads the same view of symlinks that scripts/typecheck.sh builds. Arguments go to lint-imports.
# SLURMGATE_CONTRACT_ROOT checks another copy of the tree (the planted-cycle tests use one).
set -euo pipefail
root="${SLURMGATE_CONTRACT_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}"
linter="${LINT_IMPORTS:-lint-imports}"
view="$(mktemp -d -t slurmgate-contract.XXXXXX)"
trap 'rm -rf "$view"' EXIT
mkdir -p "$view/slurmgate"
for entry in "$root"/slurmgate/*; do
    case "$entry" in */__pycache__) continue ;; esac
    ln -s "$entry" "$view/slurmgate/${entry##*/}"
done
for folder in blocks tasks flows deployments; do ln -s "$root/$folder" "$view/slurmgate/$folder"; done
cd "$view"
PYTHONPATH="$view" exec "$linter" --no-cache "$root/pyproject.toml" "$@"

#!/usr/bin/env bash
# mypy over the package as it installs: the Prefect layer's folders (blocks, tasks, flows,
# deployments) are `slurmgate.*` subpackages, a mapping mypy cannot read from pyproject.toml, so
# it checks a view of symlinks (.mypy-view/slurmgate) that joins them. Arguments go to mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
view=.mypy-view/slurmgate
rm -rf .mypy-view
mkdir -p "$view"
for entry in slurmgate/*; do
    case "$entry" in */__pycache__) continue ;; esac
    ln -s "../../$entry" "$view/${entry#slurmgate/}"
done
for folder in blocks tasks flows deployments; do ln -s "../../$folder" "$view/$folder"; done
# mypy's incremental cache lives in the user's cache, not the clone: its entries are checked by
# content hash, so a clean clone (CI's) reuses them and takes seconds instead of most of a minute.
export MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/slurmgate/mypy}"
exec "${MYPY:-mypy}" "$@"

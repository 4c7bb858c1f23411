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
exec "${MYPY:-mypy}" "$@"

#!/usr/bin/env bash
# The whole test suite: setup, lint, type-check, then pytest with the bundled Slurm cluster up.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
VENV="${SLURMGATE_VENV:-.venv}"
export PATH="$PWD/$VENV/bin:$PATH"
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false

echo "== ruff check"; ruff check .
echo "== ruff format --check"; ruff format --check .
echo "== mypy (core)"; mypy

started_slurm=0
if [ -z "${SLURMGATE_NO_SLURM:-}" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if SLURM_LOCAL_MODE=netns scripts/slurm-local/start.sh >/tmp/slurmgate-slurm-start.log 2>&1; then
        started_slurm=1
        # shellcheck disable=SC1091
        . "${SLURM_LOCAL_DIR:-/tmp/slurm-local}/env.sh"
        export SLURMGATE_LOCAL_SLURM=1
    else
        echo "!! the local Slurm cluster did not start; Slurm tests will skip. Log:" >&2
        tail -n 20 /tmp/slurmgate-slurm-start.log >&2 || true
        export SLURMGATE_SLURM_UNAVAILABLE="scripts/slurm-local/start.sh failed (see /tmp/slurmgate-slurm-start.log)"
    fi
fi
cleanup() { if [ "$started_slurm" = 1 ]; then scripts/slurm-local/stop.sh >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT

echo "== pytest"
python -m pytest -q -p no:cacheprovider "$@"

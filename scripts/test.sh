#!/usr/bin/env bash
# The whole test suite: setup, lint, type-check, then pytest with the bundled Slurm cluster up.
# `--fast` (make test-fast): the same setup and checks, then only the tests that need neither
# Slurm nor a Prefect server (a few minutes). Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then fast=1; shift; fi
SLURMGATE_WITH_ENGINE_PARSERS="${SLURMGATE_WITH_ENGINE_PARSERS:-1}" \
    SLURMGATE_WITH_DYNAMO="${SLURMGATE_WITH_DYNAMO:-1}" \
    SLURMGATE_WITH_MOONCAKE="${SLURMGATE_WITH_MOONCAKE:-1}" \
    SLURMGATE_WITH_BENCH_TOOLS="${SLURMGATE_WITH_BENCH_TOOLS:-1}" \
    SLURMGATE_WITH_VLLM="${SLURMGATE_WITH_VLLM:-1}" scripts/setup.sh
VENV="${SLURMGATE_VENV:-.venv}"
export PATH="$PWD/$VENV/bin:$PATH"
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false

echo "== ruff check"; ruff check .
echo "== ruff format --check"; ruff format --check .
echo "== mypy (core and the Prefect layer)"; scripts/typecheck.sh
echo "== import-linter (the contract between the parts)"; scripts/contracts.sh

if [ "$fast" = 1 ]; then
    echo "== pytest (fast subset: no Slurm, no Prefect server)"
    exec python -m pytest -q -p no:cacheprovider -n 2 -m "not slurm" tests/architecture \
        tests/admission tests/ci tests/github tests/simulator tests/endpoint tests/blocks \
        tests/security tests/runtime/test_records.py \
        tests/runtime/test_spec.py tests/runtime/test_layout.py tests/runtime/test_readiness.py \
        tests/runtime/test_roles.py tests/runtime/test_role_engines.py \
        tests/runtime/test_supervisor.py tests/runtime/test_node_worker.py "$@"
fi

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

# The Slurm tests run one after another in a pytest process of their own (they share the one
# cluster) from the start. Beside them, first the tests that time a wall-clock window, one at a
# time (a single neighbour leaves each a core), then the rest on two xdist workers grouped by
# module (a module's tests share its fixtures, such as one Prefect server). Most tests wait on
# servers and subprocesses, so three processes keep two cores busy. The Slurm pass's own timing
# tests (a controller restart, a fail-fast bound) go first in it, before the two-worker pass.
rc=0
niced=()
pass_() {  # pytest exits 5 when a pass selects nothing (arguments that name one file)
    local r=0
    "${niced[@]}" python -m pytest -q -p no:cacheprovider --durations=12 "$@" || r=$?
    if [ "$r" != 0 ] && [ "$r" != 5 ]; then rc=$r; fi
}
slurm_log="$(mktemp -t slurmgate-slurm-pass.XXXXXX)"
slurm_tmp="$(mktemp -d -t slurmgate-slurm-pass.XXXXXX)"  # its own basetemp beside the others
(
    r=0
    n=0
    # the slow tier (a real vLLM lane: minutes and 3 GB) last, when the other passes are done
    for marks in "slurm and serial" "slurm and not serial and not slow" "slurm and slow"; do
        s=0
        n=$((n + 1))  # a short basetemp: unix sockets under it must stay within 108 bytes
        python -m pytest -q -p no:cacheprovider --durations=12 --basetemp "$slurm_tmp/$n" \
            -m "$marks" "$@" >>"$slurm_log" 2>&1 || s=$?
        if [ "$s" != 0 ] && [ "$s" != 5 ]; then r=$s; fi
    done
    echo "$r" >"$slurm_log.rc"
) &
slurm_pid=$!
echo "== pytest: timing tests, one at a time (beside the Slurm pass; from ${SECONDS} s)"
# Raised priority where allowed (root): these compare wall-clock gaps, and a Slurm step starting
# beside them must not take the core they time on; the Slurm pass mostly waits on processes.
nice -n -5 true 2>/dev/null && niced=(nice -n -5) || niced=()
pass_ -m "serial and not slurm" "$@"
echo "== pytest: the rest on two workers (beside the Slurm pass)"
# Niced: the Slurm pass is the critical path and waits on processes starting; these fill the
# CPU it leaves idle.
nice -n 5 true 2>/dev/null && niced=(nice -n 5) || niced=()
pass_ -m "not slurm and not serial" -n 2 --dist loadscope "$@"
echo "== the passes beside the Slurm pass ended at ${SECONDS} s"
wait "$slurm_pid" || true
echo "== pytest: the Slurm tests, one at a time (ran beside the passes above; ended at ${SECONDS} s)"
cat "$slurm_log"
r="$(cat "$slurm_log.rc" 2>/dev/null || echo 1)"
if [ "$r" != 0 ] && [ "$r" != 5 ]; then rc=$r; fi
rm -rf "$slurm_log" "$slurm_log.rc" "$slurm_tmp"
exit "$rc"

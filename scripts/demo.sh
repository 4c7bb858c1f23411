#!/usr/bin/env bash
# `make demo`: set up, bring up what is missing (local Slurm, a private Prefect home), run the demo
# driver (`slurmgate demo`, flows/demo.py), and leave nothing running. Extra arguments go to it.
set -euo pipefail
# the demo's `total time` is this whole command's, setup and the Slurm start included
SLURMGATE_DEMO_STARTED_AT="$(date +%s.%N)"
export SLURMGATE_DEMO_STARTED_AT
cd "$(dirname "$0")/.."
# shellcheck source=scripts/progress.sh
. scripts/progress.sh
# the demo needs no browser (only the UI test of `make test` does)
SLURMGATE_WITH_BROWSER="${SLURMGATE_WITH_BROWSER:-0}" scripts/setup.sh
VENV="${SLURMGATE_VENV:-.venv}"
export PATH="$PWD/$VENV/bin:$PATH"
# (`slurmgate demo` itself turns Prefect's telemetry off and keeps flow logs off the console)

work="$(mktemp -d -t slurmgate-demo.XXXXXX)"
mkdir -p .slurmgate
started_slurm=0
driver_rc=1

# Kill, by pid, whatever still runs with this demo's PREFECT_HOME (only possible after a crash).
reap_ours() {
    local needle="PREFECT_HOME=$work/prefect" pid
    for env in /proc/[0-9]*/environ; do
        pid="${env#/proc/}"; pid="${pid%/environ}"
        [ "$pid" = "$$" ] && continue
        if { tr '\0' '\n' <"$env"; } 2>/dev/null | grep -qxF "$needle"; then
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
}

cleanup() {
    trap - EXIT INT TERM
    reap_ours
    if [ "$started_slurm" = 1 ]; then
        echo "[demo] stopping the local Slurm cluster it started" >&2
        scripts/slurm-local/stop.sh >/dev/null 2>&1 || true
    fi
    if [ -f "$work/summary.json" ]; then cp "$work/summary.json" .slurmgate/demo-summary.json; fi
    if [ "$driver_rc" != 0 ] && compgen -G "$work/*.log" >/dev/null; then
        mkdir -p .slurmgate/demo-logs && cp "$work"/*.log .slurmgate/demo-logs/
        echo "[demo] failed; the Prefect server and serve logs are in .slurmgate/demo-logs/" >&2
    fi
    rm -rf "$work"
    exit "$driver_rc"
}
trap cleanup EXIT
trap 'driver_rc=130; cleanup' INT
trap 'driver_rc=143; cleanup' TERM

slurm_answers() { [ -n "${SLURM_CONF:-}" ] && timeout 10 sinfo -h >/dev/null 2>&1; }
SLURM_LOCAL_DIR="${SLURM_LOCAL_DIR:-/tmp/slurm-local}"
if ! slurm_answers && [ -f "$SLURM_LOCAL_DIR/env.sh" ]; then
    # shellcheck disable=SC1091
    . "$SLURM_LOCAL_DIR/env.sh"
fi
if ! slurm_answers; then
    if [ "$(id -u)" != 0 ]; then
        echo "[demo] no Slurm answers (sinfo) and only root can start the bundled cluster;" \
            "run as root, or export SLURM_CONF for a cluster of yours" >&2
        exit 1
    fi
    # netns: each of the 4 nodes gets its own network namespace and IP on a private bridge, so
    # model servers on different nodes may use the same ports, as on a real cluster
    start_slurm() { SLURM_LOCAL_MODE=netns scripts/slurm-local/start.sh >"$work/slurm-start.log" 2>&1; }
    if ! with_progress "[demo] starting the bundled local Slurm cluster (4 nodes on this machine, each in its own network namespace)" start_slurm; then
        echo "[demo] the local Slurm cluster did not start; log tail:" >&2
        tail -n 20 "$work/slurm-start.log" >&2
        exit 1
    fi
    started_slurm=1
    # shellcheck disable=SC1091
    . "$SLURM_LOCAL_DIR/env.sh"
fi

# Prefect in local mode: a private home (SQLite) under the demo's temporary directory, set only
# now so the Slurm daemons started above do not carry it (reap_ours finds processes by it).
export PREFECT_HOME="$work/prefect"
unset PREFECT_API_URL

echo "[demo] running the demo (slurmgate demo): admission on a GitHub emulator, then the runtime on Slurm" >&2
set +e
python -m slurmgate.cli demo --workdir "$work" "$@"
driver_rc=$?
set -e
echo "[demo] summary: .slurmgate/demo-summary.json" >&2

#!/usr/bin/env bash
# restart-ctld.sh -- restart the local cluster's slurmctld the way an operator's restart does:
# SIGTERM, wait until it has exited, stay down DOWN_SECONDS, start it again on its saved state
# (jobs, steps and allocations survive), and wait until it answers. Nodes keep running.
# Usage:  ./restart-ctld.sh [DOWN_SECONDS]     (same SLURM_LOCAL_DIR as start.sh; default 0)
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/slurm-local}"
DOWN="${1:-0}"
CONF="$DIR/etc/slurm.conf"
RUN="$DIR/run"
TIMEOUT="${SLURM_LOCAL_TIMEOUT:-60}"
log() { echo "[slurm-local] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pid=$(pid_of "$RUN/slurmctld.pid" "$CONF") || die "no slurmctld of $DIR is running"
kill -TERM "$pid"
end=$(( $(date +%s) + TIMEOUT ))
while [ -d "/proc/$pid" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null; do
    [ "$(date +%s)" -lt "$end" ] || die "slurmctld $pid did not exit within ${TIMEOUT}s"
    sleep 0.1
done
log "slurmctld $pid stopped; down for ${DOWN}s"
sleep "$DOWN"
SLURM_CONF="$CONF" slurmctld -f "$CONF" || die "slurmctld failed to start; see $DIR/log/slurmctld.log"
end=$(( $(date +%s) + TIMEOUT ))
until out=$(SLURM_CONF="$CONF" timeout 10 scontrol ping 2>/dev/null) && [[ "$out" == *UP* ]]; do
    [ "$(date +%s)" -lt "$end" ] || die "slurmctld did not answer within ${TIMEOUT}s after the restart"
    sleep 0.2
done
log "slurmctld answers again"

#!/usr/bin/env bash
# Installs what slurmgate needs on a Debian machine: system packages (when root) and the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SLURMGATE_VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    need=()
    for pkg in python3-venv python3-dev iproute2 procps tmux; do
        dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
    done
    # Debian's chromium for the browser test of the Prefect UI (tests/prefect_server/test_ui.py,
    # driven by Playwright without its browser downloads). SLURMGATE_WITH_BROWSER=0 skips it.
    if [ "${SLURMGATE_WITH_BROWSER:-1}" = 1 ]; then
        for pkg in chromium; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
    fi
    if [ ${#need[@]} -gt 0 ]; then
        echo "[setup] apt-get install ${need[*]}" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    fi
fi

stamp="$VENV/.slurmgate-installed"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "[setup] installing slurmgate and its dependencies into $VENV" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[dev]"
    touch "$stamp"
fi

#!/usr/bin/env bash
# Install what tests/test_ops_prometheus.py runs against: Debian's `prometheus` package, which
# ships both `prometheus` and `promtool`. Idempotent: does nothing when both are on PATH.
#
#   bash scripts/install_ops_deps.sh
#
# Needs root (or sudo) and apt. Exits non-zero, saying why, when it cannot install; the test then
# skips with that reason. Debian's package also registers a service; this script does not start
# it (the test runs its own Prometheus on a free port).
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

if have prometheus && have promtool; then
    echo "install_ops_deps: prometheus and promtool present: $(prometheus --version 2>&1 | head -n1)"
    exit 0
fi

if ! have apt-get; then
    echo "install_ops_deps: apt-get not found; install Prometheus (prometheus + promtool) by hand" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if have sudo && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install_ops_deps: need root (or passwordless sudo) to apt-get install prometheus" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
echo "install_ops_deps: apt-get update"
if ! $SUDO apt-get update -q >/tmp/install_ops_deps.log 2>&1; then
    echo "install_ops_deps: apt-get update failed (see /tmp/install_ops_deps.log):" >&2
    tail -n 20 /tmp/install_ops_deps.log >&2
    exit 1
fi
echo "install_ops_deps: apt-get install prometheus"
# policy-rc.d 101: do not start the packaged service (no init here, or not wanted in CI).
POLICY=/usr/sbin/policy-rc.d
CREATED_POLICY=0
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod +x "$POLICY"
    CREATED_POLICY=1
fi
status=0
$SUDO apt-get install -y -q --no-install-recommends prometheus >>/tmp/install_ops_deps.log 2>&1 \
    || status=$?
if [ "$CREATED_POLICY" -eq 1 ]; then
    $SUDO rm -f "$POLICY"
fi
if [ "$status" -ne 0 ]; then
    echo "install_ops_deps: apt-get install prometheus failed (see /tmp/install_ops_deps.log):" >&2
    tail -n 20 /tmp/install_ops_deps.log >&2
    exit 1
fi

for tool in prometheus promtool; do
    if ! have "$tool"; then
        echo "install_ops_deps: the prometheus package installed no \`$tool\` on PATH" >&2
        exit 1
    fi
done
echo "install_ops_deps: installed $(prometheus --version 2>&1 | head -n1)"

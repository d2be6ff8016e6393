#!/usr/bin/env bash
# `make test-stress`: the tests marked `timing` (they pass only if things happen in time) run N
# times in a row beside two CPU burners, so a test that passes only on a quiet machine shows up.
#
#   bash scripts/stress_tests.sh [N] [pytest args...]     (default N=5; e.g. -k swap, -x)
#
# Prints each round's result and a last line `stress: R rounds, F failed`; exits non-zero if any
# round failed. The burners are this script's children and end with it.
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-5}"
shift || true
PYTEST="${PYTEST:-.venv/bin/pytest}"

burners=()
stop_burners() { for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null; done; }
trap stop_burners EXIT
for _ in 1 2; do
    python3 -c 'while True: pass' &
    burners+=("$!")
done

failed=0
for round in $(seq "$ROUNDS"); do
    if "$PYTEST" -q -p no:cacheprovider -m timing "$@"; then
        echo "stress: round $round passed"
    else
        echo "stress: round $round FAILED"
        failed=$((failed + 1))
    fi
done
echo "stress: $ROUNDS rounds, $failed failed"
[ "$failed" -eq 0 ]

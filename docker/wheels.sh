#!/usr/bin/env bash
# Fill docker/wheels/ (or DIR) with wheels of gpupool, every dependency and the build backend, for
# an air-gapped image build (docker/wheels/README.md). Run it where the index is reachable, with a
# Python of the image's minor version (3.11) on the image's architecture.
#
#   bash docker/wheels.sh [DIR]        # PYTHON=... picks the interpreter (default python3)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/docker/wheels}"
PYTHON="${PYTHON:-python3}"
want="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$want" != "3.11" ]; then
    echo "wheels.sh: $PYTHON is Python $want; the images run 3.11 (set PYTHON)" >&2
    exit 1
fi
mkdir -p "$DIR"
# The images install gpupool itself from its sources; the wheels only need renewing when the
# dependencies change: a stamp of pyproject.toml (and this script) says whether they did.
stamp="$(cat "$ROOT/pyproject.toml" "$0" | sha256sum | cut -c1-16)"
if [ -f "$DIR/.stamp" ] && [ "$(cat "$DIR/.stamp")" = "$stamp" ] && ls "$DIR"/*.whl >/dev/null 2>&1; then
    echo "wheels.sh: $(ls "$DIR"/*.whl | wc -l) wheels in $DIR are current"
    exit 0
fi
rm -f "$DIR"/*.whl "$DIR/.stamp"
# pip resolves markers for the Python running it: redis needs async-timeout below Python 3.11.3
# (Debian bookworm's Python, the base docker/base/build_base.sh builds, is 3.11.2), so name it.
"$PYTHON" -m pip wheel -q --disable-pip-version-check --wheel-dir "$DIR" "$ROOT" \
    'setuptools>=68' wheel 'async-timeout>=4.0.3'

echo "$stamp" >"$DIR/.stamp"
echo "wheels.sh: $(ls "$DIR"/*.whl | wc -l) wheels in $DIR"

#!/usr/bin/env bash
# On the H200 machine: check the carried bundle parts in /tmp/parts, unpack, install into /tmp/site.
# Idempotent: does nothing when /tmp/site already holds vLLM and gpupool.
# Usage: bash scripts/gpu_lane/install.sh            (then: export PYTHONPATH=/tmp/site)
set -euo pipefail
site=${LANE_SITE:-/tmp/site}
parts=${LANE_PARTS:-/tmp/parts}
if [ -d "$site/vllm" ] && [ -d "$site/gpupool" ]; then echo "install: $site ready"; exit 0; fi
t0=$(date +%s)
cd "$parts"
sha256sum -c --quiet SHA256SUMS || { echo "install: bundle checksum failed" >&2; exit 1; }
rm -rf /tmp/wheels && mkdir -p /tmp/wheels
cat bundle.tar.part* | tar -xf - -C /tmp/wheels
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir ${LANE_PIP_EXTRA:-} --target "$site" \
    /tmp/wheels/*.whl > /tmp/pip-install.log 2>&1 || { tail -20 /tmp/pip-install.log >&2; exit 1; }
rm -rf /tmp/wheels
echo "install: $(ls "$site" | wc -l) entries in $site after $(( $(date +%s) - t0 )) s"

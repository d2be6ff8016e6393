#!/usr/bin/env bash
# CPU rehearsal of the check: `gpupool sim` stands in for vLLM (rehearse/vllm), a fake nvidia-smi
# for the GPU (rehearse/bin). Runs every step of a phase with the same configs as on the H200.
#   bash scripts/gpu_lane/rehearse.sh dense|hybrid|init   (results in /tmp/lane-rehearsal; init names
#   the card with --gpu, as the CPU machine has no NVML)
#   bash scripts/gpu_lane/rehearse.sh detached            (the sleep phase through detached.sh,
#   a 40 s mixed load; results in /tmp/lane-rehearsal)
#   bash scripts/gpu_lane/rehearse.sh planner-shapes      (planner_shapes.sh; the stand-in's KV
#   figures are made up, so only the run itself is rehearsed, not the planner's errors)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export PATH=$here/rehearse/bin:$root/.venv/bin:$PATH
export PYTHONPATH=$here/rehearse${PYTHONPATH:+:$PYTHONPATH}
export LANE_REHEARSAL=1 LANE_PYTHON=$root/.venv/bin/python OUT=${OUT:-/tmp/lane-rehearsal}
export LANE_TOKENIZER=${LANE_TOKENIZER:-none} LANE_INIT_GPU=${LANE_INIT_GPU:-NVIDIA H200}
export LANE_BUDGET_S=${LANE_BUDGET_S:-400} FAKE_VLLM_START_S=${FAKE_VLLM_START_S:-3}
export LANE_GRACE_S=${LANE_GRACE_S:-2}
[ "${1:-}" = planner-shapes ] && exec bash "$here/planner_shapes.sh"
if [ "${1:-}" = detached ]; then  # the sleep phases through detached.sh, mixed load shortened
  export LANE_MIXED_S=${LANE_MIXED_S:-40} LANE_DETACHED_DIR=/tmp/lane-rehearsal-detached
  bash "$here/detached.sh" start sleep:400 && exec bash "$here/detached.sh" wait 900
fi
exec bash "$here/check.sh" "${1:-dense}"

#!/usr/bin/env bash
# CPU rehearsal of the check: `gpupool sim` stands in for vLLM (rehearse/vllm), a fake nvidia-smi
# for the GPU (rehearse/bin). Runs every step of a phase with the same configs as on the H200.
#   bash scripts/gpu_lane/rehearse.sh dense|hybrid|init   (results in /tmp/lane-rehearsal; init names
#   the card with --gpu, as the CPU machine has no NVML)
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
exec bash "$here/check.sh" "${1:-dense}"

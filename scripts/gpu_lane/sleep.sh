#!/usr/bin/env bash
# On the H200 machine, from the repository root (issue 28): two 8B-shaped models at
# gpu-memory-utilization 0.85 in one swap group take turns on GPU 0 through vLLM's sleep mode.
#
#   bash scripts/gpu_lane/sleep.sh
#
# The check's `sleep` phase (check.py, lane_sleep.py, configs/sleep-1gpu.yaml): installs the
# bundle if needed, starts gpupool (the workers start one after another, one ends asleep), then
# level-1 switch times (request sent -> first token) against a cold restart of the same worker,
# 50 alternating requests (0 failures, GPU memory sampled against the card), idle sleep and the
# mixed load (level 2: `check.sh sleep-l2`, on real-format weights); result-sleep.json,
# report-sleep.md, log-sleep.txt and the logs to $OUT, within LANE_BUDGET_S (560). Rehearse here: LANE_REHEARSAL=1 ... or `bash scripts/gpu_lane/rehearse.sh sleep`.
set -uo pipefail
exec bash "$(cd "$(dirname "$0")" && pwd)/check.sh" sleep

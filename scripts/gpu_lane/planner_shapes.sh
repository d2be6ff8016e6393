#!/usr/bin/env bash
# On the H200 machine, from the repository root: install the bundle if needed, then the planner
# against vLLM on shapes the other phases do not serve (issue 25): Llama-3.1-8B-like,
# Qwen3-30B-A3B-like (default max-num-seqs and 20), Gemma-3-12B-like (and at 4,096 batched
# tokens), each alone on GPU 0 at 0.90 utilization and 32K. Results in $OUT (three files).
#
#   bash scripts/gpu_lane/planner_shapes.sh          # timeout 600; ends within LANE_BUDGET_S
#
# Environment: OUT, LANE_BUDGET_S (the whole command, install included; default 560),
# LANE_ONLY=case,case. Rehearse here: LANE_REHEARSAL=1 (rehearse.sh planner-shapes does it).
set -uo pipefail
start=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd)
if [ "${LANE_REHEARSAL:-0}" != 1 ]; then
  bash "$here/install.sh" || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fi
export PYTHONUNBUFFERED=1
mkdir -p "${OUT:=/tmp/lane-out}"
exec "${LANE_PYTHON:-python3}" "$here/planner_shapes.py" --out "$OUT" \
    --budget-s "$(( ${LANE_BUDGET_S:-560} - ($(date +%s) - start) ))" \
    --tokenizer "${LANE_TOKENIZER:-$here/tokenizer}" ${LANE_ONLY:+--only "$LANE_ONLY"}

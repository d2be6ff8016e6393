#!/usr/bin/env bash
# On the H200 machine, from the repository root: install the bundle if needed, then run the check.
#
#   bash scripts/gpu_lane/check.sh dense    # the dense model: launch, routing, planner,
#                                           # throughput, TTFT, faults, prefix affinity, stop
#   bash scripts/gpu_lane/check.sh dense-kv # the dense phase with precise prefix routing (KV events)
#   bash scripts/gpu_lane/check.sh hybrid   # the hybrid MoE: planner, seed 000's pitfall
#   bash scripts/gpu_lane/check.sh throughput  # the dense model: steady-state tokens/s only
#   bash scripts/gpu_lane/check.sh init     # `gpupool init` on the GPUs found, check, serve it,
#                                           # one request, init's KV figure against vLLM's
#   bash scripts/gpu_lane/check.sh sleep    # two 8B-shaped models in one swap group (issue 28)
#   bash scripts/gpu_lane/check.sh sleep-hybrid  # the hybrid MoE beside a dense 8B, one group
#   bash scripts/gpu_lane/check.sh sleep-l2      # level 2 on real-format (random) 8B weights
#   bash scripts/gpu_lane/check.sh sleep-5090    # seed 000's 4-bit hybrid + an 8B at a 5090's share
#   bash scripts/gpu_lane/check.sh sleep-kv      # precise routing across a sleep (issue 34)
#
# Environment: OUT (where the report goes; the device tool sets it), LANE_BUDGET_S (seconds for
# the whole command, install included; default 560), LANE_SHAPE / LANE_CONFIG to override the
# phase's model shape and gpupool config (dense: configs/dense-2gpu.yaml when nvidia-smi lists two
# GPUs or more), LANE_ONLY=step,step to run a subset.
set -uo pipefail
start=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd)
phase=${1:-dense}
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
dense_config=$here/configs/dense-1gpu.yaml
[ "$ngpu" -ge 2 ] && dense_config=$here/configs/dense-2gpu.yaml
case $phase in
  dense|throughput|init) shape=${LANE_SHAPE:-$here/shapes/dense-8b-like}; config=${LANE_CONFIG:-$dense_config} ;;
  dense-kv) shape=${LANE_SHAPE:-$here/shapes/dense-8b-like}; config=${LANE_CONFIG:-$here/configs/dense-kv-1gpu.yaml} ;;
  hybrid) shape=${LANE_SHAPE:-$here/shapes/hybrid-moe-35b-a3b-like}; config=${LANE_CONFIG:-$here/configs/hybrid-1gpu.yaml} ;;
  sleep) shape=${LANE_SHAPE:-$here/shapes/dense-8b-like}; config=${LANE_CONFIG:-$here/configs/sleep-1gpu.yaml} ;;
  sleep-hybrid) shape=${LANE_SHAPE:-$here/shapes/dense-8b-like}; config=${LANE_CONFIG:-$here/configs/sleep-hybrid-1gpu.yaml} ;;
  sleep-l2) shape=${LANE_SHAPE:-$here/shapes/dense-8b-like}; config=${LANE_CONFIG:-$here/configs/sleep-l2-1gpu.yaml} ;;
  sleep-kv) shape=${LANE_SHAPE:-$here/shapes/dense-8b-like}; config=${LANE_CONFIG:-$here/configs/sleep-kv-1gpu.yaml} ;;
  sleep-5090) shape=${LANE_SHAPE:-$here/shapes/dense-8b-like}; config=${LANE_CONFIG:-$here/configs/sleep-5090-1gpu.yaml} ;;
  *) echo "usage: check.sh dense|dense-kv|hybrid|throughput|init|sleep|sleep-hybrid|sleep-l2|sleep-5090|sleep-kv" >&2; exit 2 ;;
esac
if [ "${LANE_REHEARSAL:-0}" != 1 ]; then
  bash "$here/install.sh" || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
fi
export PYTHONUNBUFFERED=1
mkdir -p "${OUT:=/tmp/lane-out}"
exec "${LANE_PYTHON:-python3}" "$here/check.py" --phase "$phase" --shape "$shape" --config "$config" \
    --out "$OUT" --budget-s "$(( ${LANE_BUDGET_S:-560} - ($(date +%s) - start) ))" --tokenizer "${LANE_TOKENIZER:-$here/tokenizer}" \
    ${LANE_ONLY:+--only "$LANE_ONLY"}

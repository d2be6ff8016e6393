#!/usr/bin/env bash
# On the H200 machine, from the repository root: issue 15's routing bench (bench/routing/run.py)
# on real GPUs, the same code as `make bench-routing` with an 8B-shaped model and bigger sizes.
#
#   bash scripts/gpu_lane/routing.sh ROUNDS
#
# Installs the bundle if needed (the bundle carries vllm-router and sglang-router), makes the
# model (dense-8b-like's shape, the bench's tokenizer, dummy weights), starts the two workers if
# they are not up (both on GPU 0: a 32K and an 8K window), then runs ROUNDS more rounds of every
# workload through gpupool and the four peer policies (--resume: a later call adds rounds to the
# earlier ones). The workers outlive the command (setsid), as does /tmp/lane-routing, while the
# machine stays warm, so the next call only adds rounds. Results (results.json after every
# router's run, results.md and the plots at the end) and the logs go to $OUT.
#
# Environment: OUT (the device tool sets it), LANE_BUDGET_S (seconds for the whole command,
# default 560), LANE_REHEARSAL=1 (this CPU machine: no install, the bench's own venvs).
set -uo pipefail
start=$(date +%s)
rounds=${1:?usage: routing.sh ROUNDS}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
state=/tmp/lane-routing
mkdir -p "${OUT:=/tmp/lane-out}" "$state/out"
log=$OUT/log-routing.txt
py=python3
if [ "${LANE_REHEARSAL:-0}" != 1 ]; then
  bash "$here/install.sh" >> "$log" 2>&1 || { tail -20 "$log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
  export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  export GPUPOOL_BENCH_PYTHON=python3 GPUPOOL_BENCH_VLLM_PYTHON=python3 GPUPOOL_BENCH_PEERS_PREFIX=/tmp/site
  model=(--model "--hidden 4096 --intermediate 12288 --layers 36 --heads 32 --kv-heads 8 --head-dim 128 --max-positions 40960")
  workers=(--workers "long:32768:0-7:0:0.42,short:8192:8-15:0:0.42" --router-cpus "0-$(( $(nproc) - 1 ))")
  # KV per worker capped at 6,000 blocks of 16 = 96,000 tokens: workload 1's 16 conversations
  # (about 131,000 prompt tokens at their last turn) overflow one worker's cache, not the pool's
  kv=(--kv-blocks 6000 --max-num-seqs 16 --batched-tokens 8192 --vllm-args=--enforce-eager)
else  # a quick pass of the same steps on the CPU machine, tiny model, the default workers
  py=$root/.venv/bin/python
  model=(--model "--hidden 128 --layers 2")
  workers=()
  kv=()
fi
export PYTHONUNBUFFERED=1
common=("${model[@]}" --model-dir "$state/model" "${workers[@]}" "${kv[@]}" --out "$state/out")
say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$log"; }

# The workers: up from an earlier call, or started now (they outlive this command).
up=0
if [ -f "$state/out/workers.json" ]; then
  up=$("$py" - "$state/out/workers.json" <<'EOF'
import json, sys, urllib.request
ok = 0
for w in json.load(open(sys.argv[1])).values():
    try:
        ok += urllib.request.urlopen(f"http://127.0.0.1:{w['port']}/health", timeout=5).status == 200
    except OSError:
        pass
print(int(ok == 2))
EOF
)
fi
if [ "$up" != 1 ]; then
  say "starting the workers"
  rm -f "$state/out/workers.json"
  setsid nohup "$py" "$root/bench/routing/run.py" --serve-workers "${common[@]}" \
      > "$state/serve.log" 2>&1 < /dev/null &
  while [ ! -f "$state/out/workers.json" ]; do
    if ! pgrep -f "run.py --serve-workers" > /dev/null; then
      say "the workers did not start"; tail -40 "$state/serve.log" | tee -a "$log"
      cp "$state"/serve.log "$OUT/" 2>/dev/null; exit 1
    fi
    sleep 2
  done
  grep -E "ready after|KV cache tokens" "$state/serve.log" | tee -a "$log"
fi

left=$(( ${LANE_BUDGET_S:-560} - ($(date +%s) - start) - 20 ))
say "$rounds round(s), $left s left"
sizes=()
if [ "${LANE_REHEARSAL:-0}" != 1 ]; then
  for kv_ in conversations=16 system_tokens=5000 turn_tokens=400 reply_tokens=200 think_s=1.0 \
      stagger_s=0.1 long_tokens=24000 short_tokens=1000 mixed_short_max=6000 mixed_requests=24 \
      flood=96 flood_tokens=1000 flood_max_tokens=64 interactive_tokens=500 hog_tokens=7000; do
    sizes+=(--size "$kv_")
  done
else
  sizes=(--quick)
fi
timeout "$left" "$py" "$root/bench/routing/run.py" "${common[@]}" "${sizes[@]}" --resume \
    --rounds "$rounds" --attach "$state/out/workers.json" \
    --routers gpupool,vllm-router:cache_aware,vllm-router:consistent_hash,vllm-router:round_robin,sglang-router:cache_aware \
    2>&1 | tee -a "$log"
say "rc ${PIPESTATUS[0]}"
cp "$state"/out/results.* "$state"/out/*.png "$OUT/" 2>/dev/null
grep -hE "KV cache|Available KV|Maximum concurrency|model weights took" /tmp/gpupool-bench-routing-*/vllm-*.log 2>/dev/null | head -8 >> "$log"
exit 0

#!/usr/bin/env bash
# Lane phases that need more than one device command (10 minutes): issue 28's sleep phase with
# its 10-minute mixed load. `start` installs the bundle, then runs the phases one after another
# in a new process session (setsid: it outlives the command and runs until the machine goes
# back); `wait` waits for them and copies what they wrote to $OUT. Each call returns within its
# SECONDS, so the next call (within the ~30 s the machine stays warm) picks up where it left.
#
#   bash scripts/gpu_lane/detached.sh start sleep:1180 sleep-hybrid:330   # PHASE:BUDGET_S ...
#   bash scripts/gpu_lane/detached.sh wait 580   # until done or 580 s, then results to $OUT
#   bash scripts/gpu_lane/detached.sh wait 580 planner-shapes   # or until that phase has ended
#
# A phase is one of check.sh's, or `planner-shapes` (planner_shapes.sh; its cases from
# LANE_SHAPES_ONLY=case,case, all when unset), so one warm machine runs them all back to back.
# PHASE:BUDGET_S:STEP,STEP runs only those steps of a check.sh phase (its LANE_ONLY), e.g.
# `dense:300:hardware,launch,kill,stop`.
#
# $OUT gets lane-detached.tgz (every phase's result, report, log and worker logs, and `progress`)
# and each phase's result-*.json and report-*.md beside it. Rehearse with LANE_REHEARSAL=1 (as
# rehearse.sh sets it): `bash scripts/gpu_lane/rehearse.sh detached` does both verbs.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${LANE_DETACHED_DIR:-/tmp/lane-detached}
verb=${1:-}
case $verb in
  start)
    shift
    [ $# -ge 1 ] || { echo "usage: detached.sh start PHASE:BUDGET_S..." >&2; exit 2; }
    if [ "${LANE_REHEARSAL:-0}" != 1 ]; then bash "$here/install.sh" || exit 1; fi
    rm -rf "$dir" && mkdir -p "$dir"
    export LANE_SHARE_CACHE=1  # a later phase's worker of an earlier phase's shape starts warm
    # run from a copy: the device removes a carried folder (a clean `git archive` snapshot,
    # say) before a later command that does not carry it, and the phases would lose their code
    root=$(cd "$here/../.." && pwd)
    mkdir -p "$dir/src" && (cd "$root" && tar -cf - --exclude=./.gpu --exclude=./.git \
        --exclude=./.venv --exclude=./.venv-vllm --exclude=./.models --exclude=./.lane-src .) \
        | tar -xf - -C "$dir/src"
    here=$dir/src/scripts/gpu_lane
    cd "$dir/src" || exit 1
    setsid nohup bash -c '
      here=$1 dir=$2; shift 2
      for spec in "$@"; do
        phase=${spec%%:*} budget=${spec#*:} only=
        case $budget in *:*) only=${budget#*:} budget=${budget%%:*} ;; esac
        echo "$(date -u +%H:%M:%S) phase $phase, budget $budget s" >> "$dir/progress"
        if [ "$phase" = planner-shapes ]; then  # planner_shapes.sh, its cases LANE_SHAPES_ONLY
          OUT=$dir/$phase LANE_BUDGET_S=$budget LANE_ONLY=${LANE_SHAPES_ONLY:-} \
            bash "$here/planner_shapes.sh" >> "$dir/progress" 2>&1
        else
          OUT=$dir/$phase LANE_BUDGET_S=$budget LANE_ONLY=$only bash "$here/check.sh" "$phase" \
            >> "$dir/progress" 2>&1
        fi
        echo "$(date -u +%H:%M:%S) phase $phase ended: $?" >> "$dir/progress"
      done
      touch "$dir/done"' _ "$here" "$dir" "$@" > /dev/null 2>&1 < /dev/null &
    echo "started: $* (in $dir, pid $!)"
    ;;
  wait)
    end=$(( $(date +%s) + ${2:-580} )) upto=${3:-}
    until [ -e "$dir/done" ] || [ "$(date +%s)" -ge "$end" ] \
        || { [ -n "$upto" ] && grep -q "phase $upto ended" "$dir/progress" 2>/dev/null; }; do
      sleep 5
    done
    [ -e "$dir/done" ] && echo "all phases done" || echo "still running"
    tail -n 30 "$dir/progress" 2>/dev/null
    out=${OUT:-/tmp/lane-out}
    mkdir -p "$out"
    tar -czf "$out/lane-detached.tgz" -C "$dir" . 2>/dev/null
    for f in "$dir"/*/result-*.json "$dir"/*/report-*.md; do [ -e "$f" ] && cp "$f" "$out/"; done
    ls -la "$out"
    ;;
  *) echo "usage: detached.sh start PHASE:BUDGET_S[:STEPS]... | wait SECONDS [PHASE]" >&2; exit 2 ;;
esac

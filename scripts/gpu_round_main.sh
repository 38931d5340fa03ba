#!/usr/bin/env bash
# One device call (up to 10 minutes on 1 x H200; each sync took about 32 s on dca62e6) of the main job's
# benchmarks after scripts/gpu_check_grpo.sh:
# the same-GPU syncs (tensor 4.16 GB, LoRA rank 32; the engine's own split with ROLLFLEET_SYNC_TIMING=1)
# and `rollfleet bench grpo-step` colocated on one GPU, 16 x 8 x 32 and 64 x 8 x 512. Records and logs
# under $OUT (7 files: a call brings back 8), each phase's end on stdout; work folders removed after each
# phase (a full disk ended the 2026-12-05 round).
#   OUT=dir ROLLFLEET_GIT_REVISION=<commit> ROLLFLEET_GIT_DIRTY=0 bash scripts/gpu_round_main.sh
set -u
OUT=${OUT:-/tmp/rollfleet-gpu-main}
mkdir -p "$OUT"
. scripts/gpu_site.sh > /dev/null 2>&1
phase() {  # phase NAME SECONDS COMMAND...: output into $OUT/NAME.log, its end on stdout
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? at $SECONDS s"
    grep -v "^engine [0-9]*:\|Warning\|warn(" "$OUT/$name.log" | tail -16 | cut -c1-400
    # the engine's own split of each load (ROLLFLEET_SYNC_TIMING=1), from its log
    grep -h "lora load of\|weight update" /tmp/rf-work/engine-logs/*.log 2>/dev/null | tail -6 | tee -a "$OUT/$name.log"
    rm -rf /tmp/rf-work
}
# the records are named by the card that ran them (an H100 comes when an H200 is asked for)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H100 && echo 1xh100 || echo 1xh200)
sync="python3 -m rollfleet bench weight-sync --size-gb 4.16 --repeats 5 --log-dir /tmp/rf-work/engine-logs"
phase sync-tensor 60 env ROLLFLEET_SYNC_TIMING=1 $sync --transport tensor --bucket-mb 512 --json "$OUT/weight-sync-gpu-tensor-4.16gb-512mb-$card.json"
phase sync-lora 60 env ROLLFLEET_SYNC_TIMING=1 $sync --transport lora --lora-rank 32 --json "$OUT/weight-sync-gpu-lora-r32-$card.json"
step="python3 -m rollfleet bench grpo-step --runs colocated --gpus 1 --out /tmp/rf-work"
phase grpo-step-small 190 $step --steps 5 --json "$OUT/grpo-step-gpu-1x-16x8x32.json"
phase grpo-step-large 270 $step --step large --steps 4 --skip 1 --json "$OUT/grpo-step-gpu-1x-64x8x512.json"

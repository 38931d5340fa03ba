#!/usr/bin/env bash
# One device call (up to 10 minutes on 1 x H200; each sync took about 32 s on dca62e6) of the main job's
# benchmarks after scripts/gpu_check_grpo.sh:
# the same-GPU syncs (tensor 4.16 GB, LoRA rank 32; the engine's own split with ROLLFLEET_SYNC_TIMING=1)
# and `rollfleet bench grpo-step` colocated on one GPU, 16 x 8 x 32 and 64 x 8 x 512, and 16 x 8 x 32 as a
# LoRA run (rank 32 on every linear layer). Records under $OUT, every phase's log in $OUT/round.log (a
# call brings back 8 files), each phase's end on stdout; work folders removed after each phase (a full
# disk ended the 2026-12-05 round). All five phases take about 10 minutes on an H100: name fewer.
# Two more, by name only: `host`, the sender's steps of a push timed alone (scripts/sync_host_steps.py,
# no engine), and `compile`, the large step with train.compile=true (its first step compiles).
# Write the commit's sha into the command from your machine: the device copy's `git rev-parse HEAD`
# gives the session's first commit (two records of 2026-12-06 were corrected by hand for it).
#   OUT=dir ROLLFLEET_GIT_REVISION=<commit> ROLLFLEET_GIT_DIRTY=0 bash scripts/gpu_round_main.sh \
#       [sync] [small] [large] [lora] [host] [compile]          (sync small large when none is named)
set -u
OUT=${OUT:-/tmp/rollfleet-gpu-main}
mkdir -p "$OUT"
. scripts/gpu_site.sh > /dev/null 2>&1
phase() {  # phase NAME SECONDS COMMAND...: output into $OUT/NAME.log, its end on stdout
    local name=$1 limit=$2
    shift 2
    local log=/tmp/rf-$name.log
    timeout "$limit" "$@" > "$log" 2>&1
    echo "== $name: exit $? at $SECONDS s"
    grep -v "^engine [0-9]*:\|Warning\|warn(" "$log" | tail -16 | cut -c1-400
    # the engine's own split of each load (ROLLFLEET_SYNC_TIMING=1), from its log
    grep -h "lora load of\|weight update" /tmp/rf-work/engine-logs/*.log 2>/dev/null | tail -6 | tee -a "$log"
    { echo "===== $name"; cat "$log"; } >> "$OUT/round.log"
    rm -rf /tmp/rf-work
}
runs=${*:-sync small large}
has() { case " $runs " in *" $1 "*) return 0;; esac; return 1; }
# the records are named by the card that ran them (an H100 comes when an H200 is asked for)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H100 && echo 1xh100 || echo 1xh200)
sync="python3 -m rollfleet bench weight-sync --size-gb 4.16 --repeats 5 --log-dir /tmp/rf-work/engine-logs"
if has sync; then
    phase sync-tensor 60 env ROLLFLEET_SYNC_TIMING=1 $sync --transport tensor --bucket-mb 512 --json "$OUT/weight-sync-gpu-tensor-4.16gb-512mb-$card.json"
    phase sync-lora 60 env ROLLFLEET_SYNC_TIMING=1 $sync --transport lora --lora-rank 32 --json "$OUT/weight-sync-gpu-lora-r32-$card.json"
fi
step="python3 -m rollfleet bench grpo-step --runs colocated --gpus 1 --out /tmp/rf-work"
has small && phase grpo-step-small 190 $step --steps 5 --json "$OUT/grpo-step-gpu-1x-16x8x32.json"
has large && phase grpo-step-large 270 $step --step large --steps 4 --skip 1 --json "$OUT/grpo-step-gpu-1x-64x8x512.json"
has compile && phase grpo-step-large-compiled 330 $step --step large --steps 4 --skip 1 --set=train.compile=true \
    --json "$OUT/grpo-step-gpu-1x-64x8x512-compiled.json"
has host && phase sync-host-steps 120 python3 scripts/sync_host_steps.py
# the LoRA run as scripts/gpu_check_grpo.sh runs it (rank 32, alpha 64, every linear layer, A at lr / 16)
linear="[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
has lora && phase grpo-step-lora 190 $step --steps 5 --config examples/cpu-demo-lora.yaml \
    --set=weight_sync.transport=lora --set=weight_sync.path=/tmp/rf-work/adapters --set=weight_sync.max_lora_rank=32 \
    "--set=train.lora.target_modules=$linear" --set=train.lr=1e-6 --json "$OUT/grpo-step-gpu-1x-16x8x32-lora.json"
true

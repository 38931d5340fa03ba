#!/usr/bin/env bash
# GPU check of the main job on one GPU (run it in every session that changes engine/, train/ or
# fleet/): GRPO with examples/gpu-1x.yaml's defaults (colocated, 64 prompts x 8 x 512 tokens; the
# memory plan picks the engine's share and what moves at a turn) on the benches' 2.08B Qwen3 shape
# (vocab 151,936), the same as a LoRA run (rank 32, every linear layer, A orthonormal), and the
# calculator agent's episodes on the GPU, 3 steps each. Each run's output lands in $OUT as it runs (a
# call cut by its limit still returns what finished), its memory plan and metrics appended; printed:
# each run's exit code, memory plan and step lines.
#   bash scripts/gpu_check_grpo.sh [full] [lora] [agent]     (all three when none is named)
# Ray, FastAPI, ... carried as wheels in .gpuw (scripts/gpu_wheels.sh), installed by scripts/gpu_site.sh.
set -u
OUT=${OUT:-/tmp/rollfleet-gpu-check}
mkdir -p "$OUT"
. scripts/gpu_site.sh
export ROLLFLEET_SYNC_TIMING=1  # the engines log each load's phases (a few lines a step)
runs=${*:-full lora agent}
exits=""  # "name code" of each run, printed last
phase() {  # phase NAME SECONDS COMMAND...: output into $OUT/NAME.log, its end on stdout
    local name=$1 limit=$2
    shift 2
    # the third push of the run under torch.profiler (rollfleet/train/sync_profile.py), its tables into the log
    ROLLFLEET_SYNC_PROFILE=/tmp/run-$name/sync-profile timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local code=$?
    exits="$exits $name $code"
    echo "$name: exit $code at $SECONDS s"
    grep -h "memory plan\|^step \|Error\|error:" "$OUT/$name.log" | cut -c1-400 | tail -12
    # what the engines' fast path took (fused kernels, or why not), from their logs (rollout.log_dir)
    grep -h "fused\|CUDA graphs off" logs/engines/*.log 2>/dev/null | sed 's/^.* rollfleet.engine //' | sort | uniq -c
    # the engine's own split of each in-loop load (ROLLFLEET_SYNC_TIMING=1, below), into the run's log
    grep -h "lora load of\|lora merge\|weight update of" logs/engines/*.log 2>/dev/null | cut -c1-300 | tail -8 \
        | tee -a "$OUT/$name.log"
    rm -rf logs/engines
    # what the trainer kept allocated after each give-back against its planned state: more is a leak
    # (2026-12-06: one, then two syncs' 2 GiB buckets stayed allocated; the engine's resume could not map)
    python3 scripts/trainer_kept.py /tmp/run-$name 2>&1 | tee -a "$OUT/$name.log"
    for f in /tmp/run-$name/memory-plan.json /tmp/run-$name/metrics.jsonl /tmp/run-$name/sync-profile/*.txt; do
        # one file a run comes back ($OUT brings back 8 at most)
        test -f "$f" && { echo "=== ${f#/tmp/run-$name/}"; cat "$f"; } >> "$OUT/$name.log"
    done
    # its checkpoints and trainer state (tens of GB): left, they filled the device's disk (2026-12-05)
    rm -rf /tmp/run-$name
}
model=/tmp/rollfleet-2b
common="rollout.model_path=$model grpo.steps=3 ray.num_cpus=16"
case " $runs " in *" full "*|*" lora "*)
    test -f $model/config.json || python3 -c "import torch; from pathlib import Path; from rollfleet.bench.shapes import write_model; write_model(Path('$model'), 2048, 24, torch.bfloat16)";;
esac
case " $runs " in *" full "*)
    phase full 260 python3 -m rollfleet train examples/gpu-1x.yaml $common grpo.output_dir=/tmp/run-full;;
esac
case " $runs " in *" lora "*)
    python3 - <<'PY'  # the same run as a LoRA run: the lora transport takes no buckets
import yaml
cfg = yaml.safe_load(open("examples/gpu-1x.yaml"))
cfg["weight_sync"] = {"transport": "lora"}
linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# A orthonormal (train.lora.a_init, since 73c9bff; peft's default A ran here at every check before it)
cfg["train"]["lora"] = {"rank": 32, "alpha": 64, "a_lr_scale": 0.0625, "a_init": "orthonormal", "target_modules": linear}
yaml.safe_dump(cfg, open("/tmp/gpu-1x-lora.yaml", "w"))
PY
    phase lora 220 python3 -m rollfleet train /tmp/gpu-1x-lora.yaml $common grpo.output_dir=/tmp/run-lora;;
esac
case " $runs " in *" agent "*)
    phase agent 150 python3 -m rollfleet.demo examples/cpu-agent.yaml rollout.use_gpu=true rollout.gpus_per_worker=0.5 \
        grpo.steps=3 grpo.output_dir=/tmp/run-agent rollout.model_path=/tmp/run-agent/tiny-qwen3 ray.num_cpus=16;;
esac
# last, so that a caller's tail of the output keeps it (a device call returns its last 12,000 characters)
echo "exits:$exits"

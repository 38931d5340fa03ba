#!/usr/bin/env bash
# The GRPO step on 2 GPUs (issue: step time): per-phase seconds of the real loop, colocated (trainer
# world 2, two tp=1 engines, tensor sync) and disaggregated (trainer on GPU 0, engine on GPU 1, nccl),
# with a 1.46B Qwen3-shaped bf16 model, each phase beside its ceiling measured in the same run.
#   OUT=/some/dir bash scripts/gpu_bench_grpo_step.sh [extra `rollfleet bench grpo-step` flags]
# Writes $OUT/grpo-step-gpu.json (copy it into docs/results/, then python scripts/make_tables.py).
set -u
out=${OUT:-runs}
mkdir -p "$out"
timeout 590 python3 -m rollfleet bench grpo-step --out /tmp/grpo-step --json "$out/grpo-step-gpu.json" "$@" \
  2>&1 | tee "$out/grpo-step.out" | grep -v "^engine [0-9]*:" | tail -20
for f in /tmp/grpo-step/*.log; do tail -c 4000 "$f" > "$out/$(basename "$f")"; done

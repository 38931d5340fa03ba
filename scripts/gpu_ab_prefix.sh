#!/usr/bin/env bash
# One device call (10 minutes at most): the decode kernel's prefix pass (kv/prefix_groups.py) on and off
# over 1,024-token prompts shared by 8 samples, in one tree: the kernel alone, the whole decode step, and
# a whole GRPO-shaped generate pass. Each phase's output in $OUT as it runs, its table lines on stdout.
#   OUT=dir ROLLFLEET_GIT_REVISION=<commit> ROLLFLEET_GIT_DIRTY=0 bash scripts/gpu_ab_prefix.sh
# Wheels in .gpuw (scripts/gpu_wheels.sh). A fresh machine compiles the Triton kernels at the first
# engine start: the first generate phase's limit allows for it (90 s did not, 2026-12-08).
set -u
OUT=${OUT:-/tmp/rollfleet-gpu-ab-prefix}
mkdir -p "$OUT"
. scripts/gpu_site.sh > /dev/null 2>&1
. scripts/gpu_phase.sh  # phase NAME SECONDS COMMAND...
phase kernel 90 python scripts/bench_prefix_attention.py
for keys in 0 256; do  # 0: every row read whole (the plain kernel); 256: the default
    phase decode-step-keys-$keys 90 python -m rollfleet bench decode-step --batches 64,512 --context 1100 \
        --shared-prompt 1024 --shared-prefix-keys $keys --repeats 20
done
for keys in 0 256; do
    phase generate-keys-$keys 150 python -m rollfleet bench generate --cases 64x8x256 --engines embedded \
        --prompt-tokens 1024 --repeats 2 --logprob-values --engine-flags "--rollfleet-shared-prefix-keys $keys" \
        --json "$OUT/generate-prompt1024-keys-$keys.json"
done

#!/usr/bin/env bash
# One device call of the generation checks and benchmarks on 1 x H200, each phase's output written to
# $OUT as it runs (a call cut by its time limit still returns what finished):
#   bash scripts/gpu_round_generate.sh            (wheels in .gpuw: scripts/gpu_wheels.sh)
# Set ROLLFLEET_GIT_REVISION / ROLLFLEET_GIT_DIRTY=0 for records of a clean commit.
set -u
OUT=${OUT:-/tmp/rollfleet-gpu-round}
mkdir -p "$OUT"
. scripts/gpu_site.sh > "$OUT/install.log" 2>&1
phase() {  # phase NAME SECONDS COMMAND...: its output into $OUT/NAME.log, a line of its end on stdout
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $SECONDS s of the round"
}
phase kernels 150 python -m pytest -q -p no:cacheprovider --noconftest tests/test_kv_decode_kernel.py \
    tests/test_sample_kernel.py tests/test_norm_kernel.py tests/test_qkv_kernel.py
# the host's work of a step on this machine's CPU, the step with transformers' attention inputs, then
# fused (kv/qkv_kernel.py, kv/fused_projections.py): all in one log
phase decode-step 240 bash -c 'python -m rollfleet bench decode-step --host-only --batches 64,512 && \
    python -m rollfleet bench decode-step --batches 64,512 --repeats 10 \
    --attention-inputs transformers && python -m rollfleet bench decode-step --batches 1,64,256,512 --repeats 10 \
    --json "$0/decode-step.json"' "$OUT"
phase paged-check 120 env OUT="$OUT" python scripts/gpu_check_paged.py
# embedded / embedded_waits: what the overlapped decode step gains (kv/overlap.py)
phase generate-embedded 260 python -m rollfleet bench generate --cases 64x8x256,16x8x32,1x1x256 \
    --engines embedded,embedded_waits --repeats 2 --json "$OUT/generate-embedded.json"
phase generate-baseline 300 python -m rollfleet bench generate --cases 64x8x256,16x8x32 --engines embedded,generate \
    --repeats 2 --json "$OUT/generate-64x8x256-16x8x32.json"

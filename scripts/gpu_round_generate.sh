#!/usr/bin/env bash
# One device call (10 minutes at most) of the generation checks and benchmarks on one GPU, each
# phase's output written to $OUT as it runs (a call cut by its limit still returns what finished),
# each phase's end and its table lines on stdout; 8 files back (a call brings back 8 at most):
#   OUT=dir ROLLFLEET_GIT_REVISION=<commit> ROLLFLEET_GIT_DIRTY=0 bash scripts/gpu_round_generate.sh
# Run it alone, not after the GRPO checks in the same call (passes run right after them on 2026-12-05
# could not be compared with a clean run's). Wheels in .gpuw (scripts/gpu_wheels.sh).
set -u
OUT=${OUT:-/tmp/rollfleet-gpu-round}
mkdir -p "$OUT"
. scripts/gpu_site.sh > /dev/null 2>&1
. scripts/gpu_phase.sh  # phase NAME SECONDS COMMAND...
phase kernels 90 python -m pytest -q -p no:cacheprovider --noconftest tests/test_kv_decode_kernel.py \
    tests/test_sample_kernel.py tests/test_norm_kernel.py tests/test_qkv_kernel.py
# decode attention alone with shared prompts: the kernel's prefix pass against reading every row whole
phase prefix-attention 90 python scripts/bench_prefix_attention.py
# the step from its graph at each batch, and the largest batch's replays under torch.profiler
phase decode-step 120 python -m rollfleet bench decode-step --batches 1,64,256,512 --repeats 10 --profile "$OUT"
rm -f "$OUT/decode-trace.json"  # tens of MB: the profile's summary (decode-profile.txt) comes back
phase paged-check 90 env -u OUT python scripts/gpu_check_paged.py  # its JSON lines in its log
# GRPO-shaped requests against transformers' generate warm (the 4 x target), then the long outputs
# (on an H100 at 0567b87: the first 220 s with transformers' slow first passes, the second 130 s)
# (--logprob-values: the logprobs as one list a sample, as the main job's fleet asks for them since 2b7748a)
phase generate 240 python -m rollfleet bench generate --cases 64x8x256,16x8x32,1x1x256 --engines embedded,generate \
    --repeats 2 --timeout-s 120 --logprob-values --json "$OUT/generate.json"  # a worker stuck past 120 s: its log printed, the next case goes on
phase generate-long $((590 - SECONDS)) python -m rollfleet bench generate --cases 32x8x2048 --engines embedded \
    --repeats 1 --json "$OUT/generate-32x8x2048.json"

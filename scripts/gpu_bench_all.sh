#!/usr/bin/env bash
# Every GPU benchmark behind docs/benchmarks.md, on a 2-GPU machine, records written to $OUT:
#   OUT=/some/dir bash scripts/gpu_bench_all.sh [sync|recovery|generate|all]     (default all)
# Weight sync: nccl on the 8B-class (--size-gb 16 -> 19.5 GB) and 5 GB (--size-gb 4.2) models and
# tensor on the 8B-class one, 2048 MB buckets (override with SYNC_RUNS="nccl 16 2048;tensor 16 2048").
# Recovery: two embedded engines, one per GPU, REPEATS rounds (default 3).
# Generate: one GPU, the embedded engine beside transformers generate / generate_batch (5-8 minutes).
# Each part fits in one 10-minute call; run them as separate calls if needed.
# The record names the code by `git rev-parse HEAD`; a copy without .git must be given
# ROLLFLEET_GIT_REVISION=<commit> ROLLFLEET_GIT_DIRTY=0|1 in the environment.
# Then: copy $OUT/*.json into docs/results/, run `python scripts/make_tables.py`, commit both.
set -u
out=${OUT:-runs}
mkdir -p "$out/logs"
what=${1:-all}
here=$(cd "$(dirname "$0")" && pwd)
status=0
if [ "$what" = all ] || [ "$what" = sync ]; then
  IFS=';' read -r -a runs <<< "${SYNC_RUNS:-nccl 16 2048;nccl 4.2 2048;tensor 16 2048}"
  OUT="$out" bash "$here/gpu_bench_sync.sh" "${runs[@]}" || status=1
fi
if [ "$what" = all ] || [ "$what" = recovery ]; then
  echo "=== recovery-gpu"
  timeout 500 python3 -m rollfleet bench recovery --repeats "${REPEATS:-3}" --json "$out/recovery-gpu.json" \
    > "$out/logs/recovery-gpu.out" 2>&1 || { echo "=== recovery-gpu failed"; status=1; }
  grep -v "^engine [0-9]*:" "$out/logs/recovery-gpu.out" | tail -8
fi
if [ "$what" = all ] || [ "$what" = generate ]; then
  echo "=== generate-gpu-1x"
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 590 python3 -m rollfleet bench generate \
    --json "$out/generate-gpu-1x.json" > "$out/logs/generate-gpu-1x.out" 2>&1 || { echo "=== generate failed"; status=1; }
  tail -16 "$out/logs/generate-gpu-1x.out"
fi
exit $status

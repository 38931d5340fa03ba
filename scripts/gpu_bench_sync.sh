#!/usr/bin/env bash
# Weight-sync benchmark runs on a 2-GPU machine (docs/benchmarks.md). Usage:
#   scripts/gpu_bench_sync.sh "nccl 16 2048" "nccl 4.2 2048" "tensor 16 2048" ...
# (transport, --size-gb, --bucket-mb per run). Figures and engine logs go under $OUT (or ./runs).
set -u
out=${OUT:-runs}
mkdir -p "$out/logs"
for run in "$@"; do
  set -- $run
  name="$1-$2gb-$3mb"
  echo "=== $name"
  ROLLFLEET_SYNC_TIMING=1 timeout 400 python3 -m rollfleet bench weight-sync --transport "$1" --size-gb "$2" \
    --bucket-mb "$3" --repeat 3 --json "$out/$name.json" --log-dir "$out/logs/$name" 2>&1 | grep -v "^\[bench" | tail -14
  tail -5 "$out/logs/$name/engine-$1.log" 2>/dev/null
done

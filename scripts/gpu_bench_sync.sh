#!/usr/bin/env bash
# Weight-sync benchmark runs on a 2-GPU machine (docs/benchmarks.md). Usage:
#   scripts/gpu_bench_sync.sh "nccl 16 2048" "nccl 4.2 2048" "tensor 16 2048" ...
# (transport, --size-gb, --bucket-mb per run). Each run writes its record to
# $OUT/weight-sync-gpu-T-Xgb-Bmb.json (or ./runs) and its engine log under $OUT/logs; drop the
# records into docs/results/ and run scripts/make_tables.py. REPEATS (default 5) timed passes each.
set -u
out=${OUT:-runs}
repeats=${REPEATS:-5}
mkdir -p "$out/logs"
status=0
for run in "$@"; do
  set -- $run
  name="weight-sync-gpu-$1-$2gb-$3mb"
  echo "=== $name"
  ROLLFLEET_SYNC_TIMING=1 timeout 500 python3 -m rollfleet bench weight-sync --transport "$1" --size-gb "$2" \
    --bucket-mb "$3" --repeats "$repeats" --json "$out/$name.json" --log-dir "$out/logs/$name" \
    > "$out/logs/$name.out" 2>&1
  rc=$?
  grep -v -e "^\[bench" -e "^$" "$out/logs/$name.out" | tail -14
  [ $rc -eq 0 ] || { echo "=== $name failed (rc $rc)"; tail -5 "$out/logs/$name/engine-$1.log" 2>/dev/null; status=1; }
done
exit $status

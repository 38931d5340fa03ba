#!/usr/bin/env bash
# The same-GPU syncs of two revisions on ONE machine, alternated (H100 hosts differ by up to 1.7x in a
# push's host time, so figures from two calls do not compare). The base revision's package is a
# folder (ignored by git) made here before the call and carried by it (`carry: [".gpuw", "abase"]`):
#   rm -rf abase && mkdir abase && git archive <base revision> rollfleet | tar -x -C abase
# then, on the device (with the revision of the working tree named, since the device copy's git
# reports the session's first commit):
#   OUT=dir ROLLFLEET_GIT_REVISION=<sha> ROLLFLEET_GIT_DIRTY=0 bash scripts/gpu_ab_sync.sh [tensor] [lora]
# SIZE_GB (default 4.16) sets the model's size (a CPU try of the script: SIZE_GB=0.05); REPEATS (default 5)
# the timed syncs of each run.
# Each bench runs from its revision's folder (`python -m` puts the working directory first on the
# path; the engine it starts inherits it). Prints each run's per-phase split; logs in $OUT/ab-*.log.
# About 35 s a run: tensor and lora, each revision twice, take about 5 minutes.
set -u
OUT=${OUT:-/tmp/rollfleet-gpu-ab}
mkdir -p "$OUT"
. scripts/gpu_site.sh > /dev/null 2>&1
here=$PWD
[ -d abase/rollfleet ] || { echo "no abase/rollfleet: make it before the call (see the top of this file)"; exit 2; }
run() {  # run LABEL DIR TRANSPORT FLAGS...
    local label=$1 dir=$2 transport=$3
    shift 3
    (cd "$dir" && ROLLFLEET_SYNC_TIMING=1 timeout 90 python3 -m rollfleet bench weight-sync --size-gb "${SIZE_GB:-4.16}" \
        --repeats "${REPEATS:-5}" --log-dir "/tmp/ab-$label" --transport "$transport" "$@" > "$OUT/ab-$label.log" 2>&1)
    echo "== $label: exit $? at $SECONDS s"
    grep -h "weight update of\|lora load of" /tmp/ab-$label/*.log 2>/dev/null | tail -2 | cut -c1-200 | tee -a "$OUT/ab-$label.log"
    grep -A16 "per phase" "$OUT/ab-$label.log" | grep -v "^\s*$" | cut -c1-120
}
for transport in ${*:-tensor lora}; do
    flags=(--bucket-mb 512)
    [ "$transport" = lora ] && flags=(--lora-rank 32)
    for round in 1 2; do
        run "$transport-new-$round" "$here" "$transport" "${flags[@]}"
        run "$transport-base-$round" "$here/abase" "$transport" "${flags[@]}"
    done
done

# Sourced by the GPU round scripts (`. scripts/gpu_phase.sh`, after OUT is set): `phase NAME SECONDS
# COMMAND...` runs a phase with a time limit, its output into $OUT/NAME.log, and prints its end: the
# exit code, its table and test lines, and any process it left on the GPU.
phase() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $SECONDS s of the round"
    grep -h "^|\|^{\|passed\|failed\|stopped; the end" "$OUT/$name.log" | grep -v "^|---" | cut -c1-300 | tail -20
    # a process a phase left on the GPU takes memory and time from the next ones (2026-12-06: a generate
    # phase ran out of time after 64x8x256; nothing said what held the GPU)
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | sed 's/^/   left on the GPU: /'
}

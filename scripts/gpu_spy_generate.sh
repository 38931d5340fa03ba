#!/usr/bin/env bash
# Where the embedded engine's host time goes on a GPU machine: `rollfleet bench generate` under py-spy
# (every thread of the bench and its engine), summed up small enough to bring back (scripts/pyspy_summary.py).
# The device waits of 1291a62 put the host's work a 512-row decode step at about 4 ms on an H100's host
# (docs/benchmarks.md, "The wave's end with nothing to hash"): this says which functions it is.
#   bash scripts/gpu_wheels.sh --spy       (here, once: .gpuw-spy, the wheels without Ray, plus py-spy)
#   bash scripts/gpu_spy_generate.sh [CASES] [REPEATS]    (on the device, carrying .gpuw-spy; 64x8x256 4)
# Output in $OUT: gen-spy.json and .log (the bench's record and output), spy-all.txt (each process's and
# thread's top functions), spy-marked.txt (the stacks under the engine's step, sampler, graph inputs,
# records, retire and answers alone).
set -u
OUT=${OUT:-/tmp/rollfleet-gpu-spy}
mkdir -p "$OUT"
if [ ! -x /tmp/site/bin/py-spy ]; then
    pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpuw-spy/*.whl 2>&1 | grep -v WARNING
fi
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
timeout 300 /tmp/site/bin/py-spy record -r 1000 --threads --subprocesses --nonblocking -f raw -o /tmp/spy-raw.txt -- \
    python3 -m rollfleet bench generate --cases "${1:-64x8x256}" --engines embedded --repeats "${2:-4}" \
    --logprob-values --json "$OUT/gen-spy.json" > "$OUT/gen-spy.log" 2>&1
echo "py-spy: exit $? at $SECONDS s"
python3 scripts/pyspy_summary.py /tmp/spy-raw.txt > "$OUT/spy-all.txt" 2>&1
for marker in _advance_batch _launch_next Sampler.launch _fill _record _retire_finished _answer; do
    echo "=== $marker"
    python3 scripts/pyspy_summary.py /tmp/spy-raw.txt "$marker" 2>&1 | head -60
done > "$OUT/spy-marked.txt"
grep -h "steps |" "$OUT/gen-spy.log" | cut -c1-600

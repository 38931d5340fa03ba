#!/usr/bin/env bash
# The wheels a bare GPU machine (Python 3.12, torch and transformers of its own, no Ray) needs to run
# rollfleet, in one folder small enough to travel with the checkout in one call (64 MiB with the tree):
#   bash scripts/gpu_wheels.sh [DIR]          (default .gpuw; add it to .git/info/exclude)
#   bash scripts/gpu_wheels.sh --spy [DIR]    (default .gpuw-spy: the same wheels without Ray, plus
#                                              py-spy, for scripts/gpu_spy_generate.sh: Ray's beside
#                                              py-spy's would not fit a call with the tree)
# Ray's wheel (79 MB) is cut down to what rollfleet uses (ray core: no Java jar, no dashboard web
# build, no rllib/data/serve/train/tune/llm; its three binaries stripped of symbols): ray-lite.zip,
# 35 MB. Versions are requirements.txt's. On the GPU machine, in the checkout, `. scripts/gpu_site.sh`
# installs them (once per machine) and sets PYTHONPATH; the GPU scripts source it themselves.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = "--spy" ]; then
    spy=$(mkdir -p "${2:-.gpuw-spy}" && cd "${2:-.gpuw-spy}" && pwd)
    test -d "$here/.gpuw" || bash "$0" "$here/.gpuw"
    cp "$here"/.gpuw/*.whl "$spy"/
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
        -d "$spy" py-spy==0.4.3
    du -sh "$spy"
    exit 0
fi
dir=$(mkdir -p "${1:-.gpuw}" && cd "${1:-.gpuw}" && pwd)
names="ray transformers peft fastapi starlette uvicorn pydantic pydantic_core annotated-types annotated-doc
typing-extensions typing-inspection opentelemetry-api jsonschema jsonschema-specifications referencing rpds-py
aiohttp aiohappyeyeballs aiosignal attrs frozenlist idna multidict propcache yarl orjson"
pins=()
for name in $names; do
    pin=$(grep -i "^${name//[-_]/[-_]}==" "$here/requirements.txt") || { echo "$name: not in requirements.txt" >&2; exit 1; }
    pins+=("$pin")
done
pins+=("torch_memory_saver==0.0.10")  # GPU only: never in the CPU requirements
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d "$dir" "${pins[@]}"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
(cd "$scratch" && python3 -m zipfile -e "$dir"/ray-*.whl .)
rm -rf "$scratch"/ray/{jars,dashboard/client/build,rllib,data,serve,train,tune,llm}
strip --strip-all "$scratch"/ray/core/src/ray/gcs/gcs_server "$scratch"/ray/core/src/ray/raylet/raylet
strip --strip-unneeded "$scratch"/ray/_raylet.so
rm -f "$dir"/ray-*.whl "$dir/ray-lite.zip"
(cd "$scratch" && zip -qr -9 "$dir/ray-lite.zip" ray ray-*.dist-info)
du -sh "$dir"

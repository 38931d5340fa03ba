# Sourced by the GPU scripts (`. scripts/gpu_site.sh`): installs the wheels scripts/gpu_wheels.sh put in
# .gpuw into /tmp/site, once per machine, and puts /tmp/site and the checkout on PYTHONPATH.
if [ -d .gpuw ] && [ ! -x /tmp/site/ray/core/src/ray/raylet/raylet ]; then
    pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpuw/*.whl
    python3 -c "import zipfile; zipfile.ZipFile('.gpuw/ray-lite.zip').extractall('/tmp/site')"
    chmod +x /tmp/site/ray/core/src/ray/gcs/gcs_server /tmp/site/ray/core/src/ray/raylet/raylet
fi
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1

#!/usr/bin/env bash
# Every benchmark once on an accelerator host, as one prepared command; results under $OUT.
#
#   python scripts/device_model.py pack .carry/minilm        # here: an offline GPU host cannot download the model
#   OUT=results/gpu bash scripts/bench_gpu.sh .carry/minilm   # there (no argument: the installed bundled model)
#
# Needs jax with its GPU plugin, flax, transformers, aiohttp (and torch with
# sentence-transformers for the peers column) importable by $PYTHON; jaxserve
# itself is used from this checkout. Stages run most telling first and each
# writes its files as it ends, so a run cut off by a time limit still leaves
# what it finished. Sizes: N, LOAD_RATES, LOAD_SECONDS, LAYOUT_REQUESTS, HOST_SECONDS.
# Files (8 in all): log.txt, table.json, host.json, peers.json, latency.json,
# load.json, layouts/layouts.{csv,json}.
set -uo pipefail
OUT=${OUT:-results/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAXSERVE_CACHE_DIR=${JAXSERVE_CACHE_DIR:-/tmp/jaxserve-xla}
# Each benchmark shares the GPU with the servers it starts: none may take JAX's default 75% of it.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.4}
if [ $# -ge 1 ]; then
    "$PY" scripts/device_model.py unpack "$1" /tmp/jaxserve-model || exit 1
    export JAXSERVE_MODEL=/tmp/jaxserve-model
fi

stage() {
    echo "## $*   ($(date -u +%H:%M:%S))"
    "$@" || echo "## failed with status $?"
}

{
    stage "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
    stage "$PY" -m jaxserve.cli warmup --write "$OUT/table.json"
    stage "$PY" scripts/bench_host.py --engine real --table "$OUT/table.json" --seconds "${HOST_SECONDS:-6}" \
        --concurrency 1,4,16,64 --out "$OUT/host.json"
    stage "$PY" scripts/bench_peers.py --n "${N:-384}" --rounds 2 --buckets "$OUT/table.json" --out "$OUT/peers.json"
    stage "$PY" scripts/bench_latency.py --buckets "$OUT/table.json" --out "$OUT/latency.json"
    stage "$PY" scripts/bench_load.py --buckets "$OUT/table.json" --rates "${LOAD_RATES:-50,200}" \
        --seconds "${LOAD_SECONDS:-10}" --out "$OUT/load.json"
    stage "$PY" scripts/bench_layouts.py --requests "${LAYOUT_REQUESTS:-20}" --no-plot --out "$OUT/layouts"
    echo "## done   ($(date -u +%H:%M:%S))"
} 2>&1 | tee "$OUT/log.txt"

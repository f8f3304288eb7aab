#!/usr/bin/env bash
# The GPU benchmark as one prepared run: preflight, then each stage writing its file as it ends.
#
# Here, once (needs the registry; .carry is git-ignored):
#   bash scripts/bench_gpu.sh --pack .carry      # wheels the GPU image lacks (orjson, pybase64) + MiniLM in float16
# There (device `run`, carry [".carry"]), one command per call, each within --budget-s (540 s):
#   bash scripts/bench_gpu.sh --carry .carry --out $OUT --stages minilm
#   bash scripts/bench_gpu.sh --carry .carry --out $OUT --stages workers     # --workers sweep (bench_host.py)
#   bash scripts/bench_gpu.sh --carry .carry --out $OUT --stages attention
#   bash scripts/bench_gpu.sh --carry .carry --out $OUT --stages qwen3-0.6b
#   bash scripts/bench_gpu.sh --carry .carry --out $OUT --stages bge-base,embeddinggemma
# Here, with no GPU (CI runs it: tests/test_bench_gpu.py):
#   bash scripts/bench_gpu.sh --dry-run --out /tmp/gpu-dry
#
# Files under $OUT (or --out): log.txt, preflight.json, attention.json, MODEL.json per model stage
# (scripts/bench_gpu.py says what each holds). The preflight stops the run in seconds, exit 2,
# naming what is missing, unless every import works and jax.devices() is a GPU (JAX_PLATFORMS=cuda).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-results/gpu}
CARRY=""
DRY=""
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --pack) PACK=$2; shift 2;;
        --carry) CARRY=$2; shift 2;;
        --out) OUTDIR=$2; shift 2;;
        --dry-run) DRY=1; ARGS+=("$1"); shift;;
        *) ARGS+=("$1"); shift;;
    esac
done

if [ -n "${PACK:-}" ]; then
    # Here, not on the GPU: packing reads the bundled MiniLM with safetensors and jaxserve, which make's .venv
    # has (a system python3 may not), so that is the interpreter unless PYTHON names one.
    [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
    # The GPU image's python is 3.12 on x86-64 with no registry: fetch its wheels here (PACK_WHEELS= for none).
    mkdir -p "$PACK/wheels"
    WHEELS=${PACK_WHEELS-orjson pybase64 uvloop}
    if [ -n "$WHEELS" ]; then
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$PACK/wheels" $WHEELS || exit 1
    fi
    "$PY" scripts/device_model.py pack "$PACK/minilm" || exit 1
    du -sh "$PACK"
    exit 0
fi

mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -n "$DRY" ]; then
    export JAX_PLATFORMS=cpu
else
    export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
fi
if [ -n "$CARRY" ]; then
    if ls "$CARRY"/wheels/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/jaxserve-site "$CARRY"/wheels/*.whl || exit 2
        export PYTHONPATH=$PYTHONPATH:/tmp/jaxserve-site
    fi
    if [ -d "$CARRY/minilm" ]; then
        "$PY" scripts/device_model.py unpack "$CARRY/minilm" /tmp/jaxserve-minilm >/dev/null || exit 2
        ARGS+=(--minilm /tmp/jaxserve-minilm)
    fi
fi
"$PY" scripts/bench_gpu.py --out "$OUTDIR" "${ARGS[@]}" 2>&1 | tee -a "$OUTDIR/log.txt"

#!/bin/bash
# One jaxserve front-end per Python interpreter, each on its own port against the engine of one running
# `jaxserve serve --simulate-device 400 --workers 2` (lean_frontend.py with LEAN=jaxserve: the front-end
# `--workers N` starts, in a process of its own), loaded in turn by sliced_load.py (bench_host's client, 64
# connections, one-document requests, 8 slices of 2 s each against the floors either side), the order rotated
# each round. Each venv needs the front-end's packages (it never imports JAX): aiohttp, orjson, numpy, tokenizers,
# uvloop, prometheus_client, psutil, msgpack, transformers, huggingface_hub, safetensors, ml_dtypes. Only the
# front-end's CPU is counted: the engine is the same process for all of them.
#     jaxserve serve --simulate-device 400 --workers 2 --port 18203 &
#     results/issue37/interpreters.sh ROUNDS URL PYTHON...
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
source "$HERE/wait_up.sh"
rounds=$1 url=$2; shift 2
pys=("$@") pids=()
for i in "${!pys[@]}"; do
  LEAN=jaxserve PYTHONPATH=$(pwd) "${pys[$i]}" "$HERE/lean_frontend.py" "$url" $((18310 + i)) 0 > /tmp/interp-fe-$i.log 2>&1 &
  pids+=($!)
done
for i in "${!pys[@]}"; do
  wait_up $((18310 + i)) 480
  echo "front-end $i: ${pys[$i]} ($("${pys[$i]}" -c 'import sys, numpy; print(sys.version.split()[0], "numpy", numpy.__version__)'))"
done
n=${#pys[@]}
for round in $(seq 1 "$rounds"); do
  for k in $(seq 0 $((n - 1))); do
    i=$(( (k + round) % n ))
    echo "== round $round: front-end $i"
    .venv/bin/python "$HERE/sliced_load.py" http://127.0.0.1:$((18310 + i)) 1 8 2 64 "${pids[$i]}" | head -1
  done
done
kill "${pids[@]}"; wait 2>/dev/null

#!/bin/bash
# The whole server (`jaxserve serve --simulate-device 400 --workers 1` and `--workers 2`) from two venvs, i.e. on
# two Python interpreters, measured by sliced_load.py (64 connections, one-document requests, 8 slices of 2 s each
# against the floors either side), the order rotated each round. The floor runs in .venv's Python for all.
#     results/issue37/python_versions.sh ROUNDS VENV_A VENV_B
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
source "$HERE/wait_up.sh"
rounds=$1; shift
configs=()
for v in "$@"; do for w in 1 2; do configs+=("$v $w"); done; done
n=${#configs[@]}
for round in $(seq 1 "$rounds"); do
  for k in $(seq 0 $((n - 1))); do
    set -- ${configs[$(( (k + round) % n ))]}
    echo "== round $round: $1 ($("$1/bin/python" -c 'import sys; print(sys.version.split()[0])')), --workers $2"
    "$1/bin/jaxserve" serve --simulate-device 400 --workers "$2" --port 18220 > /tmp/pyver-server.log 2>&1 &
    P=$!
    wait_up 18220; sleep 1
    .venv/bin/python "$HERE/sliced_load.py" http://127.0.0.1:18220 1 8 2 64 | head -1
    kill -TERM $P; wait $P
  done
done

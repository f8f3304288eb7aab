#!/bin/bash
# Two jaxserve trees side by side: `jaxserve serve --simulate-device 400 --workers 2` from each (PYTHONPATH), loaded
# by sliced_load.py (slices against the floors either side of them), the order alternating each round.
#     mkdir /tmp/before && git archive REV | tar -x -C /tmp/before
#     results/issue37/ab_trees.sh /tmp/before "$PWD" [ROUNDS]      # DOCS, SLICES, CONC as sliced_load.py's (1 8 64)
# PRE_A, PRE_B: a command each side's server runs under, e.g. one tree under two scheduler policies:
#     PRE_B="chrt -b 0" results/issue37/ab_trees.sh "$PWD" "$PWD" 3
# LOAD=engine: the engine alone instead, fed by engine_alone.py on a core of its own (PIN=1; DOCS, INFLIGHT,
# SECONDS_EACH: 100 4 8), its CPU per job the figure to compare
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
source "$HERE/wait_up.sh"
run() {
  local tree=$1 port=$2 pre=$3
  echo "== round $round: $tree${pre:+ under $pre}"
  (cd "$tree" && PYTHONPATH=$tree $pre "$ROOT/.venv/bin/python" -m jaxserve.cli serve --simulate-device 400 \
      --workers 2 --port "$port" > "/tmp/ab_trees-$port.log" 2>&1) &
  local P=$!
  wait_up "$port"; sleep 1
  if [ "${LOAD:-sliced}" = engine ]; then
    PIN=1 "$ROOT/.venv/bin/python" "$HERE/engine_alone.py" "http://127.0.0.1:$port" "${DOCS:-100}" "${INFLIGHT:-4}" \
        "${SECONDS_EACH:-8}" 1
  else
    "$ROOT/.venv/bin/python" "$HERE/sliced_load.py" "http://127.0.0.1:$port" "${DOCS:-1}" "${SLICES:-8}" 2 "${CONC:-64}"
  fi
  grep -h "batch sizes planned" "/tmp/ab_trees-$port.log" | sed 's/.*planned/  planned/'
  pkill -TERM -f -- "--port $port"; wait $P
}
for round in $(seq 1 "${3:-4}"); do
  if [ $((round % 2)) = 1 ]; then run "$1" 18401 "${PRE_A:-}"; run "$2" 18402 "${PRE_B:-}"
  else run "$2" 18402 "${PRE_B:-}"; run "$1" 18401 "${PRE_A:-}"; fi
done

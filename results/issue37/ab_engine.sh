#!/bin/bash
# Two jaxserve trees side by side, the engine alone: `jaxserve serve --simulate-device 400 --workers 2` from each
# (PYTHONPATH), fed by engine_alone.py (jobs over the real link, the engine pinned to a core of its own), the order
# alternating each round.
#     mkdir /tmp/before && git archive REV | tar -x -C /tmp/before
#     results/issue37/ab_engine.sh /tmp/before "$PWD" [ROUNDS]     # DOCS, INFLIGHT, SECONDS (100 4 8)
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
source "$HERE/wait_up.sh"
run() {
  local tree=$1 port=$2
  echo "== round $round: $tree"
  (cd "$tree" && PYTHONPATH=$tree "$ROOT/.venv/bin/python" -m jaxserve.cli serve --simulate-device 400 \
      --workers 2 --port "$port" > "/tmp/ab_engine-$port.log" 2>&1) &
  local P=$!
  wait_up "$port"; sleep 1
  PIN=1 "$ROOT/.venv/bin/python" "$HERE/engine_alone.py" "http://127.0.0.1:$port" "${DOCS:-100}" "${INFLIGHT:-4}" \
      "${SECONDS_EACH:-8}" 1
  pkill -TERM -f -- "--port $port"; wait $P
}
for round in $(seq 1 "${3:-4}"); do
  if [ $((round % 2)) = 1 ]; then run "$1" 18411; run "$2" 18412
  else run "$2" 18412; run "$1" 18411; fi
done

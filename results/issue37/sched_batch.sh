#!/bin/bash
# One tree's `jaxserve serve --simulate-device 400 --workers 2` under Linux's default policy (SCHED_OTHER) and under
# SCHED_BATCH (`chrt -b 0`: a woken task does not preempt the running one; the children inherit the policy), loaded
# by sliced_load.py, the order alternating each round.
#     results/issue37/sched_batch.sh [ROUNDS]      # DOCS, SLICES, CONC as sliced_load.py's (1 8 64)
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
source "$HERE/wait_up.sh"
run() {
  local how=$1 port=$2
  echo "== round $round: $how"
  local pre=""; [ "$how" = batch ] && pre="chrt -b 0"
  (cd "$ROOT" && $pre .venv/bin/python -m jaxserve.cli serve --simulate-device 400 --workers 2 --port "$port" \
      > "/tmp/sched_batch-$port.log" 2>&1) &
  local P=$!
  wait_up "$port"; sleep 1
  for p in $(pgrep -f -- "--port $port"); do chrt -p "$p" | head -1; done | sort | uniq -c | sed 's/^/  /'
  "$ROOT/.venv/bin/python" "$HERE/sliced_load.py" "http://127.0.0.1:$port" "${DOCS:-1}" "${SLICES:-8}" 2 "${CONC:-64}"
  pkill -TERM -f -- "--port $port"; wait $P
}
for round in $(seq 1 "${1:-3}"); do
  if [ $((round % 2)) = 1 ]; then run other 18701; run batch 18702; else run batch 18702; run other 18701; fi
done

#!/bin/bash
# The tree issue 37 was filed against (25e1f16: one process, bench_host's private server mode) against this
# tree's `jaxserve serve --simulate-device 400 --workers 1` and `--workers 2`, each loaded by bench_host's own
# client (split_load.py), one-document requests unless DOCS is set. The order rotates each round (a server's
# place in a round moved its rate by about a tenth on this VM), so each configuration runs first, second and third.
# LOAD=sliced measures with sliced_load.py instead (SLICES slices of 2 s, each against the floors either side of it;
# CONC connections, default 32).
#     mkdir /tmp/before37 && git archive 25e1f16 | tar -x -C /tmp/before37
#     results/issue37/vs_filing.sh [ROUNDS]
#     LOAD=sliced CONC=64 results/issue37/vs_filing.sh [ROUNDS]
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
load() {  # URL [PID]: one measurement of the server at URL (PID: a server whose /info names no processes)
  if [ "${LOAD:-split}" = sliced ]; then
    .venv/bin/python "$HERE/sliced_load.py" "$1" ${DOCS:-1} ${SLICES:-8} 2 ${CONC:-32} $2
  else
    .venv/bin/python "$HERE/split_load.py" "$1" ${DOCS:-1} $2
  fi
}
source "$HERE/wait_up.sh"
run() {
  if [ "$1" = filing ]; then
    echo "== round $round: 25e1f16 (one process)"
    (cd /tmp/before37 && PYTHONPATH=/tmp/before37 "$OLDPWD/.venv/bin/python" scripts/bench_host.py --serve 18201 \
        --tflops 400 > /tmp/before37.log 2>&1) &
    P=$!; wait_up 18201; SP=$(pgrep -f 'bench_host.py --serve 18201' | head -1)
    load http://127.0.0.1:18201 $SP; kill $SP; wait $P 2>/dev/null
  else
    local w=$1
    echo "== round $round: this tree, --workers $w"
    .venv/bin/jaxserve serve --simulate-device 400 --workers $w --port 1820$((w+1)) > /tmp/after37-$w.log 2>&1 &
    P=$!; wait_up 1820$((w+1)); sleep 1
    load http://127.0.0.1:1820$((w+1)); kill -TERM $P; wait $P
  fi
}
order=(filing 1 2)
for round in $(seq 1 ${1:-3}); do
  k=$(( (round - 1) % 3 ))
  for i in 0 1 2; do run "${order[$(( (i + k) % 3 ))]}"; done
done

#!/bin/bash
# sliced_load.py on the tree issue 37 was filed against (25e1f16: bench_host's private one-process server) and on
# this tree's `jaxserve serve --simulate-device 400 --workers 1` and `--workers 2`, the order rotating each round
# (as vs_filing.sh). One-document requests unless DOCS is set; CONC connections (default 32), SLICES slices of 2 s.
#     mkdir /tmp/before37 && git archive 25e1f16 | tar -x -C /tmp/before37
#     CONC=64 results/issue37/sliced.sh [ROUNDS]
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
wait_up() { for i in $(seq 1 400); do curl -sf localhost:$1/health >/dev/null && return; sleep 0.25; done; }
args() { echo "${DOCS:-1} ${SLICES:-8} 2 ${CONC:-32}"; }
run() {
  if [ "$1" = filing ]; then
    (cd /tmp/before37 && PYTHONPATH=/tmp/before37 "$OLDPWD/.venv/bin/python" scripts/bench_host.py --serve 18201 \
        --tflops 400 > /tmp/before37.log 2>&1) &
    P=$!; wait_up 18201; SP=$(pgrep -f 'bench_host.py --serve 18201' | head -1)
    echo "== round $round, 25e1f16: $(.venv/bin/python "$HERE/sliced_load.py" http://127.0.0.1:18201 $(args) $SP | tr '\n' ' ')"
    kill $SP; wait $P 2>/dev/null
  else
    local w=$1
    .venv/bin/jaxserve serve --simulate-device 400 --workers $w --port 1820$((w+1)) > /tmp/after37-$w.log 2>&1 &
    P=$!; wait_up 1820$((w+1)); sleep 1
    echo "== round $round, --workers $w: $(.venv/bin/python "$HERE/sliced_load.py" http://127.0.0.1:1820$((w+1)) $(args) | tr '\n' ' ')"
    kill -TERM $P; wait $P
  fi
}
order=(filing 1 2)
for round in $(seq 1 ${1:-3}); do
  k=$(( (round - 1) % 3 ))
  for i in 0 1 2; do run "${order[$(( (i + k) % 3 ))]}"; done
done

#!/bin/bash
# CPU per request of each process of `jaxserve serve --workers 2 --simulate-device 400` (the engine's threads
# one by one), the kernel's share of it, and each process's context switches (waiting, preempted), from /proc,
# under results/issue37/load.py; TREE=a `git archive` of another commit to compare.
#   bash results/issue37/cpu_split.sh PORT DOCS CONNECTIONS    # e.g. 8900 1 32; LOAD_CORPUS=1 for corpus documents
set -euo pipefail
TREE=${TREE:-$(cd "$(dirname "$0")/../.." && pwd)}
PY=${PY:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
PORT=$1; DOCS=$2; CONNS=${3:-32}
cd "$TREE"  # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH
PYTHONPATH=$TREE $PY -m jaxserve.cli serve --simulate-device 400 --port "$PORT" --workers 2 ${SERVE_ARGS:-} \
    > "/tmp/cpu_split-$PORT.log" 2>&1 &
PID=$!
trap 'kill -TERM $PID; wait $PID' EXIT
for _ in $(seq 1 300); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 0.2; done
read -r EPID FPIDS < <(curl -s "localhost:$PORT/info" | $PY -c "import json,sys; p=json.load(sys.stdin)['processes']; print(p['engine'], ' '.join(map(str, p['frontends'])))")
switches() {  # a process's context switches, all its threads: voluntary (it waited) and not (it was preempted)
  cat /proc/"$1"/task/*/status 2>/dev/null | awk '/^voluntary_ctxt/ {v += $2} /^nonvoluntary_ctxt/ {n += $2} END {print v, n}'
}
snap() {
  for p in $EPID $FPIDS; do echo "$(awk -v p="$p" '{print p, $14, $15}' "/proc/$p/stat") $(switches "$p")"; done
  for t in /proc/"$EPID"/task/*; do echo "T $(tr ' ' _ < "$t/comm") $(awk '{print $14, $15}' "$t/stat")"; done
}
before=$(snap)
out=$(LOAD_REPEAT=${LOAD_REPEAT:-4} $PY "$TREE/results/issue37/load.py" "http://127.0.0.1:$PORT" 1 "$CONNS" 6 "$DOCS")
echo "$out"
after=$(snap)
n=$(grep -o 'requests=[0-9]*' <<< "$out" | cut -d= -f2)
paste <(echo "$before") <(echo "$after") | awk -v n="$n" -v e="$EPID" '
  $1 == "T" { if ($7 + $8 > $3 + $4) printf "  engine thread %s: %.3f ms/request\n", $2, 10 * ($7 + $8 - $3 - $4) / n; next }
  { printf "%s %s: %.3f ms/request, context switches a request %.2f waiting, %.2f preempted\n",
           ($1 == e ? "engine" : "front-end"), $1, 10 * ($7 + $8 - $2 - $3) / n, ($9 - $4) / n, ($10 - $5) / n
    user += $7 - $2; sys += $8 - $3; vol += $9 - $4; inv += $10 - $5 }
  END { printf "all processes: %.3f ms/request, %.0f%% of it in the kernel; context switches a request %.2f waiting, %.2f preempted\n",
               10 * (user + sys) / n, 100 * sys / (user + sys), vol / n, inv / n }'

#!/usr/bin/env bash
# Instructions per one-document request of ONE front-end process (jaxserve's, or the lean one), counted by
# callgrind: deterministic where this VM's timings drift by 20% from run to run. Requests go one at a time (no two
# in one turn of the event loop), to a front-end connected to a running server's engine:
#   jaxserve serve --simulate-device 400 --workers 2 --port 8811 &
#   results/issue37/frontend_callgrind.sh http://127.0.0.1:8811 jaxserve|full|local|bare [TREE] [N] [CONNS]
# jaxserve: its own front-end; full, local, bare: lean_frontend.py's (LEAN=...). TREE: the jaxserve tree whose
# front-end runs (PYTHONPATH; default this one). CONNS: connections sending at once (default 1: one request at a
# time; 8: several in each turn of the front-end's loop, as under load). Prints instructions per request.
set -euo pipefail
url=$1 mode=$2 tree=${3:-$(pwd)} n=${4:-300} conns=${5:-1}
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-$here/../../.venv/bin/python}
port=$((9300 + RANDOM % 500))
out=$(mktemp -d)
mkdir "$out/metrics"  # as a front-end of `--workers N` writes its metrics: prometheus_client's multiprocess files
cd "$tree"
PROMETHEUS_MULTIPROC_DIR=$out/metrics LEAN=$mode PYTHONPATH=$tree valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out/cg.out" \
    "$py" "$here/lean_frontend.py" "$url" "$port" 0 >"$out/log" 2>&1 &
vg=$!
for _ in $(seq 600); do curl -sf "127.0.0.1:$port/info" >/dev/null 2>&1 && break; sleep 1; done
"$py" "$here/seq_client.py" "$port" 100 0
callgrind_control -i on "$vg" >/dev/null
"$py" "$here/seq_client.py" "$port" 20 100      # instrumented, not counted (caches of the instrumentation)
callgrind_control -z "$vg" >/dev/null
"$py" "$here/seq_client.py" "$port" "$n" 120 "$conns"
callgrind_control -d "$vg" >/dev/null
kill "$vg"; wait "$vg" 2>/dev/null || true
ir=$(grep -h "^summary:\|^totals:" "$out"/cg.out* | awk '{print $2}' | sort -n | tail -1)
echo "$mode $(basename "$tree"): $((ir / n)) instructions per request ($n requests, $conns at once)"
[ -n "${KEEP:-}" ] && cp "$out"/cg.out.1 "$KEEP"; rm -rf "$out"

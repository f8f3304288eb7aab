#!/bin/bash
# Every measured criterion of issue 37 in one sitting, on one tree, in the order the issue lists them (the fault
# cases and the docs are tests and pages, not runs). Each item is an existing script; this only runs them in turn
# with the settings their sections in docs/benchmarks.md used, so one file holds a whole standing:
#     mkdir /tmp/before37 && git archive 25e1f16 | tar -x -C /tmp/before37   # the tree the issue was filed on
#     PROJECTION_OUT=results/issue37/criteria_SESSION.json flock /tmp/jaxserve-bench.lock \
#         bash results/issue37/criteria.sh [ROUNDS] > results/issue37/criteria_SESSION.txt 2>&1
# ROUNDS (default 3) rounds of the one-document comparison, the order rotating; 2 of the 100-document one.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
rounds=${1:-3}
echo "# $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with uncommitted changes)'), $(date -u +%F)," \
  "$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores;" \
  "timeit sum(range(10000)): $(python3 -m timeit 'sum(range(10000))' | sed 's/.*: //')"

echo "## 1. One-document requests, 64 connections: x the floor, requests/s against 25e1f16, --workers 2 over 1"
LOAD=sliced CONC=64 bash "$HERE/vs_filing.sh" "$rounds"

echo "## 2. 100-document requests: docs/s against 25e1f16, x the floor"
DOCS=100 bash "$HERE/vs_filing.sh" 2

echo "## 3. The engine's CPU per 100-document job, on a core of its own, as a share of the floor"
source "$HERE/wait_up.sh"
.venv/bin/jaxserve serve --simulate-device 400 --workers 2 --port 18250 > /tmp/criteria-engine.log 2>&1 &
P=$!; wait_up 18250; sleep 1
for i in 1 2; do PIN=1 FLOOR=1 .venv/bin/python "$HERE/engine_alone.py" http://127.0.0.1:18250 100 4 6 1; done
kill -TERM $P; wait $P

echo "## 4. bench_host's projection: 1, 16 and 100 documents, MiniLM's and bge-base's sizes, --workers 1 and 2"
.venv/bin/python scripts/bench_host.py --docs 1,16,100 --workers 1,2 --sizes checkpoint,bge-base --concurrency 64 \
  --seconds 8 --format base64 --out "${PROJECTION_OUT:-/tmp/criteria_projection.json}"

#!/bin/bash
# usage (repository root): results/issue37/batches.sh PORT "FLAGS" DOCS CONNS -> load a simulated-device server, then batches per request and their buckets
cd "$(dirname "$0")/../.."
PORT=$1; FLAGS=$2; DOCS=$3; CONNS=${4:-32}
.venv/bin/jaxserve serve --simulate-device 400 --port $PORT $FLAGS > /tmp/batches-$PORT.log 2>&1 &
PID=$!
for i in $(seq 1 300); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 0.2; done
LOAD_REPEAT=4 .venv/bin/python results/issue37/load.py http://127.0.0.1:$PORT 1 $CONNS 6 $DOCS
curl -s localhost:$PORT/metrics > /tmp/batches-metrics-$PORT.txt
kill -TERM $PID; wait $PID
python3 - $PORT <<'PY'
import sys, re, collections
t = open(f"/tmp/batches-metrics-{sys.argv[1]}.txt").read()
def tot(name):
    return sum(float(l.rsplit(" ",1)[1]) for l in t.splitlines() if l.startswith(name) and not l.startswith("#"))
req = tot('jaxserve_requests_total{route="/v1/embeddings",status="200"}')
b = tot("jaxserve_batches_total")
print(f"requests {req:.0f} batches {b:.0f} batches/request {b/max(req,1):.2f}")
by = collections.Counter()
for l in t.splitlines():
    if l.startswith("jaxserve_batches_total{"):
        by[re.sub(r'^jaxserve_batches_total', '', l.rsplit(" ",1)[0])] += float(l.rsplit(" ",1)[1])
for k, v in by.most_common(12): print(f"{v:8.0f} {k}")
PY

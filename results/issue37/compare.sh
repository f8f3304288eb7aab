#!/bin/bash
# before (HEAD 25e1f16's bench_host server) vs after (--workers 1, --workers 2); 1, 16, 100 docs; same client.
# The before tree: mkdir /tmp/before37 && git archive 25e1f16 | tar -x -C /tmp/before37
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
run_load() { .venv/bin/python "$HERE/load.py" http://127.0.0.1:$1 1 1 5 1 $2; for d in 1 16 100; do .venv/bin/python "$HERE/load.py" http://127.0.0.1:$1 2 16 8 $d $2; done; }
source "$HERE/wait_up.sh"
for round in 1 2; do
echo "== before (25e1f16, one process)"
(cd /tmp/before37 && PYTHONPATH=/tmp/before37 "$OLDPWD/.venv/bin/python" scripts/bench_host.py --serve 18201 --tflops 400 > /tmp/before37.log 2>&1) &
P=$!; wait_up 18201; SP=$(pgrep -f 'bench_host.py --serve 18201' | head -1); run_load 18201 $SP; kill $SP; wait $P 2>/dev/null
for w in 1 2; do
echo "== after --workers $w"
.venv/bin/jaxserve serve --simulate-device 400 --workers $w --port 1820$((w+1)) > /tmp/after37-$w.log 2>&1 &
P=$!; wait_up 1820$((w+1)); run_load 1820$((w+1)); kill -TERM $P; wait $P
done
done

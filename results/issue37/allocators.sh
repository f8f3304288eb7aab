#!/bin/bash
# The whole server (`jaxserve serve --simulate-device 400 --workers 2 --malloc SERVER`: glibc's malloc with the
# tunables the supervisor sets, or mimalloc or jemalloc preloaded into the engine and the front-ends) measured by
# sliced_load.py (64 connections, 8 slices of 2 s each against the floors either side), whose floor (and client)
# runs on the allocator named second (LD_PRELOAD). The order rotates each round. DOCS: documents a request
# (default 1). WORKERS=1: one process, started with the allocator preloaded (it cannot preload one itself).
#     apt-get install libmimalloc2.0 libjemalloc2
#     results/issue37/allocators.sh ROUNDS "SERVER FLOOR" ...   # e.g. "glibc glibc" "mimalloc glibc" "mimalloc mimalloc"
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
source "$HERE/wait_up.sh"
rounds=$1; shift
configs=("$@") n=$#
lib() { case $1 in jemalloc) echo libjemalloc.so.2;; mimalloc) echo libmimalloc.so.2;; esac; }
for round in $(seq 1 "$rounds"); do
  for k in $(seq 0 $((n - 1))); do
    set -- ${configs[$(( (k + round) % n ))]}
    echo "== round $round: server $1 (--workers ${WORKERS:-2}), floor and client $2${DOCS:+, $DOCS documents}"
    LD_PRELOAD=$([ "${WORKERS:-2}" = 1 ] && lib "$1") .venv/bin/jaxserve serve --simulate-device 400 \
        --workers "${WORKERS:-2}" --malloc "$1" --port 18230 > /tmp/allocators-server.log 2>&1 &
    P=$!
    wait_up 18230; sleep 1
    echo "  /info: malloc $(curl -s 127.0.0.1:18230/info | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["processes"]["malloc"])')"
    LD_PRELOAD=$(lib "$2") .venv/bin/python "$HERE/sliced_load.py" http://127.0.0.1:18230 ${DOCS:-1} 8 2 64 | head -1
    .venv/bin/python -c "import json, urllib.request, psutil
p = json.load(urllib.request.urlopen('http://127.0.0.1:18230/info'))['processes']
rss = lambda pid: round(psutil.Process(pid).memory_info().rss / 2**20)
print('  RSS after the load, MiB: engine', rss(p['engine']), 'front-ends', [rss(f) for f in p['frontends'] if f != p['engine']])"
    kill -TERM $P; wait $P
  done
done

#!/bin/bash
# The engine's system calls and context switches per job: `jaxserve serve --simulate-device 400 --workers 2` from
# TREE (PYTHONPATH) on PORT, fed by engine_alone.py (100-document jobs, 4 in flight, the engine pinned), with
# perf's counts of the engine process over 5 s in the middle, per job (jobs from /metrics: sequences dispatched / 100).
#     results/issue37/syscalls_per_job.sh TREE PORT
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
source "$HERE/wait_up.sh"
tree=$1 port=$2
(cd "$tree" && PYTHONPATH=$tree "$ROOT/.venv/bin/python" -m jaxserve.cli serve --simulate-device 400 --workers 2 \
    --port "$port" > "/tmp/syscalls-$port.log" 2>&1) &
P=$!; wait_up "$port"; sleep 1
EP=$(curl -s "localhost:$port/info" | python3 -c 'import json,sys; print(json.load(sys.stdin)["processes"]["engine"])')
(PIN=1 "$ROOT/.venv/bin/python" "$HERE/engine_alone.py" "http://127.0.0.1:$port" 100 4 10 1 > "/tmp/syscalls-ea-$port.txt" 2>&1 &)
sleep 7
dispatched() { curl -s "localhost:$port/metrics" | awk '/^jaxserve_sequences_total\{outcome="dispatched"/ {s+=$2} END {print s}'; }
b0=$(dispatched)
perf stat -x, -e syscalls:sys_enter_futex,syscalls:sys_enter_write,syscalls:sys_enter_writev,syscalls:sys_enter_read,context-switches,task-clock \
    -p "$EP" -- sleep 5 2> "/tmp/syscalls-perf-$port.txt"
b1=$(dispatched)
sleep 6; cat "/tmp/syscalls-ea-$port.txt"
jobs=$(python3 -c "print(($b1 - $b0) / 100)")
awk -F, -v j="$jobs" '{printf "%s %.2f per job\n", $3, $1 / j}' "/tmp/syscalls-perf-$port.txt"
pkill -TERM -f -- "--port $port"; wait $P

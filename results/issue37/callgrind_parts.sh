#!/bin/bash
# Instructions per job of engine_parts.py's pure work (submit, forming, assemble, scatter) for one tree, counted by
# callgrind: deterministic where this VM's speed drifts by 2x within minutes, so two trees compare to a few tenths
# of a percent. The count at REPS 60 less the count at REPS 20, over the 40 x JOBS jobs between (start-up cancels).
#   bash results/issue37/callgrind_parts.sh TREE bge|minilm DOCS JOBS     # e.g. /tmp/base bge 100 6
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-$(cd "$HERE/../.." && pwd)/.venv/bin/python}
TREE=$1; SIZE=$2; DOCS=$3; JOBS=$4
cd "$TREE"
count() {
  PYTHONPATH=$TREE valgrind --tool=callgrind --callgrind-out-file=/dev/null "$PY" "$HERE/engine_parts.py" \
      "$SIZE" "$DOCS" "$JOBS" "$1" 1 2>&1 | awk '/Collected/ {print $4}'
}
a=$(count 20); b=$(count 60)
echo "$TREE $SIZE docs=$DOCS x$JOBS: $(( (b - a) / (40 * JOBS) )) instructions per job"

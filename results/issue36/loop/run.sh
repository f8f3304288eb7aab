#!/bin/bash
# usage: run.sh TREE LABEL (under flock /tmp/jaxserve-cpu.lock): the three probes against TREE's server
tree=$1; label=$2
for probe in embed_sparse multivector rerank; do
  model=/tmp/loopbench/colbert/st; table=/tmp/loopbench/colbert-table.json
  [ $probe = embed_sparse ] && model=/tmp/loopbench/splade/st && table=/tmp/loopbench/splade-table.json
  JAXSERVE_CACHE_DIR=/tmp/loopbench/cache-$label PYTHONPATH=$tree /work/main/.venv/bin/python /work/main/scripts/bench_host.py \
    --engine real --model $model --table $table --concurrency "" --probe $probe --probe-docs 1024 --probe-rounds 3 \
    --label $label --out /tmp/loopbench/$label-$probe.json 2>&1 | grep -E "^/health|Error|error" | tail -3
done

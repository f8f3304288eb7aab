"""Padding ratio and dispatches of padded vs packed plans on a real mixed-length corpus (no model run).

    .venv/bin/python scripts/plan_stats.py [--docs 1000] [--request 100]

Plans the corpus of scripts/harness.py in requests of `--request` documents
with the bundled MiniLM's tokenizer, for each seqlen ladder, padded and
packed, with and without the batch ladder. The tables are derived as on this
CPU (token cap 4096 per dispatch) from the analytic estimate alone: planning
needs shapes, not compiled executables.
"""

from __future__ import annotations

import argparse
import itertools

import harness

from jaxserve.checkpoint import loader
from jaxserve.checkpoint.config import EmbeddingConfig, read_model_config
from jaxserve.checkpoint.tokenize import TextTokenizer
from jaxserve.runtime.buckets import derive, ladder
from jaxserve.scheduling.explain import simulate
from jaxserve.scheduling.planner import pack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--request", type=int, default=100)
    args = ap.parse_args()
    path = loader.bundled_default()
    _, cfg = read_model_config(path)
    emb = EmbeddingConfig.from_checkpoint(path, cfg)
    dims = cfg.dims(4)
    tok = TextTokenizer.from_dir(path, emb.max_seq_length)
    docs = harness.documents(args.docs)
    lengths = [len(s) for s in tok.encode(docs)]
    over = sum(len(b) + tok.num_special > emb.max_seq_length for b in tok.encode_bodies(docs))
    print(f"corpus: {len(docs)} documents, {sum(lengths)} tokens after truncation, "
          f"median {sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}, {over} over the {emb.max_seq_length} limit")
    print(f"{'ladder':>8} {'batches':>8} {'layout':>7} {'shapes':>6} {'padding':>8} {'dispatches':>10} "
          f"{'padded tok':>10} {'real tok':>9}")
    configs = itertools.product(("max", "pow2", "default", "fine"), (False, True), ("padded", "packed"))
    for name, batch_ladder, layout in configs:
        table = derive(ladder(name, emb.max_seq_length), dims, 90 * 2**20, 10 * 2**30, None,
                       max_batch_tokens=4096, layout=layout, batch_ladder=batch_ladder)
        real = padded = dispatches = 0
        for start in range(0, len(lengths), args.request):
            ran = simulate(pack(lengths[start : start + args.request], table), table)
            real += sum(lengths[start : start + args.request])
            padded, dispatches = padded + sum(d.bucket.tokens for d in ran), dispatches + len(ran)
        print(f"{name:>8} {'ladder' if batch_ladder else 'max':>8} {layout:>7} {len(table.buckets):>6} "
              f"{1 - real / padded:>8.1%} {dispatches:>10} {padded:>10} {real:>9}")
    with harness.bench_lock():
        time_packing(tok, docs, table)


def time_packing(tok, docs: list[str], table) -> None:
    """Host cost of one 1024-document request after tokenizing: pack into rows, lay out as a job (median of 20)."""
    import statistics
    import time

    from jaxserve.scheduling.jobs import Job

    pieces = tok.documents((docs * 2)[:1024])
    pack_s, job_s = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        rows = pack(pieces.lengths, table)
        t1 = time.perf_counter()
        Job(rows, pieces.ids, pieces.offsets, None, 384)
        t2 = time.perf_counter()
        pack_s.append(t1 - t0)
        job_s.append(t2 - t1)
    print(f"1024 documents ({pieces.lengths.sum()} tokens) on the last table: pack {1e3 * statistics.median(pack_s):.2f} ms, "
          f"job layout {1e3 * statistics.median(job_s):.2f} ms ({rows.count} rows)")


if __name__ == "__main__":
    main()

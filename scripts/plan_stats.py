"""Padding ratio and dispatches of padded vs packed plans on a real mixed-length corpus (no model run).

    .venv/bin/python scripts/plan_stats.py [--docs 1000] [--request 100]

Plans the corpus of scripts/corpus.py in requests of `--request` documents
with the bundled MiniLM's tokenizer, for each seqlen ladder, padded and
packed, with and without the batch ladder. The tables are derived as on this
CPU (token cap 4096 per dispatch) from the analytic estimate alone: planning
needs shapes, not compiled executables.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import corpus  # noqa: E402

from jaxserve import checkpoint  # noqa: E402
from jaxserve.buckets import derive, ladder  # noqa: E402
from jaxserve.config import EmbeddingConfig, read_model_config  # noqa: E402
from jaxserve.planner import plan  # noqa: E402
from jaxserve.tokenize import TextTokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--request", type=int, default=100)
    args = ap.parse_args()
    path = checkpoint.bundled_default()
    _, cfg = read_model_config(path)
    emb = EmbeddingConfig.from_checkpoint(path, cfg)
    dims = cfg.dims(4)
    tok = TextTokenizer.from_dir(path, emb.max_seq_length)
    docs = corpus.documents(args.docs)
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
            p = plan(lengths[start : start + args.request], table)
            real, padded, dispatches = real + p.real_tokens, padded + p.padded_tokens, dispatches + p.dispatches
        print(f"{name:>8} {'ladder' if batch_ladder else 'max':>8} {layout:>7} {len(table.buckets):>6} "
              f"{1 - real / padded:>8.1%} {dispatches:>10} {padded:>10} {real:>9}")


if __name__ == "__main__":
    main()

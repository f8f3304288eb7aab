"""Write the benchmarks' corpus (`harness.documents`: Python's own docstrings cut into sentences, paragraphs
and whole docstrings) as JSONL. Deterministic for a given seed and Python version.

    python scripts/corpus.py --n 1000 --out /tmp/corpus.jsonl   # one {"text": ...} per line
"""

from __future__ import annotations

import argparse
import json

import harness

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.out, "w") as f:
        for text in harness.documents(args.n, args.seed):
            f.write(json.dumps({"text": text}) + "\n")

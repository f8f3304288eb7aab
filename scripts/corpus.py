"""A real mixed-length corpus from text on this machine: Python's own documentation.

Docstrings of the standard library (modules, classes, functions), cut into
documents the way users send them: single sentences, paragraphs and whole
docstrings (often over the 256-token limit). Deterministic for a given seed
and Python version; nothing is committed but this script.

    python scripts/corpus.py --n 1000 --out /tmp/corpus.jsonl   # one {"text": ...} per line
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import warnings

MODULES = [
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "email",
    "functools", "heapq", "http.client", "inspect", "itertools", "json", "logging", "os", "pathlib", "pickle",
    "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap",
    "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
]


def docstrings() -> list[str]:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in MODULES:
            mod = importlib.import_module(name)
            for obj in [mod] + [v for _, v in sorted(vars(mod).items()) if inspect.isclass(v) or inspect.isfunction(v)]:
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 40 and doc not in out:
                    out.append(doc)
    return out


def pools() -> dict[str, list[str]]:
    """The corpus's three kinds of document: sentences, paragraphs, whole docstrings."""
    docs = docstrings()
    paragraphs = [p.strip() for d in docs for p in d.split("\n\n") if len(p.strip()) > 30]
    sentences = [s.strip() for p in paragraphs for s in re.split(r"(?<=[.!?])\s+", p) if len(s.strip()) > 15]
    return {"sentences": sentences, "paragraphs": paragraphs, "docstrings": docs}


def documents(n: int, seed: int = 0) -> list[str]:
    """`n` documents: about 40% sentences, 40% paragraphs, 20% whole docstrings."""
    rng = random.Random(seed)
    p = pools()
    out = []
    for _ in range(n):
        r = rng.random()
        pool = p["sentences"] if r < 0.4 else p["paragraphs"] if r < 0.8 else p["docstrings"]
        out.append(" ".join(rng.choice(pool).split()))
    return out


def sample(kind: str, n: int, min_chars: int = 0, seed: int = 0) -> list[str]:
    """`n` documents of one kind (with replacement), at least `min_chars` long."""
    rng = random.Random(seed)
    pool = [" ".join(d.split()) for d in pools()[kind] if len(d) >= min_chars]
    return [rng.choice(pool) for _ in range(n)]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.out, "w") as f:
        for text in documents(args.n, args.seed):
            f.write(json.dumps({"text": text}) + "\n")

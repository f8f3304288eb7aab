"""`batcher._by_seqlen` (its run bounds found by a Python loop over the seqlens, since d7e04ec) against the numpy
version before it (kept here, checked to give the same runs), hot, on real corpus jobs packed on the simulated H200
table of MiniLM's size.

    PYTHONPATH=. python results/issue37/by_seqlen_loop.py
"""
import sys
import timeit

import numpy as np

sys.path[:0] = ["scripts", "results/issue37"]

import harness  # noqa: E402
from engine_parts import corpus_tokenizer, table_of  # noqa: E402

from jaxserve.scheduling.batcher import ONE_ROW, _by_seqlen  # noqa: E402
from jaxserve.scheduling.planner import pack  # noqa: E402

table, tok = table_of("minilm"), corpus_tokenizer()
corpus = harness.documents(4000, seed=0)


def by_numpy(seqlens, docs):
    """_by_seqlen as it was at 76b08c5."""
    if len(seqlens) <= 1:
        return [(int(s), ONE_ROW, docs) for s in seqlens.tolist()]
    bounds = [0, *(np.flatnonzero(seqlens[1:] != seqlens[:-1]) + 1).tolist(), len(seqlens)]
    values = seqlens[bounds[:-1]].tolist()
    if len(set(values)) == len(values):
        return [(s, np.arange(a, z), docs[a:z]) for s, a, z in zip(values, bounds, bounds[1:])]
    return [(s, rows, docs[rows]) for s in np.unique(seqlens).tolist() for rows in [np.flatnonzero(seqlens == s)]]


def plain(runs):
    return [(s, rows.tolist(), docs.tolist()) for s, rows, docs in runs]


for n in (100, 16, 2):
    lengths = np.array([len(e.ids) for e in tok.encode_batch_fast(corpus[:n])])
    rows = pack(lengths, table)
    s, d = rows.seqlen, rows.docs
    assert plain(_by_seqlen(s, d)) == plain(by_numpy(s, d))
    old = min(timeit.repeat(lambda: by_numpy(s, d), number=2000, repeat=5)) / 2000 * 1e6
    new = min(timeit.repeat(lambda: _by_seqlen(s, d), number=2000, repeat=5)) / 2000 * 1e6
    print(f"{n} docs, {len(s)} rows, {len(_by_seqlen(s, d))} runs: numpy {old:.2f} us, loop {new:.2f} us")
s, d = np.array([64, 32, 64, 32]), np.array([1, 2, 1, 1])  # not grouped: the fallback
assert plain(_by_seqlen(s, d)) == plain(by_numpy(s, d))

"""`batcher._by_seqlen` against the same with its run bounds found by a Python loop over the seqlens (a throwaway,
checked to give the same runs), on real corpus jobs packed on the simulated H200 table of MiniLM's size.

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


def by_loop(seqlens, docs):
    if len(seqlens) <= 1:
        return [(int(s), ONE_ROW, docs) for s in seqlens.tolist()]
    values = seqlens.tolist()
    cuts = [0, *(i for i in range(1, len(values)) if values[i] != values[i - 1]), len(values)]
    firsts = [values[a] for a in cuts[:-1]]
    if len(set(firsts)) == len(firsts):
        return [(s, np.arange(a, z), docs[a:z]) for s, a, z in zip(firsts, cuts, cuts[1:])]
    return [(s, rows, docs[rows]) for s in np.unique(seqlens).tolist() for rows in [np.flatnonzero(seqlens == s)]]


def plain(runs):
    return [(s, rows.tolist(), docs.tolist()) for s, rows, docs in runs]


for n in (100, 16, 2):
    lengths = np.array([len(e.ids) for e in tok.encode_batch_fast(corpus[:n])])
    rows = pack(lengths, table)
    s, d = rows.seqlen, rows.docs
    assert plain(_by_seqlen(s, d)) == plain(by_loop(s, d))
    old = min(timeit.repeat(lambda: _by_seqlen(s, d), number=2000, repeat=5)) / 2000 * 1e6
    new = min(timeit.repeat(lambda: by_loop(s, d), number=2000, repeat=5)) / 2000 * 1e6
    print(f"{n} docs, {len(s)} rows, {len(_by_seqlen(s, d))} runs: numpy {old:.2f} us, loop {new:.2f} us")
s, d = np.array([64, 32, 64, 32]), np.array([1, 2, 1, 1])  # not grouped: the fallback
assert plain(_by_seqlen(s, d)) == plain(by_loop(s, d))

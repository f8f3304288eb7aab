"""`batcher._by_seqlen` against the same with its run bounds found by a Python loop over the seqlens (a throwaway,
checked to give the same runs), on real corpus jobs packed on the simulated H200 table of MiniLM's size.

    PYTHONPATH=. python results/issue37/by_seqlen_loop.py
"""
import sys, timeit, numpy as np
sys.path.insert(0, "scripts"); sys.path.insert(0, "results/issue37")
import harness
from engine_parts import SIZES, VOCAB, MAX_LENGTH, DTYPE_BYTES
from jaxserve.runtime.simulated import SimSpec, sim_dims, simulated_table, sized_weights_bytes
from jaxserve.scheduling.batcher import _by_seqlen, ONE_ROW
from jaxserve.scheduling.planner import pack
from jaxserve.checkpoint import loader
from tokenizers import Tokenizer
sizes = SIZES["minilm"]
table = simulated_table(sim_dims(*sizes, dtype_bytes=DTYPE_BYTES), sized_weights_bytes(*sizes, VOCAB, DTYPE_BYTES), MAX_LENGTH, SimSpec(400.0, sizes=sizes))
tok = Tokenizer.from_file(str(loader.resolve(None) / "tokenizer.json")); tok.no_padding(); tok.enable_truncation(256)
corpus = harness.documents(4000, seed=0)

def new(seqlens, docs):
    if len(seqlens) <= 1:
        return [(int(s), ONE_ROW, docs) for s in seqlens.tolist()]
    values = seqlens.tolist()
    cuts = [0, *(i for i in range(1, len(values)) if values[i] != values[i - 1]), len(values)]
    firsts = [values[a] for a in cuts[:-1]]
    if len(set(firsts)) == len(firsts):
        return [(s, np.arange(a, z), docs[a:z]) for s, a, z in zip(firsts, cuts, cuts[1:])]
    return [(s, rows, docs[rows]) for s in np.unique(seqlens).tolist() for rows in [np.flatnonzero(seqlens == s)]]

for n in (100, 16, 2):
    enc = tok.encode_batch_fast(corpus[:n]); lengths = np.array([len(e.ids) for e in enc])
    rows = pack(lengths, table); s, d = rows.seqlen, rows.docs
    a, b = _by_seqlen(s, d), new(s, d)
    assert [(x, r.tolist(), dd.tolist()) for x, r, dd in a] == [(x, r.tolist(), dd.tolist()) for x, r, dd in b]
    t_old = min(timeit.repeat(lambda: _by_seqlen(s, d), number=2000, repeat=5)) / 2000 * 1e6
    t_new = min(timeit.repeat(lambda: new(s, d), number=2000, repeat=5)) / 2000 * 1e6
    print(f"{n} docs, {len(s)} rows, {len(a)} runs: old {t_old:.2f} us, new {t_new:.2f} us")
# unsorted fallback
s = np.array([64, 32, 64, 32]); d = np.array([1, 2, 1, 1])
assert [(x, r.tolist(), dd.tolist()) for x, r, dd in _by_seqlen(s, d)] == [(x, r.tolist(), dd.tolist()) for x, r, dd in new(s, d)]

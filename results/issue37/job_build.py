"""A front-end's cost of laying out one request's job (`Job(...)`, after `pack`), for requests of 1, 16 and 100
corpus-like sequences (44 +- 15 tokens) on the simulated H200 table of MiniLM's size: microseconds per job, the best
of 7 rounds. Compare two trees in alternation (this VM's speed drifts):

    PYTHONPATH=TREE python results/issue37/job_build.py
"""
import time

import numpy as np

from jaxserve.runtime.simulated import SimSpec, sim_dims, simulated_table, sized_weights_bytes
from jaxserve.scheduling.jobs import Job
from jaxserve.scheduling.planner import pack

SIZES, VOCAB, MAX_LENGTH, DTYPE_BYTES = (384, 1536, 6), 30522, 256, 4  # as engine_parts.py's minilm

table = simulated_table(sim_dims(*SIZES, dtype_bytes=DTYPE_BYTES), sized_weights_bytes(*SIZES, VOCAB, DTYPE_BYTES),
                        MAX_LENGTH, SimSpec(400.0, sizes=SIZES))
rng = np.random.default_rng(0)
for docs in (1, 16, 100):
    lengths = np.clip(rng.normal(44, 15, docs).astype(np.int64), 5, 200)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(1000, 30000, offsets[-1]).astype(np.int32)
    rows = pack(lengths, table)
    best = 1e9
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(300):
            Job(rows, ids, offsets, None, SIZES[0])
        best = min(best, time.perf_counter() - t)
    print(f"Job of {docs:3d} sequences: {1e6 * best / 300:6.1f} us")

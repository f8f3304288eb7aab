"""`assemble` and `scatter` on jobs whose arrays lie at offset 0, 1 or 2 bytes into their buffers, as the link's
framing can hand them over (a buffer starts where the pickled header ends): 8 jobs of 100 corpus documents packed
on the simulated H200 table of MiniLM's size, their batches formed once, each step timed over 50 passes.

    PYTHONPATH=. python results/issue37/wire_alignment.py
"""
import pickle
import sys
import timeit

import numpy as np

sys.path[:0] = ["scripts", "results/issue37"]

import harness  # noqa: E402
from engine_parts import corpus_tokenizer, table_of  # noqa: E402

from jaxserve.scheduling.batcher import BULK, Batcher  # noqa: E402
from jaxserve.scheduling.jobs import Job, assemble, most_per_row, scatter  # noqa: E402
from jaxserve.scheduling.planner import pack  # noqa: E402

table, tok = table_of("minilm"), corpus_tokenizer()
corpus = harness.documents(4000, seed=0)


def jobs_at(offset: int) -> list[Job]:
    """8 jobs as the engine unpickles them, each array `offset` bytes into a buffer of its own."""
    jobs = []
    for k in range(8):
        enc = tok.encode_batch_fast(corpus[k * 100 : (k + 1) * 100])
        lengths = np.array([len(e.ids) for e in enc])
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        ids = np.concatenate([e.ids for e in enc]).astype(np.int32)
        buffers = []
        head = pickle.dumps(Job(pack(lengths, table), ids, offsets, None, 384), protocol=5,
                            buffer_callback=buffers.append)
        views = []
        for b in buffers:
            raw = b.raw()
            held = bytearray(raw.nbytes + offset)
            held[offset:] = raw
            views.append(memoryview(held)[offset:])
        jobs.append(pickle.loads(head, buffers=views))
    return jobs


for offset in (0, 1, 2, 0, 1, 2):
    jobs = jobs_at(offset)
    by_id = dict(enumerate(jobs))
    batcher = Batcher(table, 0.002, 1 << 24)
    for i, j in by_id.items():
        batcher.submit(i, j.rows.seqlen, j.rows.docs, 0.0, BULK)
    batches = []
    while (d := batcher.next_dispatch(0.001, device_idle=True)) is not None:
        batches.append(d)
    t_assemble = timeit.timeit(lambda: [assemble(d.bucket, d.parts, by_id) for d in batches], number=50)
    outs = [np.zeros((d.bucket.batch, max(1, most_per_row(d.parts, by_id)), 384), np.float32) for d in batches]

    def scatter_all():
        for j in jobs:
            j.remaining, j.gathered = len(j.lengths), []
        for d, o in zip(batches, outs):
            scatter(d.parts, o, by_id)

    t_scatter = timeit.timeit(scatter_all, number=50)
    n = 50 * len(batches)
    print(f"offset {offset}: aligned={jobs[0].flat.flags.aligned}/{jobs[0].row_of.flags.aligned} "
          f"assemble {1e6 * t_assemble / n:.1f} us/batch, scatter {1e6 * t_scatter / n:.1f} us/batch "
          f"({len(batches)} batches)")

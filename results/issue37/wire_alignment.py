"""`assemble` and `scatter` on jobs whose arrays lie at offset 0, 1 or 2 bytes into their buffers, as the link's
framing can hand them over (a buffer starts where the pickled header ends): 8 jobs of 100 corpus documents packed
on the simulated H200 table of MiniLM's size, their batches formed once, each step timed over 50 passes.

    PYTHONPATH=. python results/issue37/wire_alignment.py
"""
import sys, timeit, pickle, numpy as np
sys.path.insert(0, "scripts"); sys.path.insert(0, "results/issue37")
import harness
from engine_parts import SIZES, VOCAB, MAX_LENGTH, DTYPE_BYTES
from jaxserve.runtime.simulated import SimSpec, sim_dims, simulated_table, sized_weights_bytes
from jaxserve.scheduling.batcher import Batcher, BULK
from jaxserve.scheduling.jobs import Job, assemble, scatter, most_per_row
from jaxserve.scheduling.planner import pack
from jaxserve.checkpoint.tokenize import TextTokenizer
from jaxserve.checkpoint import loader
sizes = SIZES["minilm"]
table = simulated_table(sim_dims(*sizes, dtype_bytes=DTYPE_BYTES), sized_weights_bytes(*sizes, VOCAB, DTYPE_BYTES), MAX_LENGTH, SimSpec(400.0, sizes=sizes))
from tokenizers import Tokenizer
tok = Tokenizer.from_file(str(loader.resolve(None) / "tokenizer.json")); tok.no_padding(); tok.enable_truncation(256)
corpus = harness.documents(4000, seed=0)
def mk(off):
    jobs = []
    for k in range(8):
        enc = tok.encode_batch_fast(corpus[k*100:(k+1)*100])
        lengths = np.array([len(e.ids) for e in enc]); offsets = np.concatenate([[0], np.cumsum(lengths)])
        ids = np.concatenate([e.ids for e in enc]).astype(np.int32)
        j = Job(pack(lengths, table), ids, offsets, None, 384)
        bufs = []
        head = pickle.dumps(j, protocol=5, buffer_callback=bufs.append)
        # the buffers at offset `off` of fresh bytearrays, as the wire's body hands them over
        views = []
        for b in bufs:
            raw = b.raw(); ba = bytearray(raw.nbytes + off); ba[off:] = raw; views.append(memoryview(ba)[off:])
        jobs.append(pickle.loads(head, buffers=views))
    return jobs
for off in (0, 1, 2, 0, 1, 2):
    jobs = mk(off)
    b = Batcher(table, 0.002, 1 << 24)
    ds = []
    byid = dict(enumerate(jobs))
    for i, j in byid.items():
        b.submit(i, j.rows.seqlen, j.rows.docs, 0.0, BULK)
    while (d := b.next_dispatch(0.001, device_idle=True)) is not None:
        ds.append(d)
    t = timeit.timeit(lambda: [assemble(d.bucket, d.parts, byid) for d in ds], number=50) / 50 / len(ds) * 1e6
    outs = [np.zeros((d.bucket.batch, max(1, most_per_row(d.parts, byid)), 384), np.float32) for d in ds]
    def sc():
        for j in jobs: j.remaining, j.gathered = len(j.lengths), []
        for d, o in zip(ds, outs): scatter(d.parts, o, byid)
    t2 = timeit.timeit(sc, number=50) / 50 / len(ds) * 1e6
    print(f"offset {off}: aligned={jobs[0].flat.flags.aligned}/{jobs[0].row_of.flags.aligned} assemble {t:.1f} us/batch, scatter {t2:.1f} us/batch ({len(ds)} batches)")

"""The engine's pure work per job, without its threads, link or metrics: a batcher's submit and its dispatches
(`next_dispatch` on an idle device), `assemble` and `scatter`, on the simulated H200 table that
`--simulate-device 400 --simulate-size H,I,L` serves over the bundled MiniLM (its vocabulary, its max length
of 256, float32 weights) for a model of bge-base's or MiniLM's sizes, for jobs of DOCS corpus-like sequences
(44 +- 15 tokens), JOBS of them queued at once, REPS times. Each of ROUNDS rounds prints microseconds per job;
compare the fastest round of two trees (this VM's speed drifts; the tree needs `simulated.simulated_table`).
Against engine_alone.py's CPU per job it says how much of the engine's time is this work and how much is
the rest (threads, link, bookkeeping).

    PYTHONPATH=TREE python results/issue37/engine_parts.py bge|minilm DOCS JOBS REPS [ROUNDS]
"""
import pickle
import sys
import time

import numpy as np

from jaxserve.runtime.simulated import SimSpec, sim_dims, simulated_table, sized_weights_bytes
from jaxserve.scheduling.batcher import BULK, Batcher
from jaxserve.scheduling.jobs import Job, assemble, most_per_row, scatter
from jaxserve.scheduling.planner import pack

SIZES = {"bge": (768, 3072, 12), "minilm": (384, 1536, 6)}  # (hidden, intermediate, layers)
VOCAB, MAX_LENGTH, DTYPE_BYTES = 30522, 256, 4  # the bundled MiniLM's


def jobs_of(table, docs: int, dim: int, rng) -> list[Job]:
    """Jobs as the engine receives them (across pickle protocol 5: no outputs of their own)."""
    made = []
    for _ in range(8):
        lengths = np.clip(rng.normal(44, 15, docs).astype(np.int64), 5, 200)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        ids = rng.integers(1000, 30000, offsets[-1]).astype(np.int32)
        made.append(pickle.loads(pickle.dumps(Job(pack(lengths, table), ids, offsets, None, dim), protocol=5)))
    return made


def one_round(table, made: list[Job], at_once: int, reps: int, dim: int) -> dict[str, float]:
    batcher = Batcher(table, 0.002, 1 << 24)
    spent = dict.fromkeys(("submit", "form", "assemble", "scatter"), 0.0)
    jid = batches = 0
    for r in range(reps):
        jobs = {}
        t0 = time.perf_counter()
        for k in range(at_once):
            job = made[(r * at_once + k) % len(made)]
            job.remaining, job.gathered = len(job.lengths), []
            jid += 1
            jobs[jid] = job
            batcher.submit(jid, job.rows.seqlen, job.rows.docs, 0.0, BULK)
        t1 = time.perf_counter()
        spent["submit"] += t1 - t0
        while (d := batcher.next_dispatch(0.001, device_idle=True)) is not None:
            t2 = time.perf_counter()
            assemble(d.bucket, d.parts, jobs)
            k = max(1, most_per_row(d.parts, jobs))
            t3 = time.perf_counter()
            out = np.zeros((d.bucket.batch, k, dim), np.float32)  # the device's output, not timed
            t4 = time.perf_counter()
            scatter(d.parts, out, jobs)
            t5 = time.perf_counter()
            spent["form"] += t2 - t1
            spent["assemble"] += t3 - t2
            spent["scatter"] += t5 - t4
            batches += 1
            t1 = time.perf_counter()
    n = reps * at_once
    return {**{k: 1e6 * v / n for k, v in spent.items()}, "total": 1e6 * sum(spent.values()) / n,
            "batches/job": batches / n}


def table_of(size: str):
    """The simulated H200 table `--simulate-device 400 --simulate-size` serves for `size` (bge or minilm)."""
    sizes = SIZES[size]
    return simulated_table(sim_dims(*sizes, dtype_bytes=DTYPE_BYTES), sized_weights_bytes(*sizes, VOCAB, DTYPE_BYTES),
                           MAX_LENGTH, SimSpec(400.0, sizes=sizes))


def corpus_tokenizer():
    """The bundled MiniLM's tokenizer as bench_host's floor runs it: no padding, truncation at its max length."""
    from tokenizers import Tokenizer

    from jaxserve.checkpoint import loader

    tok = Tokenizer.from_file(str(loader.resolve(None) / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(MAX_LENGTH)
    return tok


def main() -> None:
    size, docs, at_once, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    table = table_of(size)
    hidden = SIZES[size][0]
    made = jobs_of(table, docs, hidden, np.random.default_rng(0))
    for _ in range(rounds):
        r = one_round(table, made, at_once, reps, hidden)
        print(f"{size} docs={docs} x{at_once}: us per job: " + " ".join(
            f"{k} {v:.2f}" if k == "batches/job" else f"{k} {v:.1f}" for k, v in r.items()))


if __name__ == "__main__":
    main()

"""The engine's serial part without the link or HTTP: one Pipeline on the simulated H200, fed jobs from its own
event loop, CPU per job of the whole process (all its threads).

    python results/issue37/pipeline_alone.py DOCS CONCURRENCY JOBS
    SIZES=768,3072,12 ...   # at bge-base's size (the simulated device is then the bottleneck: a deep queue)
    NOMETRICS=1 ...         # without the Prometheus metrics (what they cost)
"""
import asyncio
import os
import sys
import tempfile
import time

os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp())
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import harness  # noqa: E402
import uvloop  # noqa: E402

from jaxserve.encoder import Encoder  # noqa: E402
from jaxserve.http.metrics import EngineMetrics  # noqa: E402
from jaxserve.runtime.simulated import SimSpec, simulated_engine  # noqa: E402
from jaxserve.scheduling.jobs import Job  # noqa: E402
from jaxserve.scheduling.pipeline import Metrics, Pipeline, server_classes  # noqa: E402
from jaxserve.scheduling.planner import pack  # noqa: E402

docs, conc, n = (int(a) for a in sys.argv[1:4])
sizes = tuple(int(x) for x in os.environ["SIZES"].split(",")) if os.environ.get("SIZES") else None
enc = Encoder.from_pretrained(None)
eng = simulated_engine(enc.engine, enc.model_config, enc.embedding_config.max_seq_length, enc.out_dim,
                       SimSpec(400, 30, sizes=sizes))
corpus = harness.documents(4000, seed=0)
made = []
for k in range(16):
    pieces = enc.tokenizer.documents([corpus[(k * docs + j) % len(corpus)] for j in range(docs)])
    made.append((pack(pieces.lengths, eng.table), pieces))


def jobs():
    return [Job(rows, p.ids, p.offsets, p.types, enc.out_dim) for rows, p in (made[i % 16] for i in range(n))]


async def main():
    metrics = Metrics() if os.environ.get("NOMETRICS") else EngineMetrics()
    p = Pipeline(eng, eng.table, 0.005, None, metrics, streams=1, classes=server_classes(0.02))
    await p.start()
    for phase in ("warm", "measured"):
        todo = iter(jobs())

        async def worker():
            for job in todo:
                await p.run(job, 1, None)

        cpu, wall, busy, batches = time.process_time(), time.perf_counter(), eng.busy_s, p.device_batches
        await asyncio.gather(*(worker() for _ in range(conc)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"docs={docs} concurrency={conc} jobs={n} cpu/job={1e3 * cpu / n:.3f} ms wall/job={1e3 * wall / n:.3f} ms "
          f"device busy={100 * (eng.busy_s - busy) / wall:.0f}% batches/job={(p.device_batches - batches) / n:.2f}")
    await p.stop()

uvloop.run(main())

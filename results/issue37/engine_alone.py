"""The engine process when it is the bottleneck: jobs of DOCS corpus documents sent over its real link (no HTTP,
no tokenizing: each job is packed once, from the card the engine hands over) by P client processes holding C jobs
in flight each, for S seconds after a second of warm-up. Prints the engine process's CPU per job (from /proc, all
its threads), its batches per job and the simulated device's busy share (/metrics), with the engine as loaded as
it would be behind many front-ends, where bench_host.py on two shared cores measures it half idle. Whichever of
the engine's core and the device is nearer 100% is the limit.

    jaxserve serve --simulate-device 400 --workers 2 --port 8950 &   # the engine is a process of its own from 2
    python results/issue37/engine_alone.py http://127.0.0.1:8950 DOCS C S [P]
    PIN=1 ...    # the engine on a core of its own (the last), the clients on the rest: as on a larger host
    JOIN=0 ...   # one-document jobs sent one by one (by default a turn's are joined, as a front-end's are)
    FLOOR=1 ...  # then bench_host's floor for requests of DOCS documents (base64), measured here, and the engine's
                 # CPU per job as a share of it (the issue's "engine at most 10% of the floor")
"""
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
import urllib.request

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

import harness  # noqa: E402

from jaxserve.scheduling.batcher import BULK, INTERACTIVE  # noqa: E402
from jaxserve.scheduling.jobs import Job  # noqa: E402
from jaxserve.scheduling.link import EngineLink  # noqa: E402
from jaxserve.scheduling.planner import pack  # noqa: E402


def engine_socket(pid: int) -> str:
    return next(c.laddr for c in psutil.Process(pid).net_connections(kind="unix") if c.laddr.endswith("engine.sock"))


async def connected(path: str):
    """(a link to the engine at `path`, the model view it handed over, its pooled table), once it is ready."""
    link = EngineLink(path)
    await link.start()
    await link.settled(60)
    view = link.card["encoder"]
    return link, view, view.engine.tables["pooled"]


def corpus_jobs(view, table, docs: int, seed: int = 0) -> list:
    """16 jobs' (rows, pieces) of `docs` corpus documents each (the `seed`-th 16 of them), tokenized by the model
    view the engine handed over and packed on its table, once: a client then sends them over and over."""
    corpus = harness.documents(4000, seed=0)
    made = []
    for k in range(16):
        pieces = view.tokenizer.documents([corpus[((seed * 16 + k) * docs + j) % len(corpus)] for j in range(docs)])
        made.append((pack(pieces.lengths, table), pieces))
    return made


def client(path: str, docs: int, inflight: int, start: float, end: float, seed: int, q) -> None:
    async def main():
        link, view, table = await connected(path)
        made = corpus_jobs(view, table, docs, seed)
        cls = INTERACTIVE if docs == 1 else BULK
        join = os.environ.get("JOIN", "1") != "0"
        counted = 0

        async def one(i):
            nonlocal counted
            while time.time() < end:
                rows, p = made[i % 16]
                i += 1
                await link.run(Job(rows, p.ids, p.offsets, p.types, view.out_dim), cls, join=join)
                counted += start <= time.time() <= end

        await asyncio.gather(*(one(7 * k) for k in range(inflight)))
        await link.stop()
        q.put(counted)

    asyncio.run(main())


def counters(url: str) -> tuple[float, float]:
    """(batches so far, the device's busy seconds so far) from /metrics."""
    lines = urllib.request.urlopen(url + "/metrics").read().decode().splitlines()
    total = lambda prefix: sum(float(line.split()[-1]) for line in lines if line.startswith(prefix))
    return total("jaxserve_batches_total{"), total("jaxserve_device_busy_seconds_total")


if __name__ == "__main__":
    url, docs, inflight, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    procs = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    processes = json.loads(urllib.request.urlopen(url + "/info").read())["processes"]
    engine = psutil.Process(processes["engine"])
    path = engine_socket(engine.pid)
    ALL_CORES = os.sched_getaffinity(0)
    if os.environ.get("PIN") == "1":  # the engine's threads on the last core; the rest (the clients too) not
        cores = sorted(os.sched_getaffinity(0))
        others = [processes.get("supervisor"), *processes.get("frontends", [])]
        for pid, where in [(engine.pid, {cores[-1]}), *((p, set(cores[:-1])) for p in others if p)]:
            for thread in psutil.Process(pid).threads():
                os.sched_setaffinity(thread.id, where)
        os.sched_setaffinity(0, set(cores[:-1]))
    start = time.time() + 3.0 + procs  # the clients' start (imports, their jobs) and a second of load before it
    end = start + seconds
    q = mp.Queue()
    ps = [mp.Process(target=client, args=(path, docs, inflight, start, end, k, q)) for k in range(procs)]
    for p in ps:
        p.start()
    time.sleep(start - time.time())
    cpu0, (b0, busy0) = sum(engine.cpu_times()[:2]), counters(url)
    time.sleep(end - time.time())
    cpu1, (b1, busy1) = sum(engine.cpu_times()[:2]), counters(url)
    n = sum(q.get(timeout=60) for _ in ps)  # a client that failed raises queue.Empty here, not a hang
    for p in ps:
        p.join()
    print(f"docs={docs} inflight={procs}x{inflight} jobs/s={n / seconds:.0f} engine_cpu_ms/job={1e3 * (cpu1 - cpu0) / n:.3f} "
          f"engine_cores={(cpu1 - cpu0) / seconds:.2f} batches/job={(b1 - b0) / n:.2f} "
          f"device_busy={100 * (busy1 - busy0) / seconds:.0f}%")
    if os.environ.get("FLOOR") == "1":
        import bench_host

        os.sched_setaffinity(0, ALL_CORES)  # as bench_host measures it: not pinned (PIN=1 pinned this process)

        info = json.loads(urllib.request.urlopen(url + "/info").read())
        bodies = bench_host.request_bodies(harness.documents(4000, seed=0), docs, "base64")
        floor = bench_host.floor_ms(bodies, "base64", info["dimensions"], info["max_input_length"], None)["total"]
        print(f"floor {floor:.3f} ms/request; the engine's CPU per job {100 * 1e3 * (cpu1 - cpu0) / n / floor:.1f}% of it")

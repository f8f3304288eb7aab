"""Where the ENGINE process's CPU per job goes, by step: the engine of `jaxserve serve --simulate-device 400
--workers 2` started alone (as engine_callgrind.py starts it) with its steps wrapped to add up their own thread's
CPU time (`time.thread_time_ns`, inclusive: a step's figure holds the steps it calls), fed jobs of DOCS corpus
documents over its real link by one client process, C in flight, for S seconds after a second of warm-up. With
PIN=1 the engine runs on the last core and the client on the others (as engine_alone.py's PIN=1).

    results/issue37/engine_sections.py DOCS C S [TREE]
    EXTRA="--host-dispatch-us 300" ...    # more `jaxserve serve` flags for the engine

Prints, per job: the engine's CPU (all its threads, /proc), then each step's CPU, calls and CPU per call. What
the steps do not cover is the event loop's own work, the threads' hand-offs and the wrappers' clock reads (two
per call, a fraction of a microsecond each). Then how often the prepare thread looked for a dispatch and found
none; with `git apply results/issue37/prepare_wakes.patch` in TREE (a throwaway copy), also each look by what
woke it (the first look after preparing a batch, a job's arrival, a batch leaving the device, a timeout), the
pipeline's batches then in flight and whether it found one, the CPU those looks took, and the dispatches formed.
"""
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

here = Path(__file__).resolve().parent
docs, conc, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
tree = Path(sys.argv[4]).resolve() if len(sys.argv) > 4 else here.parent.parent
py = os.environ.get("PYTHON", str(here.parent.parent / ".venv" / "bin" / "python"))
sys.path[:0] = [str(tree), str(tree / "scripts"), str(here)]

# The engine's steps, wrapped before it starts: (module, owner or None for a module function, name)
STEPS = [
    ("jaxserve.scheduling.wire", "Wire", "buffer_updated"), ("jaxserve.scheduling.wire", "Wire", "_decode"),
    ("jaxserve.scheduling.wire", "Wire", "_write"),
    ("jaxserve.scheduling.link", "LinkServer", "_run"), ("jaxserve.scheduling.link", "LinkServer", "_answer"),
    ("jaxserve.scheduling.pipeline", "Pipeline", "submit"), ("jaxserve.scheduling.pipeline", "Pipeline", "_kick"),
    ("jaxserve.scheduling.pipeline", "Pipeline", "_take"), ("jaxserve.scheduling.pipeline", "Pipeline", "_prepare"),
    ("jaxserve.scheduling.pipeline", "Pipeline", "_launch_ready"),
    ("jaxserve.scheduling.pipeline", "Pipeline", "_free_slot"),
    ("jaxserve.scheduling.pipeline", "Pipeline", "_answer_all"),
    ("jaxserve.scheduling.pipeline", None, "assemble"), ("jaxserve.scheduling.pipeline", None, "scatter"),
    ("jaxserve.scheduling.batcher", "Batcher", "submit"), ("jaxserve.scheduling.batcher", "Batcher", "next_dispatch"),
    ("jaxserve.scheduling.batcher", None, "_by_seqlen"), ("jaxserve.scheduling.batcher", "Batcher", "waiting"),
    ("jaxserve.scheduling.batcher", "Batcher", "_form"), ("jaxserve.scheduling.jobs", "Job", "__setstate__"),
    ("jaxserve.scheduling.batcher", "Batcher", "_take"), ("jaxserve.scheduling.batcher", None, "by_job"),
    ("jaxserve.scheduling.batcher", None, "merged_rows"), ("jaxserve.scheduling.batcher", "Run", "split"),
    ("jaxserve.scheduling.pipeline", None, "most_per_row"), ("jaxserve.scheduling.pipeline", None, "spanned"),
    ("jaxserve.scheduling.pipeline", "Pipeline", "_dispatch"), ("jaxserve.scheduling.jobs", "Job", "put"),
    ("jaxserve.runtime.output_chunks", None, "join"), ("jaxserve.scheduling.prepared", "PreparedQueue", "put"),
    ("jaxserve.scheduling.prepared", "PreparedQueue", "take"),
    ("jaxserve.runtime.simulated", "SimEngine", "put"), ("jaxserve.runtime.simulated", "SimEngine", "launch"),
    ("jaxserve.runtime.simulated", "SimEngine", "fetch"),
    *(("jaxserve.http.metrics", "EngineMetrics", m) for m in ("dispatched", "phase", "device_busy", "sequences",
                                                                "class_sequences", "dispatch_time", "finished")),
]

LAUNCH = """
import collections, functools, importlib, inspect, json, os, sys, threading, time
steps, out = json.loads(sys.argv[3]), sys.argv[4]
acc = collections.defaultdict(lambda: [0, 0])
clock = time.thread_time_ns
NONE = ("Pipeline._take", "Batcher.next_dispatch")

def timed(f, label):
    @functools.wraps(f)
    def step(*a, **k):
        t = clock()
        try:
            r = f(*a, **k)
            if r is None and label in NONE:  # a dispatch looked for and not found
                acc[label + ": none"][1] += 1
            if label == "EngineMetrics.device_busy":  # the simulated device's busy seconds: its work per job
                acc["device: busy"][0] += int(a[1] * 1e9)
            return r
        finally:
            e = acc[label]
            e[0] += clock() - t
            e[1] += 1
    return step

for module, owner, name in steps:
    m = importlib.import_module(module)
    where = getattr(m, owner) if owner else m
    f = timed(getattr(where, name), f"{owner}.{name}" if owner else name)
    static = owner and isinstance(inspect.getattr_static(where, name), staticmethod)
    setattr(where, name, staticmethod(f) if static else f)

def dump():
    while True:
        time.sleep(0.5)
        with open(out + ".tmp", "w") as fh:  # the steps and the process's CPU (every thread) in one snapshot
            wakes = getattr(sys.modules.get("jaxserve.scheduling.pipeline"), "WAKES", {})  # prepare_wakes.patch's
            json.dump({"cpu_s": time.process_time(), "steps": dict(acc),
                       "wakes": {repr(k): v for k, v in wakes.items()}}, fh)
        os.replace(out + ".tmp", out)

threading.Thread(target=dump, daemon=True).start()
from jaxserve.cli import build_parser, serve_config
from jaxserve.http.workers import engine_main
args = build_parser().parse_args(["serve", "--simulate-device", "400", "--workers", "2", *os.environ.get("EXTRA", "").split()])
first = {"first": False} if "first" in inspect.signature(engine_main).parameters else {}  # trees before 889d65d
engine_main(serve_config(args), sys.argv[1], sys.argv[2], parent=os.getppid(), **first)
"""


def client(path: str, run_s: float, q) -> None:
    """engine_alone.py's client: jobs packed once from the card, sent over the link, `conc` in flight; it says when
    the engine is ready and its load starts (on `q`), and sends for `run_s` from then."""
    from engine_alone import corpus_jobs

    from jaxserve.scheduling.batcher import BULK, INTERACTIVE
    from jaxserve.scheduling.jobs import Job
    from jaxserve.scheduling.link import EngineLink

    async def main():
        link = EngineLink(path)
        await link.start()
        while link.card is None or not link.status.get("ready"):
            await asyncio.sleep(0.2)
        view = link.card["encoder"]
        made = corpus_jobs(view, view.engine.tables["pooled"], docs)
        cls = INTERACTIVE if docs == 1 else BULK
        end = time.time() + run_s
        q.put(time.time())

        async def one(i):
            while time.time() < end:
                rows, p = made[i % 16]
                i += 1
                await link.run(Job(rows, p.ids, p.offsets, p.types, view.out_dim), cls, join=False)

        await asyncio.gather(*(one(7 * k) for k in range(conc)))
        await link.stop()

    asyncio.run(main())


def main() -> None:
    import multiprocessing as mp

    out = Path(tempfile.mkdtemp())
    path, sections = str(out / "engine.sock"), out / "sections.json"
    (out / "m").mkdir()
    from jaxserve.runtime.host import malloc_env

    malloc, preload = malloc_env("auto", os.environ)  # the allocator `--workers 2` preloads into its engine
    env = dict(os.environ, PYTHONPATH=str(tree), PROMETHEUS_MULTIPROC_DIR=str(out / "m"), **preload)
    engine = subprocess.Popen([py, "-c", LAUNCH, path, str(out), json.dumps(STEPS), str(sections)], env=env,
                              cwd=tree, stdout=open(out / "log", "w"), stderr=subprocess.STDOUT)
    try:
        while not os.path.exists(path):
            time.sleep(0.2)
        if os.environ.get("PIN") == "1":  # the engine's threads on the last core, the client on the others
            cores = sorted(os.sched_getaffinity(0))
            for thread in psutil.Process(engine.pid).threads():
                os.sched_setaffinity(thread.id, {cores[-1]})
            os.sched_setaffinity(0, set(cores[:-1]))
        q = mp.get_context("spawn").Queue()
        c = mp.get_context("spawn").Process(target=client, args=(path, seconds + 3.0, q))
        c.start()
        began = q.get(timeout=300)
        time.sleep(max(0.0, began + 1.0 - time.time()))  # a second of load first
        first = json.loads(sections.read_text())
        time.sleep(seconds)
        last = json.loads(sections.read_text())
        c.join(120)
    finally:
        engine.terminate()
        engine.wait(60)
    a, b = first["steps"], last["steps"]
    d = {k: (v[0] - a.get(k, [0, 0])[0], v[1] - a.get(k, [0, 0])[1]) for k, v in b.items()}
    jobs = d["Pipeline.submit"][1]
    cpu = last["cpu_s"] - first["cpu_s"]
    planned = [line for line in (out / "log").read_text().splitlines() if "batch sizes planned for" in line]
    print(f"docs={docs} inflight={conc} malloc={malloc} jobs={jobs}: engine CPU {1e3 * cpu / jobs:.3f} ms/job (every thread); "
          f"batches per job {d['Pipeline._prepare'][1] / jobs:.2f}; the device busy {d['device: busy'][0] / jobs / 1e6:.3f} ms/job; "
          f"{planned[-1].split(': ', 1)[-1] if planned else 'batch sizes planned for the warm-up host time'}; "
          "its steps, inclusive, per job:")
    for k, (ns, n) in sorted(d.items(), key=lambda kv: -kv[1][0]):
        if k.endswith(": none") or k.startswith("device: "):
            continue
        print(f"  {k:30s} {ns / jobs / 1e3:7.1f} us  {n / jobs:5.2f} calls  {ns / max(n, 1) / 1e3:7.1f} us/call")
    for k in sorted(k for k in d if k.endswith(": none")):
        print(f"  {k[:-6]} found no dispatch: {d[k][1] / jobs:.2f} calls per job")
    w0, w1 = first.get("wakes", {}), last.get("wakes", {})
    for k in sorted(w1):  # with prepare_wakes.patch applied to TREE: the prepare thread's looks, by what woke it
        print(f"  wake {k:50s} {(w1[k] - w0.get(k, 0)) / jobs:9.3f} per job")


if __name__ == "__main__":
    main()

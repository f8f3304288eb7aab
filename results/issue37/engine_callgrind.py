"""Instructions per job of the ENGINE process, counted by callgrind (deterministic where this VM's timings drift):
the engine of `jaxserve serve --simulate-device 400 --workers 2` started alone under valgrind, fed jobs of DOCS
corpus documents over its real link (as engine_alone.py feeds it: no HTTP, no tokenizing), C in flight.

    results/issue37/engine_callgrind.py DOCS [N] [C] [TREE]     # prints instructions per job
    KEEP=FILE ...   # keeps the callgrind profile (callgrind_annotate FILE)

Under callgrind the engine is ~50x slower than the simulated device, so its queue is always full and its batches
as full as they get: the count is of an engine loaded as behind many front-ends, not of an idle one. The host's
time per dispatch is fixed (`--host-dispatch-us 300`, about what the engine measures of itself on this VM): measured
under callgrind it would be 50x too long, and replanning the batch sizes mid-count would be counted too. Count
memset and memcpy apart (callgrind_annotate): a byte or two per instruction, where their time is a few percent.
"""
import asyncio
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

here = Path(__file__).resolve().parent
docs = int(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
conc = int(sys.argv[3]) if len(sys.argv) > 3 else 4
tree = Path(sys.argv[4]).resolve() if len(sys.argv) > 4 else here.parent.parent
py = os.environ.get("PYTHON", str(here.parent.parent / ".venv" / "bin" / "python"))
sys.path[:0] = [str(tree), str(tree / "scripts")]

LAUNCH = """
import inspect, os, sys
from jaxserve.cli import build_parser, serve_config
from jaxserve.http.workers import engine_main
args = build_parser().parse_args(["serve", "--simulate-device", "400", "--workers", "2", "--host-dispatch-us", "300"])
first = {"first": False} if "first" in inspect.signature(engine_main).parameters else {}  # trees before 889d65d
engine_main(serve_config(args), sys.argv[1], sys.argv[2], parent=os.getppid(), **first)
"""


async def feed(path: str, vg: int) -> None:
    from engine_alone import corpus_jobs

    from jaxserve.scheduling.batcher import BULK, INTERACTIVE
    from jaxserve.scheduling.jobs import Job
    from jaxserve.scheduling.link import EngineLink

    link = EngineLink(path)
    await link.start()
    while link.card is None:  # warming, or not listening yet
        await asyncio.sleep(0.5)
    view = link.card["encoder"]
    made = corpus_jobs(view, view.engine.tables["pooled"], docs)
    cls = INTERACTIVE if docs == 1 else BULK

    async def run(count):
        todo = iter(range(count))

        async def worker():
            for i in todo:
                rows, p = made[i % 16]
                await link.run(Job(rows, p.ids, p.offsets, p.types, view.out_dim), cls, join=False)

        await asyncio.gather(*(worker() for _ in range(conc)))

    await run(100)
    subprocess.run(["callgrind_control", "-i", "on", str(vg)], check=True, capture_output=True)
    await run(20)
    subprocess.run(["callgrind_control", "-z", str(vg)], check=True, capture_output=True)
    await run(n)
    subprocess.run(["callgrind_control", "-d", str(vg)], check=True, capture_output=True)
    await link.stop()


def main() -> None:
    out = Path(tempfile.mkdtemp())
    path = str(out / "engine.sock")
    env = dict(os.environ, PYTHONPATH=str(tree), PROMETHEUS_MULTIPROC_DIR=str(out / "m"),
               GLIBC_TUNABLES="glibc.malloc.tcache_count=1024")
    (out / "m").mkdir()
    vg = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.out",
                           py, "-c", LAUNCH, path, str(out)], env=env, cwd=tree,
                          stdout=open(out / "log", "w"), stderr=subprocess.STDOUT)
    try:
        asyncio.run(feed(path, vg.pid))
    finally:
        vg.terminate()
        vg.wait(60)
    totals = {f: max(int(m.group(1)) for m in re.finditer(r"^(?:summary|totals): (\d+)", f.read_text(), re.MULTILINE))
              for f in out.glob("cg.out*")}
    profile = max(totals, key=totals.get)  # the dump after the counted jobs (the one at exit holds the rest)
    ir = totals[profile]
    annotated = subprocess.run(["callgrind_annotate", str(profile)], capture_output=True, text=True).stdout
    mem = sum(int(m.group(1).replace(",", "")) for m in re.finditer(r"^\s*([\d,]+) .*(?:memset|memmove|memcpy)",
                                                                     annotated, re.MULTILINE))
    print(f"engine {tree.name}: {ir // n} instructions per job of {docs} documents ({n} jobs, {conc} in flight), "
          f"{mem // n} of them memset and memcpy")
    if os.environ.get("KEEP"):
        import shutil
        shutil.copy(profile, os.environ["KEEP"])


if __name__ == "__main__":
    main()

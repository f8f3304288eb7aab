"""Server CPU per request against the floor, slice by slice: this VM's speed moves within a minute (the floor read
0.094 and 0.166 ms a minute apart), so a ratio of a 6 s load to a floor measured before or after it moves with it.
Here the load comes in SLICES short slices (bench_host's client, `harness.closed_loop`, SECONDS each), each between
two floors (bench_host.floor_ms, at least 0.3 s of CPU each), and each slice's ratio is taken against the mean of
the floors either side of it; the median over slices is the measurement.

    python results/issue37/sliced_load.py URL [DOCS] [SLICES] [SECONDS] [CONC] [PID]   # defaults: 1 8 2 32
    # PID: a server whose /info has no `processes` (25e1f16's bench_host server)
"""
import json
import os
import statistics
import sys
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

import bench_host
import harness
import psutil


def main():
    url = sys.argv[1]
    docs, slices, seconds, conc = (int(sys.argv[2]) if len(sys.argv) > 2 else 1, int(sys.argv[3]) if len(sys.argv) > 3
                                   else 8, float(sys.argv[4]) if len(sys.argv) > 4 else 2.0,
                                   int(sys.argv[5]) if len(sys.argv) > 5 else 32)
    info = json.loads(urllib.request.urlopen(url + "/info").read())
    procs = {"engine": int(sys.argv[6])} if len(sys.argv) > 6 else info["processes"]
    pids = sorted({p for p in [procs.get("engine"), *procs.get("frontends", [])] if p})
    bodies = bench_host.request_bodies(harness.documents(4000, seed=0), docs, "base64")

    def floor() -> float:
        return bench_host.floor_ms(bodies, "base64", info.get("dimensions", 384), info.get("max_input_length", 256),
                                   None, repeats=2, min_s=0.3)["total"]

    def cpu() -> float:
        return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)

    floors, loads = [floor()], []
    for _ in range(slices):
        before = []
        load = harness.closed_loop(url, "/v1/embeddings", bodies, conc, seconds, max_requests=100_000,
                                   on_start=lambda: before.append(cpu()))
        loads.append((load.requests, 1e3 * (cpu() - before[0]) / load.requests, load.requests / load.wall_s))
        floors.append(floor())
    ratios = [ms / ((floors[i] + floors[i + 1]) / 2) for i, (_, ms, _) in enumerate(loads)]
    print(f"docs={docs} conc={conc} slices={slices}x{seconds:g}s "
          f"req/s median {statistics.median(r for _, _, r in loads):.0f} "
          f"server_cpu_ms/req median {statistics.median(ms for _, ms, _ in loads):.3f} "
          f"floor_ms {min(floors):.3f}-{max(floors):.3f} "
          f"x_floor median {statistics.median(ratios):.2f} (slices {min(ratios):.2f}-{max(ratios):.2f})")
    print("  per slice x_floor: " + " ".join(f"{r:.2f}" for r in ratios))


if __name__ == "__main__":
    main()

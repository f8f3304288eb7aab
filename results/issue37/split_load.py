"""bench_host's client (harness.closed_loop: 32 raw keep-alive connections from 2 processes, bench_host's corpus
bodies, base64) on a running server for 6 s: requests/s, each server process's user and system CPU per request,
and bench_host's floor for the same bodies measured here just before and just after (FLOOR=0: not measured; this
VM's speed moves within a minute, so "x the floor" is given against each).

    python results/issue37/split_load.py URL DOCS [PID]   # PID: a server whose /info has no `processes`
    CONC=8 ...   # connections (default 32)
"""
import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

import bench_host
import harness
import psutil


def main():
    url, docs = sys.argv[1], int(sys.argv[2])
    info = json.loads(urllib.request.urlopen(url + "/info").read())
    procs = {"engine": int(sys.argv[3]), "frontends": []} if len(sys.argv) > 3 else info["processes"]
    roles = {"engine": procs.get("engine"), **{f"front{i}": p for i, p in enumerate(procs.get("frontends", []))}}
    pids = sorted({p for p in roles.values() if p})
    bodies = bench_host.request_bodies(harness.documents(4000, seed=0), docs, "base64")
    measure = os.environ.get("FLOOR", "1") != "0"

    def floor() -> float | None:
        return bench_host.floor_ms(bodies, "base64", info.get("dimensions", 384), info.get("max_input_length", 256),
                                   None)["total"] if measure else None

    floor_before = floor()
    before = {}
    load = harness.closed_loop(url, "/v1/embeddings", bodies, int(os.environ.get("CONC", "32")), 6.0, max_requests=100_000,
                               on_start=lambda: before.update({p: psutil.Process(p).cpu_times() for p in pids}))
    after = {p: psutil.Process(p).cpu_times() for p in pids}
    floor_after = floor()
    n = load.requests
    user = sum(after[p].user - before[p].user for p in pids)
    system = sum(after[p].system - before[p].system for p in pids)
    total = 1e3 * (user + system) / n
    print(f"docs={docs} requests={n} errors={load.errors} req/s={n / load.wall_s:.0f} server_cpu_ms/req={total:.3f} "
          f"(user {1e3 * user / n:.3f}, system {1e3 * system / n:.3f})"
          + (f" floor_ms={floor_before:.3f},{floor_after:.3f} x_floor={total / floor_before:.1f},"
             f"{total / floor_after:.1f}" if measure else "")
          + f" client_ms/req={1e3 * load.client_cpu_s / n:.3f}")
    for role, p in roles.items():
        if p:
            t = sum(after[p][:2]) - sum(before[p][:2])
            print(f"  {role} (pid {p}): {1e3 * t / n:.3f} ms/req")


if __name__ == "__main__":
    main()

"""Requests of DOCS documents (default 1) one at a time on one keep-alive connection (bench_host's bodies): p50
and p90 latency of N of them (default 1,500) after a warm-up.

    python results/issue37/lat.py PORT [DOCS] [N]
"""
import http.client
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import bench_host
import harness

port = int(sys.argv[1])
docs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
n = int(sys.argv[3]) if len(sys.argv) > 3 else 1500
bodies = bench_host.request_bodies(harness.documents(4000, seed=0), docs, "base64")
c = http.client.HTTPConnection("127.0.0.1", port)


def one(i: int) -> None:
    c.request("POST", "/v1/embeddings", bodies[i % len(bodies)], {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    assert r.status == 200, r.status


for i in range(min(200, n)):
    one(i)
ts = []
for i in range(n):
    t = time.perf_counter()
    one(i)
    ts.append(time.perf_counter() - t)
ts.sort()
print(f"p50 {ts[len(ts) // 2] * 1e3:.3f} ms  p90 {ts[int(len(ts) * 0.9)] * 1e3:.3f} ms")

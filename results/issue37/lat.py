"""One-document requests one at a time on one keep-alive connection (bench_host's bodies): p50 and p90 latency.

    python results/issue37/lat.py PORT
"""
import http.client
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import bench_host
import harness

port = int(sys.argv[1])
bodies = bench_host.request_bodies(harness.documents(4000, seed=0), 1, "base64")
c = http.client.HTTPConnection("127.0.0.1", port)


def one(i: int) -> None:
    c.request("POST", "/v1/embeddings", bodies[i % len(bodies)], {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    assert r.status == 200, r.status


for i in range(200):
    one(i)
ts = []
for i in range(1500):
    t = time.perf_counter()
    one(i)
    ts.append(time.perf_counter() - t)
ts.sort()
print(f"p50 {ts[len(ts) // 2] * 1e3:.3f} ms  p90 {ts[int(len(ts) * 0.9)] * 1e3:.3f} ms")

"""N one-document requests (bench_host.py's bodies, base64) on K keep-alive connections (default 1: one at a time),
each connection sending its next when the last is answered."""
import http.client
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import bench_host  # noqa: E402
import harness  # noqa: E402

port, n = int(sys.argv[1]), int(sys.argv[2])
start = int(sys.argv[3]) if len(sys.argv) > 3 else 0
conns = int(sys.argv[4]) if len(sys.argv) > 4 else 1
bodies = bench_host.request_bodies(harness.documents(4000, seed=0), 1, "base64")


def send(first: int, count: int) -> None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    for i in range(first, first + count):
        c.request("POST", "/v1/embeddings", bodies[i % len(bodies)], {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        assert r.status == 200, r.status


threads = [threading.Thread(target=send, args=(start + k * (n // conns), n // conns)) for k in range(conns)]
for t in threads:
    t.start()
for t in threads:
    t.join()

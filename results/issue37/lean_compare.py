"""jaxserve's front-ends against the lean ones (`lean_frontend.py`) on the same engine, one-document requests,
bench_host.py's client and floor, the order alternating per round:

    python results/issue37/lean_compare.py ROUNDS SECONDS CONNS URL...  (e.g. :8811 jaxserve, :8812 lean)
"""
import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

import bench_host  # noqa: E402
import harness  # noqa: E402

if __name__ == "__main__":
    rounds, seconds, conns, urls = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    info = json.loads(urllib.request.urlopen(urls[0] + "/info").read())
    bodies = bench_host.request_bodies(harness.documents(4000, seed=0), 1, "base64")
    floor = bench_host.floor_ms(bodies, "base64", info["dimensions"], info["max_input_length"], None)
    print(f"floor: {floor['total']:.3f} ms (tokenize {floor['tokenize']:.3f})")
    for r in range(rounds):
        for url in (urls if r % 2 == 0 else urls[::-1]):
            processes = json.loads(urllib.request.urlopen(url + "/info").read())["processes"]
            row = bench_host.run_level(url, processes, bodies, 1, conns, seconds, 2)
            cpu = row["cpu_ms_per_request"]
            print(f"round {r + 1} {url}: {row['docs_per_s']:,.0f} req/s, engine {cpu['engine']:.3f} + front-ends "
                  f"{cpu.get('frontends', 0):.3f} = {cpu['total']:.3f} ms ({cpu['total'] / floor['total']:.1f}x the "
                  f"floor; front-ends alone {cpu.get('frontends', 0) / floor['total']:.1f}x); client "
                  f"{row['client_cpu_ms_per_request']:.3f}", flush=True)

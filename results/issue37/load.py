"""Quick closed-loop load: P client processes x C connections each, one-document requests, for S seconds."""
import asyncio, json, multiprocessing as mp, os, sys, time
import aiohttp

def client(url, conns, seconds, docs, q):
    async def main():
        # $LOAD_REPEAT: the sentence this many times per document (1: ~13 tokens; 4: ~40)
        sentence = " ".join(["the quick brown fox jumps over the lazy dog"] * int(os.environ.get("LOAD_REPEAT", "1")))
        body = json.dumps({"input": [sentence + " number %d" % i for i in range(docs)], "encoding_format": "base64"}).encode()
        bodies = [body]
        if os.environ.get("LOAD_CORPUS"):  # $LOAD_CORPUS=1: bench_host.py's bodies (its corpus, in turn) instead
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
            import bench_host, harness
            bodies = bench_host.request_bodies(harness.documents(4000, seed=0), docs, "base64")
        n = err = 0
        deadline = time.perf_counter() + seconds
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def one(k):
                nonlocal n, err
                while time.perf_counter() < deadline:
                    k += 1
                    async with s.post(url + "/v1/embeddings", data=bodies[k % len(bodies)], headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        if r.status == 200: n += 1
                        else: err += 1
            await asyncio.gather(*(one(7 * i) for i in range(conns)))
        q.put((n, err))
    asyncio.run(main())

if __name__ == "__main__":
    url, procs, conns, seconds, docs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    import psutil
    info = json.loads(__import__("urllib.request").request.urlopen(url + "/info").read())
    if len(sys.argv) > 6:  # a server without /info's processes: its pid
        info["processes"] = {"engine": int(sys.argv[6]), "frontends": []}
    pids = {info["processes"].get("engine"), *info["processes"].get("frontends", [])}
    roles = {"engine": [info["processes"].get("engine")], "front": [p for p in info["processes"].get("frontends", []) if p != info["processes"].get("engine")]}
    cpu = lambda: sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)
    rcpu = lambda: {r: sum(sum(psutil.Process(p).cpu_times()[:2]) for p in ps) for r, ps in roles.items()}
    r0 = rcpu()
    q = mp.Queue()
    c0 = cpu(); t0 = time.perf_counter()
    ps = [mp.Process(target=client, args=(url, conns, seconds, docs, q)) for _ in range(procs)]
    [p.start() for p in ps]
    res = [q.get() for _ in ps]; [p.join() for p in ps]
    wall = time.perf_counter() - t0; c1 = cpu(); r1 = rcpu()
    n = sum(r[0] for r in res); e = sum(r[1] for r in res)
    print(f"procs={procs} conns={conns} mean_latency_ms={1e3*wall*procs*conns/max(n,1):.2f} docs={docs} requests={n} errors={e} req/s={n/wall:.1f} server_cpu_ms/req={1e3*(c1-c0)/max(n,1):.2f} cores={(c1-c0)/wall:.2f} " + " ".join(f"{r}_ms/req={1e3*(r1[r]-r0[r])/max(n,1):.2f}" for r in roles))

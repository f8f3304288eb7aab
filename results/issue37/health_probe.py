"""Right after a `--workers N` server's /health first answers 200: what the next half second of requests get, each
on a new connection (so the kernel spreads them over the front-ends). Start the server, then at once:

    jaxserve serve --simulate-device 400 --workers 2 --port PORT &  python results/issue37/health_probe.py PORT
"""
import http.client, sys, time, json
port = int(sys.argv[1])
def req(method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request(method, path, body=body, headers={"content-type": "application/json"} if body else {})
        r = c.getresponse(); r.read(); return r.status
    except OSError:
        return None
    finally:
        c.close()
while req("GET", "/health") != 200:
    time.sleep(0.005)
t = time.perf_counter(); codes = {}
while time.perf_counter() - t < 0.5:
    s = req("POST", "/v1/embeddings", json.dumps({"input": "hello world"}))
    codes[s] = codes.get(s, 0) + 1
print(codes)

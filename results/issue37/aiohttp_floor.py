"""The least an aiohttp server (uvloop, no access log) spends per request: read the body, answer 200 with a
small JSON body. Measures the floor of aiohttp itself on this machine."""
import sys, uvloop, orjson
from aiohttp import web

async def handle(request):
    body = orjson.loads(await request.read())
    return web.Response(body=orjson.dumps({"data": [{"embedding": "A" * 2048, "index": 0}], "n": len(body["input"])}),
                        content_type="application/json")

app = web.Application()
app.router.add_post("/v1/embeddings", handle)
app.router.add_get("/info", lambda r: web.json_response({"processes": {"engine": __import__("os").getpid(), "frontends": []}}))
web.run_app(app, port=int(sys.argv[1]), access_log=None, print=None, loop=uvloop.new_event_loop())

"""The least a Python front-end can do for a one-document embedding request, as a bound on what jaxserve's own
front-end could reach: an aiohttp handler on uvloop that reads the body, orjson-decodes it, tokenizes the text
(the card's tokenizer, as a front-end does), packs it into a Job, runs it on a running server's engine over the
real link (joined per loop turn, as a front-end's are), normalises the vector and answers OpenAI's base64 body.
No validation, classes, limits, metrics or errors: the floor's work, aiohttp and the link, nothing else.

    jaxserve serve --simulate-device 400 --workers 2 --port 8811 &
    python results/issue37/lean_frontend.py http://127.0.0.1:8811 8812 2   # 2 lean front-ends on :8812
    python results/issue37/load.py http://127.0.0.1:8812 2 16 10 1        # its /info names them and the engine
"""
import asyncio
import base64
import json
import multiprocessing as mp
import os
import socket
import sys
import urllib.request

import numpy as np
import orjson
from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_alone import connected, engine_socket  # noqa: E402

from jaxserve.scheduling.batcher import INTERACTIVE  # noqa: E402
from jaxserve.scheduling.jobs import Job  # noqa: E402
from jaxserve.scheduling.link import EngineLink  # noqa: E402
from jaxserve.scheduling.planner import pack  # noqa: E402


def serve_jaxserve(url: str, path: str, sock: socket.socket, pids_file: str) -> None:
    """jaxserve's own front-end (what `--workers N` starts), on the same engine: for an A/B of one process each."""
    from jaxserve.cli import build_parser, serve_config
    from jaxserve.http.server import create_app, new_loop

    from jaxserve.http.state import STATE

    config = serve_config(build_parser().parse_args(["serve", "--simulate-device", "400"]))
    app = create_app(config, link=EngineLink(path))
    app[STATE].settle_heap = hasattr(app[STATE], "settle_heap")  # as `frontend_main` sets it, in a tree that has it
    web.run_app(app, sock=sock, handler_cancellation=True, print=None, access_log=None, loop=new_loop())


def serve(url: str, path: str, sock: socket.socket, pids_file: str) -> None:
    if os.environ.get("LEAN") == "jaxserve":
        return serve_jaxserve(url, path, sock, pids_file)

    async def main():
        link, view, table = await connected(path)
        tok, width, name = view.tokenizer, view.out_dim, "lean"
        # bare: no tokenizing, no engine; local: no engine; full: each request its own job (joined per turn by the
        # link); lane: the turn's requests tokenized, packed and run as one job; lanelite: tokenized one by one,
        # packed and run as one job
        mode = os.environ.get("LEAN", "full")

        lane: list = []  # LEAN=lane: (text, future) of this turn of the loop, run as one job at its end

        async def run_lane():
            batch = lane[:]
            lane.clear()
            if mode == "lanelite":  # each text tokenized on its own (as it arrived), the job built once
                each = [tok.documents([t]) for t, _ in batch]
                ids = np.concatenate([p.ids for p in each])
                offsets = np.concatenate([[0], np.cumsum([len(p.ids) for p in each])])
                pieces = type(each[0])(ids, offsets, np.arange(len(each)), np.ones(len(each)))
            else:
                pieces = tok.documents([t for t, _ in batch])  # one tokenizer call, one pack, one job for the turn
            job = Job(pack(pieces.lengths, table), pieces.ids, pieces.offsets, pieces.types, width)
            try:
                await link.run(job, INTERACTIVE, None, 30.0, join=False)
            except Exception as exc:
                for _, f in batch:
                    f.set_exception(exc)
                return
            v = job.out
            v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
            lengths = pieces.lengths.tolist()
            for i, (_, f) in enumerate(batch):
                f.set_result((v[i : i + 1], lengths[i]))

        async def embeddings(request):
            body = orjson.loads(await request.read())
            text = body["input"]
            if mode in ("lane", "lanelite"):
                f = asyncio.get_running_loop().create_future()
                if not lane:
                    asyncio.get_running_loop().call_soon(asyncio.ensure_future, run_lane())
                lane.append((text if isinstance(text, str) else text[0], f))
                v, tokens = await f
                rows = [base64.b64encode(v.tobytes()).decode("ascii")]
                return web.Response(body=orjson.dumps({
                    "object": "list", "data": [{"object": "embedding", "index": 0, "embedding": rows[0]}],
                    "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
                    content_type="application/json")
            if mode == "bare":
                return web.Response(body=b'{"object": "list"}', content_type="application/json")
            pieces = tok.documents(text if isinstance(text, list) else [text])
            job = Job(pack(pieces.lengths, table), pieces.ids, pieces.offsets, pieces.types, width)
            if mode == "full":
                await link.run(job, INTERACTIVE, None, 30.0)
            v = job.out
            v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
            rows = [base64.b64encode(r.tobytes()).decode("ascii") for r in v]
            tokens = int(pieces.lengths.sum())
            return web.Response(body=orjson.dumps({
                "object": "list", "data": [{"object": "embedding", "index": i, "embedding": r}
                                           for i, r in enumerate(rows)],
                "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
                content_type="application/json")

        async def info_route(request):  # the server's /info, with these processes (bench_host.py reads them)
            info = json.loads(urllib.request.urlopen(url + "/info").read())
            with open(pids_file) as f:
                info["processes"] = json.load(f)
            return web.json_response(info)

        async def metrics_route(request):  # the server's (the engine's counters: device busy time)
            return web.Response(body=urllib.request.urlopen(url + "/metrics").read(), content_type="text/plain")

        app = web.Application()
        app.router.add_post("/v1/embeddings", embeddings)
        app.router.add_get("/info", info_route)
        app.router.add_get("/metrics", metrics_route)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        await asyncio.Event().wait()

    import uvloop
    uvloop.run(main())


if __name__ == "__main__":
    url, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if n == 0:  # this process only, in the foreground (to run it under valgrind: frontend_callgrind.sh)
        engine = json.loads(urllib.request.urlopen(url + "/info").read())["processes"]["engine"]
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        s.listen(64)
        pids_file = f"/tmp/lean-{port}.json"
        with open(pids_file, "w") as f:
            json.dump({"engine": engine, "frontends": [os.getpid()]}, f)
        if os.environ.get("PROFILE"):  # $PROFILE: cProfile's stats of this process, written when it is stopped
            import cProfile
            with cProfile.Profile() as prof:
                try:
                    serve(url, engine_socket(engine), s, pids_file)
                finally:
                    prof.dump_stats(os.environ["PROFILE"])
        else:
            serve(url, engine_socket(engine), s, pids_file)
        sys.exit()
    engine = json.loads(urllib.request.urlopen(url + "/info").read())["processes"]["engine"]
    path = engine_socket(engine)
    socks = []
    for _ in range(n):  # a listening socket per process, as jaxserve's front-ends have (SO_REUSEPORT)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", port))
        s.listen(1024)
        socks.append(s)
    pids_file = f"/tmp/lean-{port}.json"
    procs = [mp.get_context("fork").Process(target=serve, args=(url, path, s, pids_file)) for s in socks]
    for p in procs:
        p.start()
    with open(pids_file, "w") as f:
        json.dump({"engine": engine, "frontends": [p.pid for p in procs]}, f)
    for p in procs:
        p.join()

"""scripts/bench_host.py's projection and command line, and harness's closed-loop client (real sockets, a real
aiohttp server on loopback; bounded by request counts, never by time)."""

import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

import bench_host
import harness
from bench_host import PerRequest, basis, per_request, process_kinds, project, server_flags


def test_the_least_bound_limits_the_projection():
    # e 0.4 ms, f 7.6 ms, d 0.25 ms per request of 100 documents and 4000 tokens
    per = PerRequest(engine_s=0.4e-3, frontend_s=7.6e-3, device_s=0.25e-3, docs=100, tokens=4000)
    eight = project(per, 8)  # cores: 8 / 8 ms = 1000/s; engine 2500/s; device 4000/s
    assert eight["limit"] == "front-end CPU"
    assert eight["requests_per_s"] == pytest.approx(1000)
    assert (eight["docs_per_s"], eight["tokens_per_s"]) == (pytest.approx(1e5), pytest.approx(4e6))
    assert eight["device_busy"] == pytest.approx(0.25)
    assert project(per, 16)["limit"] == "front-end CPU"  # 2000/s
    thirty_two = project(per, 32)  # cores 4000/s: the engine's one process, 2500/s, is the wall
    assert (thirty_two["limit"], thirty_two["requests_per_s"]) == ("engine CPU", pytest.approx(2500))
    slow = project(PerRequest(0.4e-3, 7.6e-3, 1e-3, 100, 4000), 16)
    assert (slow["limit"], slow["requests_per_s"], slow["device_busy"]) == ("device", pytest.approx(1000),
                                                                            pytest.approx(1.0))
    unknown = project(PerRequest(0.4e-3, 7.6e-3, None, 100, 4000), 8)
    assert unknown["device_busy"] is None and unknown["limit"] == "front-end CPU"


def row(workers, docs_per_s, split=True, engine=1.0, total=8.0, device=0.2, clock=None):
    return {"workers": workers, "docs_per_s": docs_per_s, "requests": 10, "docs": 100, "tokens_per_request": 4000.0,
            "split": split, "cpu_ms_per_request": {"engine": engine, "total": total},
            "device_ms_per_request": device, "clock_ms_per_request": clock}


def test_one_process_counts_all_its_cpu_as_serial():
    per = per_request(row(1, 10.0, split=False, engine=8.0, total=8.0))
    assert (per.engine_s, per.frontend_s) == (pytest.approx(8e-3), 0.0)
    assert project(per, 32)["limit"] == "engine CPU"
    split = per_request(row(2, 10.0, engine=1.0, total=8.0, device=0.5, clock=0.2))
    assert (split.engine_s, split.frontend_s, split.device_s) == (pytest.approx(1e-3), pytest.approx(7e-3),
                                                                  pytest.approx(0.2e-3))  # the clock's own time


def test_the_basis_is_the_busiest_level_of_the_most_workers():
    rows = [row(1, 900.0), row(2, 500.0), row(2, 700.0), row(2, 600.0)]
    assert basis(rows) is rows[2]
    assert basis([]) is None


def test_one_process_is_counted_once():
    assert process_kinds({"engine": 7, "frontends": [7]}) == ({"server": [7]}, False)
    kinds, split = process_kinds({"supervisor": 1, "engine": 2, "frontends": [3, 4]})
    assert split and kinds == {"engine": [2], "frontends": [3, 4], "supervisor": [1]}


def test_the_command_line():
    args = bench_host.build_parser().parse_args([])
    assert (args.docs, args.workers, args.concurrency) == ([1, 16, 100], [1, 2], [8, 64])
    assert args.sizes == [("checkpoint", None), ("bge-base", (768, 3072, 12))]
    smoke = bench_host.build_parser().parse_args(["--seconds", "2", "--docs", "1", "--concurrency", "4",
                                                 "--sizes", "checkpoint,1024x4096x24", "--workers", "2"])
    assert (smoke.seconds, smoke.docs, smoke.concurrency) == (2.0, [1], [4])
    assert smoke.sizes[1] == ("1024x4096x24", (1024, 4096, 24))
    flags = server_flags(smoke, (768, 3072, 12), 2)
    assert flags[:2] == ["--workers", "2"] and "--simulate-device" in flags
    assert flags[flags.index("--simulate-size") + 1] == "768,3072,12"
    assert "--simulate-size" not in server_flags(smoke, None, 1)
    real = bench_host.build_parser().parse_args(["--engine", "real", "--serve-args", "--max-wait-ms 3"])
    assert server_flags(real, None, 1) == ["--workers", "1", "--no-embed-all", "--max-wait-ms", "3"]
    for bad in (["--docs", "0"], ["--docs", "a"], ["--sizes", "bge-huge"], ["--workers", ""]):
        with pytest.raises(SystemExit):
            bench_host.build_parser().parse_args(bad)


BODY = b'{"object":"list","data":[],"usage":{"prompt_tokens": 7,"total_tokens":7}}'
STREAM = (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Type: application/json\r\n\r\n" % len(BODY) + BODY
          + b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 2\r\n\r\n{}"
          + b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
          + b"%x\r\n" % 20 + BODY[:20] + b"\r\n" + b"%x\r\n" % (len(BODY) - 20) + BODY[20:] + b"\r\n0\r\n\r\n")


@pytest.mark.parametrize("piece", [1, 7, len(STREAM)])
def test_responses_are_cut_off_the_stream_however_it_arrives(piece):
    parser = harness.HttpResponses(harness.prompt_tokens)
    got = [r for i in range(0, len(STREAM), piece) for r in parser.feed(STREAM[i : i + piece])]
    assert got == [(200, 7), (500, 0), (200, 7)]
    assert harness.HttpResponses().feed(STREAM)[1] == (500, b"{}")


@pytest.fixture
def loopback_server():
    """An aiohttp server on its own thread: prompt_tokens 7 for a body without "fail", else 500; its /info shows
    a bucket table from the third time it is asked (the front-end that has the engine's card), not before."""
    from aiohttp import web

    infos = []

    async def info(request):
        infos.append(True)
        return web.json_response({"processes": {}, **({"buckets": {"buckets": []}} if len(infos) >= 3 else {})})

    async def embeddings(request):
        body = await request.read()
        if b"fail" in body:
            return web.Response(status=500, body=b"{}")
        return web.Response(body=BODY, content_type="application/json")

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/info", info)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_closed_loop_counts_every_answer(loopback_server):
    started = []
    load = harness.closed_loop(loopback_server, "/v1/embeddings", [b'{"input": "a"}', b'{"fail": 1}'],
                               concurrency=4, seconds=120, processes=2, max_requests=40,
                               on_start=lambda: started.append(True), timeout_s=60)
    # each process sends its 20, alternating between the two bodies: half answered, half failed
    assert started == [True]
    assert (load.requests, load.errors, load.tokens) == (20, 20, 140)
    assert len(load.latencies) == 20 and load.wall_s > 0


def test_a_servers_table_is_read_from_a_front_end_that_has_it(loopback_server):
    """`--workers N`: /health says 200 once one front-end has the engine's card; another may not have its own yet."""
    assert "buckets" not in json.loads(harness.get(loopback_server, "/info"))
    assert harness.ready_info(loopback_server, poll_s=0.01)["buckets"] == {"buckets": []}


def test_the_floor_times_past_its_cold_pass_for_at_least_its_minimum():
    """The floor's mean covers whole passes after the first (cold) one, at least `repeats` of them and at least
    `min_s` of CPU in all, whatever the machine's speed: one-document requests take many passes to reach it."""
    bodies = bench_host.request_bodies(harness.documents(200, seed=0), 1, "base64")
    used = len(bodies)  # a pass of one-document requests is every body
    f = bench_host.floor_ms(bodies, "base64", 384, 256, None, repeats=2, min_s=0.2)
    assert f["requests"] % used == 0 and f["requests"] >= 2 * used
    assert f["requests"] * f["total"] >= 0.2 * 1e3 * 0.999  # ms: the CPU it timed, at least min_s
    assert f["total"] == pytest.approx(f["decode"] + f["tokenize"] + f["encode"])

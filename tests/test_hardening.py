"""Hostile input and sustained load against a real `jaxserve serve` process on loopback (bounded)."""

import asyncio
import dataclasses
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import tiny
from conftest import TINY_TABLE, SlowEngine, until, warm_encoder

from jaxserve.http.state import STATE
from jaxserve.integrations.launch import free_port, served

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hard")
    path = tiny.write_checkpoint(root / "ckpt")
    TINY_TABLE.save(root / "table.json")
    return path, root / "table.json"


def test_schemathesis_fuzz_finds_no_server_error(tiny_files):
    path, table = tiny_files
    port = free_port()
    with served(port, "--model", str(path), "--buckets", str(table)) as (url, _):
        import aiohttp

        from jaxserve.integrations.launch import wait_ready

        async def ready():
            async with aiohttp.ClientSession() as s:
                await wait_ready(s, url, timeout_s=60)

        asyncio.run(ready())
        out = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
             "-n", "30", "--request-timeout", "30", "--generation-deterministic",
             "--phases", "examples,coverage,fuzzing"],
            capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-4000:]
        assert "passed" in out.stdout

        async def healthy():
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/health") as r:
                    return r.status

        assert asyncio.run(healthy()) == 200


def test_soak_loses_nothing_and_leaks_nothing(tiny_files):
    import soak

    path, table = tiny_files
    r = soak.run(str(path), str(table), seconds=10, clients=6, port=free_port())
    print(r)
    assert r["good"] > 50 and r["bad"] > 3 and r["abandoned"] > 3  # each kind happened (80/10/10 of the requests)
    assert r["good_wrong"] == 0 and r["bad_wrong_status"] == 0 and r["errors"] == 0
    assert r["compiles_during"] == 0 and r["queue_depth_after"] == 0 and r["healthy_after"]
    # the ledger: what abandoned requests left waiting was dropped, not run as padding
    assert r["sequences_submitted"] == r["sequences_dispatched"] + r["sequences_dropped"] > 0
    assert r["rss_growth_mib"] < 64


@pytest.fixture(scope="module")
def tiny_enc(tiny_files):
    return warm_encoder(tiny_files[0], TINY_TABLE)


async def test_concurrency_limit_gives_429(make_server, tiny_enc):
    engine = SlowEngine(tiny_enc.engine, gate=threading.Event())  # holds each batch until the test opens it
    client = await make_server(dataclasses.replace(tiny_enc, engine=engine), max_concurrent=2)
    first = [asyncio.create_task(client.post("/v1/embeddings", json={"input": ["the model"]})) for _ in range(2)]
    await until(lambda: engine.held >= 1 and client.app[STATE].service.in_flight == 2, "both requests being handled")
    over = await client.post("/v1/embeddings", json={"input": ["the model"]})
    assert over.status == 429 and "limit is 2" in (await over.json())["error"]["message"]
    engine.gate.set()
    assert [(await t).status for t in first] == [200, 200]
    assert (await client.get("/health")).status == 200  # GETs are not counted
    assert (await client.post("/v1/embeddings", json={"input": ["the model"]})).status == 200


async def test_compressed_bodies_are_charged_as_they_inflate(make_server, tiny_enc):
    """The in-flight byte budget counts what a body becomes: many small gzip bodies that each inflate to most of
    a megabyte are refused (429) once the inflated bytes held would pass --max-inflight-bytes, instead of being
    charged their compressed Content-Length (before: all accepted, 12 x 0.9 MB held against a 2 MiB budget)."""
    import gzip
    import json

    engine = SlowEngine(tiny_enc.engine, gate=threading.Event())  # every accepted body stays held in its request
    limit = 2 * 2**20
    client = await make_server(dataclasses.replace(tiny_enc, engine=engine), max_inflight_bytes=limit,
                               max_body_bytes=2**20)
    state = client.app[STATE]
    raw = json.dumps({"input": ["the model " * 9000] * 10}).encode()  # 900 KB of JSON ...
    body = gzip.compress(raw, mtime=0)  # ... sent as a few KB
    send = lambda: client.post("/v1/embeddings", data=body, headers={"Content-Encoding": "gzip",
                                                                     "Content-Type": "application/json"})
    tasks = [asyncio.create_task(send()) for _ in range(12)]
    refused = lambda: [t for t in tasks if t.done()]
    await until(lambda: len(refused()) + state.active == len(tasks) and state.service.in_flight == state.active,
                "every request refused or queued behind the held device")
    accepted = state.active
    assert [(await t).status for t in refused()] == [429] * (len(tasks) - accepted)
    assert 1 <= accepted and accepted * len(raw) <= limit  # what was let in fits the budget, inflated
    assert state.budget.peak <= limit
    engine.gate.set()
    assert sorted([(await t).status for t in tasks]) == [200] * accepted + [429] * (len(tasks) - accepted)
    assert state.budget.held == 0  # every request's charge given back
    assert (await send()).status == 200


@pytest.mark.parametrize("inputs", [30, 120], ids=["under-1MiB", "over-1MiB"])
async def test_a_client_that_does_not_read_holds_its_slot_until_the_write_deadline(make_server, tiny_enc, inputs,
                                                                                   caplog):
    """A response is written before its request gives back its slot and bytes, and a client that does not take it
    within --request-timeout-s has its connection aborted. Before, a response of 1 MiB or less was handed to
    aiohttp after the slot was given back (every non-reading client held a body, none a slot: memory grew with
    them, 429 never came), and a larger one held its slot for ever (ten such clients locked every other out)."""
    import json
    import socket

    from jaxserve.http.server import STREAM_BODY_BYTES

    client = await make_server(tiny_enc, max_concurrent=1, request_timeout_s=2)
    state = client.app[STATE]
    body = json.dumps({"inputs": ["the model " * 40] * inputs}).encode()
    size = len(await (await client.post("/embed_all", data=body)).read())
    assert (size > STREAM_BODY_BYTES) == (inputs > 100), size
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # takes a few KB of the response, then none
    sock.setblocking(False)
    await loop.sock_connect(sock, (client.host, client.port))
    copies = 8 * 2**20 // size + 1  # pipelined: more than the kernel's buffers on both sides hold (4 MiB at most)
    await loop.sock_sendall(sock, (b"POST /embed_all HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   b"Content-Length: %d\r\n\r\n" % len(body) + body) * copies)
    await until(lambda: "did not read its response to /embed_all" in caplog.text and state.active == 0,
                "the write deadline aborting the connection and giving back its slot", show=lambda: state.active)
    assert state.budget.held == 0
    assert (await client.post("/embed", json={"inputs": ["ok"]})).status == 200
    got = b""
    try:
        while piece := await asyncio.wait_for(loop.sock_recv(sock, 2**16), 60):
            got += piece
    except ConnectionResetError:
        pass
    sock.close()
    assert len(got) < copies * size  # what the kernel had taken before the abort, not every response

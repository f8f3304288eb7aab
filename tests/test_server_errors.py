"""Bad input, overload, auth, draining and disconnects against the real server (tiny model, loopback).

Every failure case is followed by a good request that must succeed.
"""

import asyncio
import dataclasses
import errno
import re
import signal
import subprocess
import sys
import threading

import aiohttp
import numpy as np
import psutil
import pytest
import tiny
from conftest import (
    FEW_OPEN_FILES,
    ONE_COVER,
    TINY_TABLE,
    SlowEngine,
    Upload,
    raised_open_files,
    stopped_listening,
    until,
    warm_encoder,
)

from jaxserve.http.state import STATE

GOOD = {"input": ["the model", "a query"]}
TEI_PATHS = ("/embed", "/embed_all", "/embed_sparse", "/similarity", "/predict", "/rerank", "/tokenize", "/decode")
TEI_ERROR_TYPES = ("Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny.write_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", max_seq_length=32)


@pytest.fixture(scope="module")
def tiny_enc(tiny_path):
    return warm_encoder(tiny_path, TINY_TABLE)


async def assert_good(client):
    resp = await client.post("/v1/embeddings", json=GOOD)
    assert resp.status == 200, await resp.text()
    assert len((await resp.json())["data"]) == 2


BAD = [
    # (method, path, body (bytes or json), status, message fragment)
    ("POST", "/v1/embeddings", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/embeddings", b"\xff\xfe", 400, "not valid JSON"),
    ("POST", "/v1/embeddings", [1, 2], 400, "must be a JSON object"),
    ("POST", "/v1/embeddings", {}, 400, "missing required field `input`"),
    ("POST", "/v1/embeddings", {"input": 5}, 400, "must be a string or a list of strings"),
    ("POST", "/v1/embeddings", {"input": []}, 400, "must not be empty"),
    ("POST", "/v1/embeddings", {"input": ["ok", 3.5]}, 400, "`input[1]` must be a string"),
    ("POST", "/v1/embeddings", {"input": ["ok", None]}, 400, "`input[1]` must be a string"),
    ("POST", "/v1/embeddings", {"input": [[1, 2], [-1]]}, 400, "non-negative token ids"),
    ("POST", "/v1/embeddings", {"input": [[1, 2**20]]}, 400, "outside cl100k_base's vocabulary"),
    ("POST", "/v1/embeddings", {"input": [[1, 2**40]]}, 400, "non-negative token ids"),
    ("POST", "/tokenize", {"inputs": ["ok"], "add_special_tokens": None}, 200, ""),
    ("POST", "/v1/embeddings", {"input": ["x"] * 9}, 413, "at most 8 per request"),
    ("POST", "/v1/embeddings", {"input": ["y" * 2001], "long": "error"}, 413, "at most 2000"),  # (truncating: cut)
    ("POST", "/v1/embeddings", {"input": ["the " * 40], "long": "error"}, 400, "over the model's limit of 32"),
    ("POST", "/v1/embeddings", {"input": ["ok"], "long": "squash"}, 400, "`long` must be one of"),
    ("POST", "/v1/embeddings", {"input": ["ok"], "encoding_format": "hex"}, 400, "`encoding_format`"),
    ("POST", "/v1/embeddings", {"input": ["ok"], "encoding_format": False}, 400, "`encoding_format`"),  # not float
    ("POST", "/v1/embeddings", {"input": ["ok"], "encoding_format": None}, 200, ""),  # absent
    # cl100k's id 90280 decodes to 114 characters: 20 of them are past --max-input-chars, as the text would be
    ("POST", "/v1/embeddings", {"input": [[1, 2], [90280] * 20], "long": "error"}, 413,
     "`input[1]` has 2280 characters; at most 2000"),
    ("POST", "/v1/embeddings", {"input": ["ok"], "dimensions": 0}, 400, "`dimensions` must be an integer from 1 to 32"),
    ("POST", "/v1/embeddings", {"input": ["ok"], "dimensions": 33}, 400, "`dimensions`"),
    ("POST", "/v1/embeddings", {"input": ["ok"], "model": 7}, 400, "`model` must be a string"),
    ("POST", "/v1/embeddings", b"[" * 30000 + b"]" * 30000, 413, "request body over"),
    # TEI's routes answer in TEI's shape and codes: Validation 422, Empty 400, body too large 413
    ("POST", "/embed", {"inputs": "the " * 40, "truncate": False}, 422, "over the model's limit"),
    ("POST", "/embed", {"inputs": ["ok"], "normalize": "yes"}, 422, "`normalize` must be true or false"),
    ("POST", "/embed", {"inputs": ["ok"], "truncation_direction": "Up"}, 422, "truncation_direction"),
    ("POST", "/embed", {"input": ["ok"]}, 422, "missing required field `inputs`"),
    ("POST", "/embed", {"inputs": []}, 400, "must not be empty"),
    # an empty text: TEI's 400 Empty, not the vector of [CLS] [SEP] (OpenAI's route embeds it: LangChain sends them)
    ("POST", "/embed", {"inputs": ["a", ""]}, 400, "`inputs[1]` must not be empty"),
    ("POST", "/embed", {"inputs": ""}, 400, "`inputs[0]` must not be empty"),
    ("POST", "/tokenize", {"inputs": ""}, 400, "must not be empty"),
    ("POST", "/decode", {"ids": [[1], []]}, 400, "`ids[1]` must not be empty"),
    ("POST", "/similarity", {"inputs": {"source_sentence": "", "sentences": ["b"]}}, 400,
     "`inputs.source_sentence` must not be empty"),
    ("POST", "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b", ""]}}, 400,
     "`inputs.sentences[1]` must not be empty"),
    ("POST", "/embed", {"inputs": ["x"] * 9}, 422, "at most 8 per request"),
    ("POST", "/embed", b"{not json", 422, "not valid JSON"),
    ("POST", "/embed", b"[" * 30000 + b"]" * 30000, 413, "request body over"),
    ("POST", "/embed", {"inputs": ["ok"], "prompt_name": "query"}, 422, "unknown prompt_name 'query'"),
    ("POST", "/tokenize", {"inputs": [1]}, 422, "`inputs[0]` must be a string"),
    ("POST", "/decode", {"ids": [[1, 10**6]]}, 422, "token ids from 0 to"),
    ("POST", "/decode", {"ids": []}, 400, "must not be empty"),
    ("POST", "/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 400, "must not be empty"),
    ("POST", "/similarity", {"inputs": ["a"]}, 422, "source_sentence"),
    ("POST", "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": 0}, 422,
     "`parameters` must be an object"),  # was read as none
    # a route the model does not serve: TEI's 424 Backend ("model is not a re-ranker model"), not bad input
    ("POST", "/rerank", {"query": "q", "texts": ["x"]}, 424, "/rerank needs a sequence-classification"),
    ("POST", "/predict", {"inputs": ["x"]}, 424, "/predict needs a sequence-classification"),
    ("POST", "/embed_sparse", {"inputs": ["x"]}, 424, "/embed_sparse needs a sparse"),
    ("GET", "/v1/nothing", None, 404, "no route GET /v1/nothing"),
    ("GET", "/v1/embeddings", None, 405, "method GET is not allowed"),
    ("DELETE", "/health", None, 405, "not allowed"),
]


@pytest.mark.parametrize("method, path, body, status, fragment", BAD, ids=[f"{b[1]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
async def test_bad_input_gets_clear_json_error_and_server_keeps_serving(make_server, tiny_enc, method, path, body,
                                                                        status, fragment):
    client = await make_server(tiny_enc, max_client_batch=8, max_input_chars=2000, max_body_bytes=50_000,
                               max_queue_tokens=4096)
    kw = {"data": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
    resp = await client.request(method, path, **kw)
    assert resp.status == status
    if status >= 400:
        body = await resp.json()
        if path.startswith("/v1/") or path not in TEI_PATHS:  # OpenAI's shape
            assert fragment in body["error"]["message"] and body["error"]["type"]
        else:  # TEI's
            assert fragment in body["error"] and body["error_type"] in TEI_ERROR_TYPES
            assert body["error_type"] == {424: "Backend", 400: "Empty"}.get(status, body["error_type"]), body
    if status == 405:  # RFC 9110 15.5.6: a 405 MUST say which methods are allowed (it did not)
        assert resp.headers["Allow"] and method not in resp.headers["Allow"].split(",")
    await assert_good(client)


async def test_a_408_closes_its_connection(make_server, tiny_enc):
    """A body short of its Content-Length is a 408 once --request-timeout-s passes, and the connection is closed:
    kept open, the next request's bytes were read as the rest of that body (the stream desynced)."""
    client = await make_server(tiny_enc, request_timeout_s=0.5)
    body = b'{"inputs": ["ok"]}'
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (len(body) + 10) + body)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head, head
    await reader.readexactly(int(re.search(rb"Content-Length: (\d+)", head)[1]))
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await asyncio.wait_for(reader.read(), 60) == b""  # closed: nothing more is read from this stream
    writer.close()
    await assert_good(client)


async def test_expect_100_continue_is_answered_after_the_checks_the_headers_decide(make_server, tiny_enc):
    """`Expect: 100-continue`: a request its headers already refuse (no key, a declared body over the limit, a server
    not ready) gets its 4xx or 503 at once, with no 100 before it, and its connection is not kept (the body will not
    come); aiohttp's default answered 100 first, so the client sent the whole body to be refused. One that passes
    gets the 100, then its answer; any other expectation is a 417 (RFC 9110 10.1.1); an empty header is none."""
    client = await make_server(tiny_enc, api_key="s3cret", max_body_bytes=1000)

    async def exchange(path: bytes, headers: bytes, length: int, body: bytes | None = None, wait: bool = True) -> bytes:
        """`body` sent once the server says 100 (`wait`), or with the headers."""
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n" % (path, headers, length)
                     + (body if body is not None and not wait else b""))
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        if body is not None and wait and first.startswith(b"HTTP/1.1 100 "):
            writer.write(body)
            first += await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        rest = b""
        if b"Connection: close" in first:  # refused before its body: the server reads on until the client ends
            writer.write_eof()
            rest = await asyncio.wait_for(reader.read(), 60)
        writer.close()
        return first + rest

    expect, key = b"Expect: 100-continue\r\n", b"Authorization: Bearer s3cret\r\n"
    bodies = {b"/embed": b'{"inputs": ["ok"]}', b"/v1/embeddings": b'{"input": ["ok"]}'}
    state = client.app[STATE]
    for path, body in bodies.items():
        refused = await exchange(path, expect, len(body))  # no key
        assert refused.startswith(b"HTTP/1.1 401") and b"Connection: close" in refused, refused
        refused = await exchange(path, expect + key, 5000)  # declared over --max-body-bytes
        assert refused.startswith(b"HTTP/1.1 413") and b"Connection: close" in refused, refused
        state.ready = False  # as while warming up
        refused = await exchange(path, expect + key, len(body))
        state.ready = True
        assert refused.startswith(b"HTTP/1.1 503") and b"warming up" in refused, refused
        refused = await exchange(path, b"Expect: something-else\r\n" + key, len(body))
        assert refused.startswith(b"HTTP/1.1 417") and b"100-continue" in refused, refused
        served = await exchange(path, expect + key, len(body), body)
        assert served.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 "), served
        served = await exchange(path, b"Expect: \r\n" + key, len(body), body, wait=False)
        assert served.startswith(b"HTTP/1.1 200 "), served
    assert (await client.post("/embed", json={"inputs": ["ok"]}, headers={"Authorization": "Bearer s3cret"})).ok


async def test_token_ids_decoded_for_a_prompt_are_held_to_max_input_chars(make_server, tiny_enc):
    """The model's own ids with a prompt run as TEI runs them, decoded and tokenized as text: that text is held to
    --max-input-chars as a text sent as such (TEI's 422 Validation), not tokenized whatever its size; cut to it
    where the request truncates."""
    client = await make_server(tiny_enc, max_input_chars=2000)
    word = tiny_enc.tokenizer.tokenizer.token_to_id("document")
    for truncate, status in ((True, 200), (False, 422)):  # "document " x 250: 2,249 characters
        resp = await client.post("/embed", json={"inputs": [[word] * 250], "prompt": "query: ", "truncate": truncate})
        assert resp.status == status, await resp.text()
    assert "`inputs[0]` has 2249 characters; at most 2000" in (await resp.json())["error"]
    await assert_good(client)


async def test_a_text_past_max_input_chars_is_cut_where_the_request_truncates(make_server, tiny_enc):
    """TEI cuts a text past its character limit before tokenizing where truncation is on
    (`core/src/tokenization.rs`, `apply_limit`); jaxserve answered 413 (422 on TEI's routes), so one long page
    failed its whole batch. Now the text is cut at the truncation's end and embedded as the cut text is; a request
    that refuses truncation still gets the 413."""
    client = await make_server(tiny_enc, max_input_chars=100)
    text = "the model " * 6 + "a batch of documents " * 5  # 165 characters

    async def ok(path, body):
        resp = await client.post(path, json=body)
        assert resp.status == 200, await resp.text()
        return np.asarray(await resp.json())

    sent = await ok("/embed", {"inputs": [text, "ok"]})
    np.testing.assert_allclose(sent, await ok("/embed", {"inputs": [text[:100], "ok"]}), atol=1e-6)
    left = await ok("/embed", {"inputs": [text], "truncation_direction": "Left"})
    np.testing.assert_allclose(left, await ok("/embed", {"inputs": [text[-100:]]}), atol=1e-6)
    similar = await ok("/similarity", {"inputs": {"source_sentence": text, "sentences": [text[:100]]}})
    assert similar[0] == pytest.approx(1.0, abs=1e-5)
    openai = (await (await client.post("/v1/embeddings", json={"input": [text]})).json())["data"][0]["embedding"]
    np.testing.assert_allclose(openai, sent[0], atol=1e-6)
    cohere = await client.post("/v2/embed", json={"texts": [text], "truncate": "START"})
    np.testing.assert_allclose((await cohere.json())["embeddings"]["float"][0], left[0], atol=1e-6)
    for path, body in (("/embed", {"inputs": [text], "truncate": False}), ("/v1/embeddings", {"input": [text],
                       "long": "error"}), ("/v1/embeddings", {"input": [text], "long": "chunk"}),
                       ("/v2/embed", {"texts": [text], "truncate": "NONE"})):
        resp = await client.post(path, json=body)
        assert resp.status in (413, 422) and "has 165 characters; at most 100" in await resp.text(), (path, body)


async def test_error_messages_do_not_echo_documents(make_server, tiny_enc):
    client = await make_server(tiny_enc, max_input_chars=100)
    secret = "confidential-" + "z" * 200
    resp = await client.post("/v1/embeddings", json={"input": ["ok", secret], "long": "error"})
    assert resp.status == 413 and "confidential" not in await resp.text()


async def test_overload_gives_429_with_retry_after_then_recovers(make_server, tiny_enc):
    engine = SlowEngine(tiny_enc.engine, gate=threading.Event())  # holds each batch until the test opens it
    client = await make_server(dataclasses.replace(tiny_enc, engine=engine), max_queue_tokens=64, max_client_batch=8,
                               max_wait_ms=0, max_inflight=1, **ONE_COVER)
    batch = {"input": [f"the model {i}" for i in range(8)], "priority": "bulk"}  # queued, not prepared ahead
    service = client.app[STATE].service
    accepted = []
    states = [lambda: engine.held == 1, lambda: service.batches_in_flight == 2,
              lambda: service.batches_in_flight == 2 and service.batcher.queued == 64]
    # where it stood, if a state is never reached (a loaded run once split the first request over two batches)
    show = lambda: (f"held {engine.held}, batches in flight {service.batches_in_flight}, queued "
                    f"{service.batcher.waiting()}, device saw {[ids.shape for ids in engine.seen]}, requests done "
                    f"{[(t.exception() or t.result().status) if t.done() else None for t in accepted]}, host "
                    f"{service.host_dispatch}")
    for where, state in zip(("on the device", "prepared next (prefetch depth 1)", "waiting in the queue"), states):
        accepted.append(asyncio.create_task(client.post("/v1/embeddings", json=batch)))
        await until(state, f"request {len(accepted)} {where}", show=show)  # the third: 8 short documents, 64 tokens
    # a bulk request past the bulk limit (a query would be admitted into the quarter kept for queries)
    rejected = await client.post("/v1/embeddings", json={**GOOD, "priority": "bulk"})
    assert rejected.status == 429 and rejected.headers["Retry-After"] == "1"
    assert (await rejected.json())["error"]["type"] == "rate_limit_error"
    engine.gate.set()
    assert [(await t).status for t in accepted] == [200, 200, 200]
    await assert_good(client)


async def test_auth_required_on_every_route_but_health(make_server, tiny_enc):
    client = await make_server(tiny_enc, api_key="s3cret")
    assert (await client.get("/health")).status == 200
    assert (await client.get("/")).status == 200 and (await client.get("/ping")).status == 200  # probes too
    for method, path in [("POST", "/v1/embeddings"), ("POST", "/embed"), ("POST", "/"), ("GET", "/info"),
                         ("GET", "/metrics")]:
        resp = await client.request(method, path, json=GOOD)
        assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
        body = await resp.json()
        assert (body["error"]["type"] if path.startswith("/v1") or path in ("/info", "/metrics")
                else body["error_type"]) in ("authentication_error", "Unauthorized")
    wrong = await client.post("/v1/embeddings", json=GOOD, headers={"Authorization": "Bearer nope"})
    assert wrong.status == 401
    ok = await client.post("/v1/embeddings", json=GOOD, headers={"Authorization": "Bearer s3cret"})
    assert ok.status == 200


async def test_info_says_auth_whichever_way_the_keys_came(make_server, tiny_enc, tmp_path):
    """/info's `limits.auth` is true for keys from --api-key and --api-keys-file too (was: only $JAXSERVE_API_KEY's)."""
    from jaxserve.cli import api_keys, build_parser

    keys = tmp_path / "keys.txt"
    keys.write_text("from-file=bulk\n")
    for config, key in [({"api_keys": api_keys(build_parser().parse_args(["serve", "--api-key", "flag-key"]))},
                         "flag-key"),
                        ({"api_keys": api_keys(build_parser().parse_args(["serve", "--api-keys-file", str(keys)]))},
                         "from-file"),
                        ({"api_key": "s3cret"}, "s3cret"), ({}, None)]:
        client = await make_server(tiny_enc, **config)
        resp = await client.get("/info", headers={"Authorization": f"Bearer {key}"} if key else {})
        assert resp.status == 200 and (await resp.json())["limits"]["auth"] is (key is not None), config


async def test_draining_refuses_new_work_with_503(make_server, tiny_enc):
    client = await make_server(tiny_enc)
    await client.app[STATE].service.drain(timeout=1)
    resp = await client.post("/v1/embeddings", json=GOOD)
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert (await client.get("/health")).status == 503


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_finishes_accepted_requests_then_exits(tiny_path, tmp_path, signals):
    """The real `jaxserve serve` process: SIGTERM during load loses no accepted request, one still sending its body
    included (aiohttp's stopping dropped the bytes it received, and the request waited out the drain's timeout);
    nor does a second SIGTERM during the drain (systemd signals every process of the unit; aiohttp's own handler
    took a second as the first and cancelled the drain, closing every connection unanswered)."""
    table = tmp_path / "table.json"
    TINY_TABLE.save(table)
    from jaxserve.integrations.launch import free_port, wait_ready

    port = free_port()
    proc = subprocess.Popen(
        [*FEW_OPEN_FILES, sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(tiny_path), "--port", str(port),
         "--buckets", str(table)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )

    async def scenario():
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            await wait_ready(s, url, timeout_s=60)
            # (and, started with 1024, it may hold as many connections as the hard limit allows)
            assert psutil.Process(proc.pid).rlimit(psutil.RLIMIT_NOFILE)[0] == raised_open_files()

            async def one(i):
                async with s.post(url + "/v1/embeddings", json={"input": [f"the model {i} {j} " * 8 for j in range(32)]}) as r:
                    body = await r.json()
                    return r.status, len(body["data"]) if r.status == 200 else body["error"]["type"]

            upload = Upload(url, "/v1/embeddings", {"input": ["sent in two parts"] * 4})
            await upload.start()
            tasks = [asyncio.create_task(one(i)) for i in range(60)]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # load is flowing
            proc.send_signal(signal.SIGTERM)
            if signals == 2:
                await asyncio.sleep(0.3)  # (a second sent at once could merge with the first)
                proc.send_signal(signal.SIGTERM)
            await stopped_listening(url)  # stopping: the rest of the body comes after
            uploaded = await upload.finish()
            assert uploaded[0] == 200 and len(uploaded[1]["data"]) == 4, uploaded
            assert upload.closes  # answered while draining: its client's next request goes elsewhere
            return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = asyncio.run(scenario())
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    answered = [r for r in results if not isinstance(r, Exception)]
    assert all(r in ((200, 32), (503, "unavailable")) for r in answered), results  # done, or cleanly refused
    handled = int(re.search(r"draining: (\d+) requests being handled", out).group(1))
    assert handled >= 2, out  # SIGTERM came while requests were in the server (the upload, and others queued)
    # each of them (the upload one of them, answered above), and the first, finished
    assert sum(r == (200, 32) for r in answered) >= 1 + handled - 1, results
    # the rest never reached the server: refused at connect, or reset by the kernel, which resets the connections
    # still waiting in the listen backlog (handshake done, never accepted) when the listening socket closes
    refused = [r for r in results if isinstance(r, Exception)]
    assert all(isinstance(e, aiohttp.ClientConnectorError) or getattr(e, "errno", None) == errno.ECONNRESET
               for e in refused), refused
    assert proc.returncode == 0, out
    assert "drained: all accepted requests finished" in out


def test_a_second_sigint_stops_at_once_and_exits_1(tiny_path, tmp_path):
    """Ctrl-C twice: the second stops the drain without waiting for the request it holds (a body never finished)
    and exits 1, as aiohttp's run_app does; a SIGTERM after the first is let be (above), a SIGINT is not."""
    from jaxserve.integrations.launch import free_port, wait_ready

    table = tmp_path / "table.json"
    TINY_TABLE.save(table)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(tiny_path), "--port", str(port),
         "--buckets", str(table)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )

    async def scenario():
        url = f"http://127.0.0.1:{port}"
        upload = Upload(url, "/v1/embeddings", {"input": ["never sent whole"]})
        async with aiohttp.ClientSession() as s:
            await wait_ready(s, url, timeout_s=60)
            await upload.start()
            assert (await s.get(url + "/health")).status == 200  # (by then the server has read the upload's head)
        proc.send_signal(signal.SIGINT)
        await stopped_listening(url)
        proc.send_signal(signal.SIGINT)
        return await asyncio.wait_for(upload.reader.read(), 60)  # the connection closed, unanswered

    try:
        left = asyncio.run(scenario())
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert left == b"", left
    assert proc.returncode == 1, out
    assert "draining: 1 requests being handled" in out and "drained: all accepted requests finished" not in out, out


def _host_fault(fn, query):
    """`pipeline.assemble` or `pipeline.scatter`, raising for a batch with a job holding token `query`."""
    def faulty(*args):
        jobs = args[-1]
        if any((job.flat[0] == query).any() for job in jobs.values()):
            raise RuntimeError(f"injected host fault in {fn.__name__}")
        return fn(*args)
    return faulty


@pytest.mark.parametrize("stage", ["assemble", "put", "launch", "fetch", "scatter"])
async def test_a_failing_batch_fails_only_its_own_requests(make_server, tiny_enc, monkeypatch, stage):
    """Wherever a batch fails (assembled, copied, launched, fetched or scattered), exactly the requests with rows
    in it get a 500 naming the cause; a request in another batch succeeds, /health stays 200, and the pipeline
    goes on. Before, a fault in assemble or scatter killed its pipeline thread: every request failed, and /health
    answered 503 for good."""
    from jaxserve.scheduling import pipeline

    query = int(tiny_enc.tokenizer.encode_bodies(["query"])[0][0])
    engine = SlowEngine(tiny_enc.engine, gate=threading.Event(), fail_when=lambda ids: (ids == query).any(),
                        fail_at=stage)
    if stage in ("assemble", "scatter"):
        monkeypatch.setattr(pipeline, stage, _host_fault(getattr(pipeline, stage), query))
    client = await make_server(dataclasses.replace(tiny_enc, engine=engine), max_wait_ms=0, **ONE_COVER)
    before = asyncio.create_task(client.post("/v1/embeddings", json={"input": ["the model"]}))
    await until(lambda: engine.held == 1, "the first request's batch on the device")
    doomed = asyncio.create_task(client.post("/v1/embeddings", json={"input": ["a query", "the jax"]}))
    await until(lambda: doomed.done() or len(engine.seen) == 2, "the second request in a batch of its own")
    engine.gate.set()
    resp = await doomed
    assert resp.status == 500
    err = (await resp.json())["error"]
    assert err["type"] == "server_error" and "injected" in err["message"] and stage in err["message"]
    assert (await before).status == 200
    assert (await client.get("/health")).status == 200
    after = await client.post("/v1/embeddings", json={"input": ["the model", "a batch"]})
    assert after.status == 200


async def test_cors_preflights_and_origins(make_server, tiny_enc):
    """A browser page works against jaxserve as against TEI (any origin by default): its preflight answered 204
    without the API key, Access-Control-Allow-Origin on every answer, errors included. Before, OPTIONS was a 405
    and no response carried CORS headers. The preflight allows the headers it asks for."""
    from jaxserve.cli import cors_origins

    assert cors_origins(None) == ("*",) and cors_origins(["none"]) == ()
    assert cors_origins(["https://a.example,https://b.example", "https://c.example"]) == (
        "https://a.example", "https://b.example", "https://c.example")
    page = {"Origin": "https://app.example"}
    preflight = {**page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, authorization, x-jaxserve-priority, x-stainless-lang"}
    client = await make_server(tiny_enc, api_key="s3cret")
    resp = await client.options("/v1/embeddings", headers=preflight)
    allowed = resp.headers.get("Access-Control-Allow-Headers", "").lower()
    assert resp.status == 204 and resp.headers["Access-Control-Allow-Origin"] == "*", resp.headers
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    # (OpenAI's JavaScript SDK sends X-Stainless-* headers from a browser too: a fixed list refused them)
    assert {"content-type", "authorization", "x-jaxserve-priority", "x-stainless-lang"} <= set(
        allowed.replace(" ", "").split(","))
    bare = await client.options("/v1/embeddings", headers={**page, "Access-Control-Request-Method": "POST"})
    assert "authorization" in bare.headers["Access-Control-Allow-Headers"].lower()
    key = {"Authorization": "Bearer s3cret"}
    ok = await client.post("/v1/embeddings", json={"input": ["ok"]}, headers={**page, **key})
    assert ok.status == 200 and ok.headers["Access-Control-Allow-Origin"] == "*"
    refused = await client.post("/v1/embeddings", json={"input": ["ok"]}, headers=page)
    assert refused.status == 401 and refused.headers["Access-Control-Allow-Origin"] == "*"
    plain = await client.post("/v1/embeddings", json={"input": ["ok"]}, headers=key)
    assert plain.status == 200 and "Access-Control-Allow-Origin" not in plain.headers  # not a browser's
    listed = await make_server(tiny_enc, cors_allow_origins=("https://app.example",))
    resp = await listed.post("/embed", json={"inputs": ["ok"]}, headers=page)
    assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example" and resp.headers["Vary"] == "Origin"
    other = {"Origin": "https://elsewhere.example"}
    resp = await listed.post("/embed", json={"inputs": ["ok"]}, headers=other)
    assert "Access-Control-Allow-Origin" not in resp.headers
    assert (await listed.options("/embed", headers={**preflight, **other})).status == 405
    off = await make_server(tiny_enc, cors_allow_origins=())
    resp = await off.options("/embed", headers=preflight)
    assert resp.status == 405 and "Access-Control-Allow-Origin" not in resp.headers
    resp = await off.post("/embed", json={"inputs": ["ok"]}, headers=page)
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers

"""Below the schema: hostile bytes, encodings, unicode, JSON structure and numbers get 2xx or 4xx JSON, never 5xx.

A bounded run of scripts/fuzz_bytes.py against a real `jaxserve serve` (tiny model, loopback), then one
regression test per class of server error it found, each failing on the code before its fix.
"""

import asyncio
import dataclasses
import gzip
import sys
from pathlib import Path

import orjson
import pytest
import tiny
from conftest import TINY_TABLE

from jaxserve import Encoder

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

import fuzz_bytes  # noqa: E402

DEEP = b"[" * 1000 + b"]" * 1000  # parses (orjson allows 1024 levels); repr() of it raised RecursionError


def test_byte_level_fuzz_finds_no_server_error(tmp_path):
    """3,500 bodies, every class, every POST route and the GET routes; the server healthy afterwards."""
    result = fuzz_bytes.fuzz_served("embedding", tmp_path, seed=1, bodies=3500, concurrency=4, max_seconds=90)
    print(fuzz_bytes.table(result))
    assert result["bodies"] == 3500 and not result["stopped_early"]
    assert all(c["sent"] == 500 for c in result["classes"].values())
    kinds = {"raw": 7, "encoding": 17, "unicode": 16, "structure": 15, "numbers": 6, "mutated": 4, "headers": 11}
    assert all(len(result["classes"][cls]["kinds"]) >= n for cls, n in kinds.items())  # every sub-kind sent
    failures = {cls: c["failures"] for cls, c in result["classes"].items() if c["failures"]}
    assert result["server_errors"] == 0, failures
    assert result["non_json"] == 0 and result["wrong_shape"] == 0, failures  # every error in its route's shape
    assert result["transport_errors"] == 0, failures
    assert result["health_after"] == 200 and result["good_request_after"] == 200
    assert result["unhandled_in_log"] == []
    statuses = {s for c in result["classes"].values() for s in c["statuses"]}
    assert {"200", "400", "401", "404", "405", "413", "415", "422"} <= statuses


@pytest.fixture(scope="module")
def tiny_enc(tmp_path_factory):
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("fuzz") / "ckpt")
    return Encoder.from_pretrained(str(path), buckets=TINY_TABLE)


async def error_of(resp, tei: bool) -> str:
    body = await resp.json()
    return body["error"] if tei else body["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", b'{"input": ["ok"], "encoding_format": ' + DEEP + b"}"),
    ("/v1/embeddings", b'{"input": ["ok"], "long": ' + DEEP + b"}"),
    ("/v1/plan", b'{"input": ["ok"], "dimensions": ' + DEEP + b"}"),
    ("/embed", b'{"inputs": ["ok"], "normalize": ' + DEEP + b"}"),
    ("/embed_all", b'{"inputs": ["ok"], "truncate": ' + DEEP + b"}"),
    ("/embed", b'{"inputs": ["ok"], "truncation_direction": ' + DEEP.replace(b"[]", b'[{"a":1}]') + b"}"),
    ("/tokenize", b'{"inputs": ["ok"], "add_special_tokens": ' + DEEP + b"}"),
    ("/similarity", b'{"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"truncate": '
     + DEEP + b"}}"),
    ("/", b'{"inputs": "ok", "normalize": ' + b'{"a":' * 1000 + b"1" + b"}" * 1000 + b"}"),
])
async def test_deeply_nested_value_in_a_checked_field_is_a_4xx(make_server, tiny_enc, path, body):
    """Was a 500 (424 on TEI's routes): the error message repr()'d the value, RecursionError."""
    client = await make_server(tiny_enc)
    resp = await client.post(path, data=body)
    assert resp.status in (400, 422), await resp.text()
    message = await error_of(resp, path not in ("/v1/embeddings", "/v1/plan"))
    assert "an array" in message or "an object" in message


def test_error_messages_show_values_short_and_flat():
    from jaxserve.http.api import ApiError, Limits, _show, parse_predict

    assert _show("x" * 10_000) == repr("x" * 60) + "..." and _show(2**64) == "int" and _show([[1]]) == "an array"
    with pytest.raises(ApiError, match="not an array"):
        parse_predict({"inputs": "a", "top_k": [[[]]] * 100_000}, Limits(8, 100), True)


def test_predict_reads_its_options_from_the_body_then_parameters():
    """huggingface_hub sends `parameters`; a null at the top does not hide them, and a `parameters` that is not
    an object is refused (as /similarity's), not ignored."""
    from jaxserve.http.api import ApiError, Limits, parse_predict

    req = parse_predict({"inputs": "a", "top_k": None, "parameters": {"top_k": 2, "function_to_apply": "none"}},
                        Limits(8, 100), True)
    assert (req.top_k, req.function) == (2, "none")
    req = parse_predict({"inputs": "a", "top_k": 1, "parameters": {"top_k": 2}}, Limits(8, 100), True)
    assert req.top_k == 1
    with pytest.raises(ApiError, match="`parameters` must be an object"):
        parse_predict({"inputs": "a", "parameters": [2]}, Limits(8, 100), True)


@pytest.mark.parametrize("coding, body, status, fragment", [
    ("gzip", b'{"inputs": ["ok"]}', 422, "not valid gzip"),  # was a 500: aiohttp's RequestPayloadError
    ("deflate", b'{"inputs": ["ok"]}', 422, "not valid deflate"),
    ("gzip", gzip.compress(b'{"inputs": ["ok"]}', mtime=0)[:-4], 422, "ends early"),
    ("br", b'{"inputs": ["ok"]}', 415, "not supported"),  # was aiohttp's text/plain 400; 415 as on OpenAI's routes
    ("zstd", b'{"inputs": ["ok"]}', 415, "not supported"),
    ("gzip", gzip.compress(b'{"inputs": "' + b"a" * 60_000 + b'"}', mtime=0), 413, "once inflated"),  # a bomb
    ("gzip", gzip.compress(b'{"inputs": ["ok"]}', mtime=0), 200, ""),  # still served
    ("gzip", gzip.compress(b'{"inputs"', mtime=0) + gzip.compress(b': ["ok"]}', mtime=0), 200, ""),  # two members
    ("gzip", gzip.compress(b'{"inputs": ["ok"]}', mtime=0) + b"\x00junk", 422, "5 bytes follow its end"),
    ("deflate", __import__("zlib").compress(b'{"inputs": ["ok"]}') + b"junk", 422, "4 bytes follow its end"),
    ("deflate", __import__("zlib").compress(b'{"inputs": ["ok"]}'), 200, ""),
])
async def test_content_encoding_is_undone_or_refused_in_json(make_server, tiny_enc, coding, body, status, fragment):
    client = await make_server(tiny_enc, max_body_bytes=50_000)
    resp = await client.post("/embed", data=body, headers={"Content-Encoding": coding})
    assert resp.status == status, await resp.text()
    if status != 200:
        assert fragment in await error_of(resp, tei=True)
    for _ in range(3):  # and the connection is not left broken
        assert (await client.post("/embed", json={"inputs": ["ok"]})).status == 200


async def test_unknown_prompt_name_on_tokenize_is_a_4xx(make_server, tiny_enc):
    """Was a 500: /tokenize looked the prompt up outside the mapping of InputError."""
    client = await make_server(tiny_enc)
    resp = await client.post("/tokenize", json={"inputs": ["ok"], "prompt_name": "\u202eq\u0000\U0001f600"})
    assert resp.status == 422 and "unknown prompt_name" in await error_of(resp, tei=True)
    resp = await client.post("/v1/embeddings", json={"input": ["ok"], "prompt_name": "nope"})
    assert resp.status == 400 and "unknown prompt_name" in await error_of(resp, tei=False)


async def test_api_key_header_that_is_not_utf8_is_a_401(make_server, tiny_enc):
    """Was a 500: aiohttp decodes such header bytes as lone surrogates, and the key check encoded them."""
    client = await make_server(tiny_enc, api_key="s3cret")
    body = b'{"input": ["ok"]}'
    for value in (b"Bearer \xff", b"Bearer s3cret\xed\xa0\x80", b"\xc0\xaf"):
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " + value
                     + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        response = await reader.read()
        writer.close()
        assert response.startswith(b"HTTP/1.1 401") and b'"authentication_error"' in response, response
    ok = await client.post("/v1/embeddings", data=body, headers={"Authorization": "Bearer s3cret"})
    assert ok.status == 200


class PanicException(BaseException):
    """Stands for pyo3's, which a panic in Rust code (the tokenizers library) raises: not an Exception."""


class PanickingTokenizer:
    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def encode_batch(self, *a, **kw):
        raise PanicException("called `Option::unwrap()` on a `None` value")

    decode_batch = encode_batch


async def test_a_tokenizer_panic_is_a_4xx_not_a_dropped_connection(make_server, tiny_enc):
    tok = dataclasses.replace(tiny_enc.tokenizer, tokenizer=PanickingTokenizer(tiny_enc.tokenizer.tokenizer))
    client = await make_server(dataclasses.replace(tiny_enc, tokenizer=tok))
    for path, body in (("/tokenize", {"inputs": ["ok"]}), ("/decode", {"ids": [[5, 6]]})):
        resp = await client.post(path, json=body)
        assert resp.status == 422 and (await resp.json())["error_type"] == "Tokenizer"
    assert (await client.post("/embed", json={"inputs": ["ok"]})).status == 200


async def raw_exchange(client, data: bytes) -> bytes:
    """`data` sent on a new connection as is; -> every byte the server answers until it closes."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(data)
    response = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    return response


@pytest.mark.parametrize("framing", [
    b"POST /embed HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n%s\r\n0\r\n\r\n",  # wrong chunk size
    b"POST /embed HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n%s\r\n0\r\n\r\n",  # not a size
    b"POST /embed HTTP/1.1\r\nHost: x\r\nX-Doc: %s\r\nContent-Length: 2\r\n\r\n{}",  # a header over 8190 bytes
    b"POST /embed HTTP/1.1\nHost: x\nX-Doc: %s\nContent-Length: 2\n\n{}",  # bare-LF lines
])
async def test_broken_http_framing_is_a_json_400_that_does_not_echo_the_bytes(make_server, tiny_enc, framing,
                                                                              caplog):
    """Was aiohttp's text/plain 400 quoting the bytes around the fault, and a logged traceback holding them too:
    a document sent in a badly framed body appeared whole in both."""
    client = await make_server(tiny_enc)
    doc = b'{"inputs": "confidential ' + b"lorem ipsum " * (700 if b"X-Doc" in framing else 400) + b'"}'
    with caplog.at_level("DEBUG"):
        response = await raw_exchange(client, framing % doc)
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400" and b"application/json" in head, response[:300]
    assert "not valid HTTP/1.1" in orjson.loads(body)["error"]["message"]
    assert b"confidential" not in response and b"lorem" not in response
    assert "confidential" not in caplog.text and "lorem" not in caplog.text
    assert (await client.post("/embed", json={"inputs": ["ok"]})).status == 200


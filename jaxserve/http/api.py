"""Request validation and response shapes of the HTTP API (OpenAI-, TEI- and Cohere-compatible), without HTTP.

Each `parse_*` turns a decoded JSON body into a typed request or raises
`ApiError` with the status and a message naming the offending field. An
error is written in the shape its route's clients read: OpenAI's
`{"error": {"message", "type", ...}}` on /v1/*, TEI's
`{"error", "error_type"}` with TEI's status codes on TEI's routes (`tei()`),
Cohere's `{"id", "message"}` on Cohere's /v2 routes (`cohere()`).
"""

from __future__ import annotations

import dataclasses
import sys
import uuid

import numpy as np
import orjson
import pybase64

from jaxserve.checkpoint.tokenize import LONG_MODES
from jaxserve.view import normalize_rows

# Our error types -> TEI's (status, error_type): router/src/http/server.rs maps Validation and
# Tokenizer to 422, Empty to 400, Overloaded to 429, Backend to 424, Unhealthy to 503.
TEI_ERRORS = {
    "rate_limit_error": (429, "Overloaded"),
    "unavailable": (503, "Unhealthy"),
    "timeout": (503, "Unhealthy"),
    "server_error": (424, "Backend"),
    "tokenizer_error": (422, "Tokenizer"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", headers: dict | None = None,
                 tei: tuple[int, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.headers = headers or {}
        self._tei = tei  # (status, error_type) where TEI's differ from the default mapping

    def body(self) -> dict:
        """OpenAI's error shape."""
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": None}}

    def cohere(self) -> tuple[int, dict]:
        """Cohere's error shape (`{"id", "message"}`), with our status: the SDK picks its exception by status."""
        return self.status, {"id": uuid.uuid4().hex, "message": self.message}

    def tei(self) -> tuple[int, dict]:
        """TEI's status and error shape."""
        status, kind = self._tei or TEI_ERRORS.get(self.type) or (
            (self.status, "Unauthorized") if self.status == 401 else
            (413, "Validation") if self.type == "body_too_large" else
            (self.status, "Validation") if self.status in (404, 405, 408, 415, 417) else (422, "Validation"))
        return status, {"error": self.message, "error_type": kind}


def _show(value) -> str:
    """A request's value in an error message: a scalar cut short, a container by its type only. Bodies hold
    values nested up to orjson's 1024 levels (repr() raises RecursionError) and megabytes long."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 60 else repr(value[:60]) + "..."
    if value is None or isinstance(value, (bool, float)) or (isinstance(value, int) and value.bit_length() <= 64):
        return repr(value)
    return {list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def empty(field: str) -> ApiError:
    return ApiError(400, f"`{field}` must not be empty", tei=(400, "Empty"))


def wrong_model(message: str) -> ApiError:
    """A route this server's model does not serve: a 400, and on TEI's routes TEI's 424 Backend ("model is not a
    re-ranker model"), which clients and gateways read as the wrong deployment rather than bad input."""
    return ApiError(400, message, tei=(424, "Backend"))


@dataclasses.dataclass(frozen=True)
class Limits:
    max_client_batch: int  # inputs per request
    max_input_chars: int  # characters per input


EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # vLLM's `embed_dtype` of base64 vectors
ENDIANNESS = ("native", "big", "little")  # ... and its `endianness`
FLOAT32 = ("float32", "native")  # base64's default: float32 in the host's byte order


@dataclasses.dataclass(frozen=True)
class EmbedRequest:
    texts: list[str] | None  # either texts ...
    token_ids: list[np.ndarray] | None  # ... or token ids: whole model sequences, run as given (or both, `ids_at`)
    long: str  # truncate | chunk | error
    normalize: bool = True
    dimensions: int | None = None
    encoding_format: str = "float"
    prompt_name: str | None = None  # one of the model's prompts ...
    prompt: str | None = None  # ... or a prompt text, put in front of every input
    direction: str = "right"  # which end truncation cuts
    model: str | None = None  # the `model` field of an OpenAI request (names the tokenizer of its token ids)
    cut: int | None = None  # tokens a sequence keeps (vLLM's `truncate_prompt_tokens`); None: the model's limit
    ids_at: tuple[int, ...] = ()  # a TEI batch of both: where its token ids are (`texts_or_ids`), texts elsewhere
    element: tuple[str, str] = FLOAT32  # base64's (vLLM's `embed_dtype`, `endianness`)

    @property
    def inputs(self) -> list:
        """The texts, or the token-id arrays, or both in the order sent."""
        if self.ids_at:
            texts, ids = iter(self.texts), iter(self.token_ids)
            at = set(self.ids_at)
            return [next(ids) if i in at else next(texts) for i in range(len(self.texts) + len(self.token_ids))]
        return self.texts if self.texts is not None else self.token_ids

    @property
    def count(self) -> int:
        if self.ids_at:
            return len(self.texts) + len(self.token_ids)
        return len(self.texts if self.texts is not None else self.token_ids)


def texts_of(value, field: str, limits: Limits, blank: bool = True, cut: str | None = None) -> list[str]:
    """A string or a list of strings. `blank`: an empty string is an input (OpenAI's routes: LangChain sends them),
    else TEI's 400 Empty. `cut`: the end a text past `--max-input-chars` is cut at where the request truncates
    (`within_limit`)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ApiError(400, f"`{field}` must be a string or a list of strings, not {type(value).__name__}")
    _count(value, field, limits)
    texts = value
    for i, x in enumerate(value):
        text = _text(x, field, i, limits, blank, cut)
        if text is not x:
            texts = value.copy() if texts is value else texts  # (the body's list is left as it was sent)
            texts[i] = text
    return texts


def _text(x, field: str, i: int, limits: Limits, blank: bool, cut: str | None, kinds: str = "a string") -> str:
    """Item `i` of a list of inputs as a text: a string, not empty unless `blank`, within `--max-input-chars` (or cut
    to it: `within_limit`)."""
    if not isinstance(x, str):
        raise ApiError(400, f"`{field}[{i}]` must be {kinds}, not {type(x).__name__}")
    if not (x or blank):
        raise empty(f"{field}[{i}]")
    return x if len(x) <= limits.max_input_chars else within_limit(x, f"{field}[{i}]", limits, cut)


def texts_or_ids(value, field: str, limits: Limits, blank: bool = True,
                 cut: str | None = None) -> tuple[list[str] | None, list[np.ndarray] | None, tuple[int, ...]]:
    """Texts (`texts_of`), one list of token ids, or a list of token-id lists -> (texts, token ids, where the token
    ids are). A batch of texts and token-id lists mixed, which TEI's `Input` reads (each item a `String` or `Ids`),
    gives both lists, the token ids at the positions of the third."""
    kinds = set(map(type, value)) if isinstance(value, list) else ()  # (one C loop: a query's list is one text)
    if kinds == {int}:
        value, kinds = [value], {list}  # one pre-tokenized input
    if list not in kinds:
        return texts_of(value, field, limits, blank, cut), None, ()
    _count(value, field, limits)
    at = tuple(i for i, x in enumerate(value) if isinstance(x, list))
    ids = [_token_ids(value[i], f"{field}[{i}]") for i in at]
    if len(at) == len(value):
        return None, ids, ()
    texts = [_text(x, field, i, limits, blank, cut, "a string or a list of token ids")
             for i, x in enumerate(value) if not isinstance(x, list)]
    return texts, ids, at


def _count(value: list, field: str, limits: Limits) -> None:
    """A list of inputs: not empty, and at most `--max-client-batch` of them (413)."""
    if not value:
        raise empty(field)
    if len(value) > limits.max_client_batch:
        raise ApiError(413, f"`{field}` has {len(value)} inputs; at most {limits.max_client_batch} per request",
                       "request_too_large")


def within_limit(text: str, field: str, limits: Limits, cut: str | None = None) -> str:
    """`text` if it is within `--max-input-chars`; past it, where the request truncates, cut to it at the `cut`
    end ("right": its start kept), as TEI cuts a text past its character limit before tokenizing (the tokens of
    the rest would be truncated anyway: `--max-input-chars` holds more than a model of up to ~20 k tokens takes);
    else the request's 413 naming `field`."""
    n = limits.max_input_chars
    if len(text) <= n:
        return text
    if cut is None:
        raise ApiError(413, f"`{field}` has {len(text)} characters; at most {n}", "request_too_large")
    return text[:n] if cut == "right" else text[-n:]


def cut_end(truncates: bool, direction: str = "right") -> str | None:
    """The end a text past `--max-input-chars` is cut at (`within_limit`): the request's truncation end where it
    truncates, else None (the 413)."""
    return direction if truncates else None


def _token_ids(ids: list, where: str) -> np.ndarray:
    """A non-empty list of ints in [0, 2**31) as int32, checked in C (a 16 MiB body holds millions of ids): the
    set of the items' types, then numpy's range. An empty one is TEI's 400 Empty (`EncodingInput::is_empty`)."""
    if isinstance(ids, list) and not ids:
        raise empty(where)
    try:
        arr = np.asarray(ids, np.int64) if ids and set(map(type, ids)) == {int} else None
    except OverflowError:  # past int64
        arr = None
    if arr is None or arr.min() < 0 or arr.max() >= 2**31:
        raise ApiError(400, f"`{where}` must be a non-empty list of non-negative token ids")
    return arr.astype(np.int32)


def _long_mode(body: dict, default: str) -> str:
    return _one_of(body, "long", LONG_MODES, default)


def vllm_truncation(body: dict, default: str, max_length: int) -> tuple[str, int | None, str]:
    """(long-input mode, cut, side) of a body with vLLM's `truncate_prompt_tokens`, `truncation_side` and
    `add_special_tokens` (its embeddings, classify, score and rerank requests), as vLLM's renderer applies them
    (`TokenizeParams`): N keeps N tokens of each sequence, special tokens included (a text or pair truncated by the
    tokenizer at N, `longest_first` for a pair; token ids cut at the same end), -1 truncates at the model's limit,
    `max_length`; absent, the mode is `default`. The cut is None at the model's limit. `truncation_side` "right"
    (the default) keeps the first tokens, "left" the last. vLLM refuses N past the model's limit, and a cut to no
    tokens fails there too; `add_special_tokens: false` is refused rather than dropped, which would answer 200 with
    the vectors of other sequences."""
    side = _one_of(body, "truncation_side", ("left", "right"), "right")
    cut = body.get("truncate_prompt_tokens")
    if cut is not None and (not isinstance(cut, int) or isinstance(cut, bool)
                            or not (cut == -1 or 1 <= cut <= max_length)):
        raise ApiError(400, f"`truncate_prompt_tokens` must be -1 (the model's limit) or from 1 to the model's limit "
                            f"of {max_length} tokens, not {_show(cut)}")
    if body.get("add_special_tokens") not in (None, True):
        raise ApiError(400, "`add_special_tokens` must be true: this server always adds the model's special tokens "
                            "to a text")
    if cut is None:
        return default, None, side
    return "truncate", None if cut in (-1, max_length) else cut, side


def vllm_activation(body: dict, *also: str) -> bool:
    """vLLM's `use_activation` (else each field of `also`, as older vLLM's `normalize`), default true: false asks
    for the pooler's output without its activation (an embedding not normalised, a classifier's or cross-encoder's
    logits)."""
    for key in ("use_activation", *also):
        if body.get(key) is not None:
            return _bool(body, key, True)
    return True


def _parameters(body: dict) -> dict:
    """TEI's `parameters` object (absent or null: none); any other type is refused, not read as none."""
    params = body.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ApiError(400, "`parameters` must be an object")
    return params


def _one_of(body: dict, key: str, values: tuple[str, ...], default: str) -> str:
    """A field that names one of `values`; absent or null means `default`."""
    value = body.get(key)
    if value is None:
        return default
    if value not in values:
        raise ApiError(400, f"`{key}` must be one of {', '.join(values)}, not {_show(value)}")
    return value


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def _bool(body: dict, key: str, default):
    """A boolean field; absent or null means `default`."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"`{key}` must be true or false, not {_show(value)}")
    return value


def _prompt(body: dict, limits: Limits) -> tuple[str | None, str | None]:
    """`prompt_name` (TEI) or `prompt` (a text), at most one of them."""
    name, text = body.get("prompt_name"), body.get("prompt")
    for key, value in (("prompt_name", name), ("prompt", text)):
        if value is not None and not isinstance(value, str):
            raise ApiError(400, f"`{key}` must be a string, not {type(value).__name__}")
    if name is not None and text is not None:
        raise ApiError(400, "give `prompt_name` or `prompt`, not both")
    if text is not None:
        within_limit(text, "prompt", limits)
    return name, text


def _openai_body(body) -> dict:
    """An OpenAI embeddings body: an object with `input`."""
    body = _object(body)
    if "input" not in body:
        raise ApiError(400, "missing required field `input`")
    return body


def parse_openai_embeddings(body, limits: Limits, dim: int, default_long: str, max_length: int,
                            declared: tuple[int, ...] = ()) -> EmbedRequest:
    """OpenAI's embeddings body; `dimensions` one of the checkpoint's Matryoshka widths `declared` (or the full
    width) where it declares them, by the rule of Cohere's `output_dimension` (`_dimensions`); vLLM's
    `truncate_prompt_tokens` up to the model's `max_length` (`vllm_truncation`)."""
    body = _openai_body(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "`model` must be a string")
    long, cut, side = vllm_truncation(body, default_long, max_length)
    long = _long_mode(body, long)
    if cut is not None and long != "truncate":
        raise ApiError(400, f"`truncate_prompt_tokens` truncates; `long` {_show(long)} does not")
    texts, ids, ids_at = texts_or_ids(body["input"], "input", limits, cut=cut_end(long == "truncate", side))
    fmt = _one_of(body, "encoding_format", ENCODING_FORMATS, "float")
    element = FLOAT32
    if "embed_dtype" in body or "endianness" in body:
        element = (_one_of(body, "embed_dtype", EMBED_DTYPES, "float32"),
                   _one_of(body, "endianness", ENDIANNESS, "native"))
    return EmbedRequest(texts, ids, long, vllm_activation(body, "normalize"), _dimensions(body, dim, declared), fmt,
                        *_prompt(body, limits), direction=side, model=model, cut=cut, ids_at=ids_at, element=element)


def parse_multivector_embeddings(body, limits: Limits, cut: str | None = None) -> tuple[list[str], str]:
    """PyLate's EmbeddingRequest, OpenAI's shape: `input` (texts), `is_query` (default true, as PyLate's server)
    -> (texts, query or document). `cut`: `texts_of`'."""
    body = _openai_body(body)
    texts = texts_of(body["input"], "input", limits, cut=cut)
    _refuse(body, ("dimensions", "prompt_name", "prompt"), "a multi-vector model",
            "its vectors are per token, and `is_query` picks the query or document marker")
    if body.get("truncate_prompt_tokens") not in (None, -1):
        raise ApiError(400, f"`truncate_prompt_tokens` {_show(body['truncate_prompt_tokens'])} is not supported on a "
                            "multi-vector model: it cuts at its query and document lengths (-1)")
    fmt = body.get("encoding_format")
    if fmt not in (None, "float"):
        raise ApiError(400, f"a multi-vector model's embeddings are float lists: `encoding_format` {_show(fmt)} is not "
                            "supported")
    return texts, "query" if _bool(body, "is_query", True) else "document"


def _dimensions(body: dict, dim: int, declared: tuple[int, ...] = (), key: str = "dimensions") -> int | None:
    """The width a request cuts its vectors to (`key`); with the checkpoint's Matryoshka dimensions `declared`,
    one of them or the full width: the model was trained to be cut there only. `dim`: the width it serves (its
    `truncate_dim`, where it has one): no request is wider."""
    dims = body.get(key)
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= dim):
        raise ApiError(400, f"`{key}` must be an integer from 1 to {dim}, not {_show(dims)}")
    if dims is not None and declared and dims != dim and dims not in declared:
        raise ApiError(400, f"`{key}` {dims} is not one of this model's Matryoshka dimensions "
                            f"({', '.join(str(d) for d in sorted({*declared, dim}) if d <= dim)})")
    return dims


def _direction(body: dict) -> str:
    direction = body.get("truncation_direction")
    if direction is None:
        return "right"
    if not isinstance(direction, str) or direction.lower() not in ("left", "right"):
        raise ApiError(400, f"`truncation_direction` must be Left or Right, not {_show(direction)}")
    return direction.lower()


def _tei_long(body: dict, default_long: str) -> str:
    """TEI's `truncate` (absent: the server's default) -> our long-input mode."""
    truncate = _bool(body, "truncate", None)
    long = default_long if truncate is None else ("truncate" if truncate else "error")
    return _long_mode(body, long)


def parse_tei_embed(body, limits: Limits, dim: int, default_long: str) -> EmbedRequest:
    """TEI /embed (and /embed_all): `inputs` texts or token-id lists (the model's vocabulary, as TEI); an empty text
    is TEI's 400 Empty (`core/src/tokenization.rs`), not the vector of the special tokens alone."""
    body = _object(body)
    if "inputs" not in body:
        raise ApiError(400, "missing required field `inputs`")
    long, direction = _tei_long(body, default_long), _direction(body)
    texts, ids, ids_at = texts_or_ids(body["inputs"], "inputs", limits, blank=False,
                         cut=cut_end(long == "truncate", direction))
    return EmbedRequest(texts, ids, long, _bool(body, "normalize", True), _dimensions(body, dim), "float",
                        *_prompt(body, limits), direction=direction, ids_at=ids_at)


def _refuse(body, keys: tuple[str, ...], route: str, why: str) -> None:
    """400 naming each of `keys` that `body` sets: fields of a sibling route that would do nothing on `route`."""
    if isinstance(body, dict) and (sent := [f"`{k}`" for k in keys if body.get(k) is not None]):
        raise ApiError(400, f"{' and '.join(sent)} do not apply to {route}: {why}")


def parse_tei_embed_all(body, limits: Limits, dim: int, default_long: str) -> EmbedRequest:
    """TEI /embed_all: /embed's body less `normalize` and `dimensions` (every token's state, as the model gives it)."""
    _refuse(body, ("normalize", "dimensions"), "/embed_all", "it returns every token's hidden state as it is")
    return parse_tei_embed(body, limits, dim, default_long)


def parse_tei_embed_sparse(body, limits: Limits, default_long: str) -> EmbedRequest:
    """TEI /embed_sparse: /embed's `inputs`, `truncate`, `truncation_direction` and prompt; one output per input
    (`long: chunk` has no sparse meaning)."""
    _refuse(body, ("normalize", "dimensions"), "/embed_sparse", "its weights are per vocabulary entry, as the model "
                                                                "gives them")
    req = parse_tei_embed(body, limits, 1, default_long)
    if req.long == "chunk":
        raise ApiError(400, "/embed_sparse gives each input's own weights: `long: chunk` does not apply")
    return req


def parse_similarity(body, limits: Limits, default_long: str) -> tuple[EmbedRequest, int]:
    """TEI /similarity: `inputs` {source_sentence, sentences}, `parameters` {truncate, truncation_direction,
    prompt_name} -> (an embed request of source then sentences, how many sentences)."""
    body = _object(body)
    inputs = body.get("inputs")
    if not isinstance(inputs, dict):
        raise ApiError(400, "`inputs` must be an object with `source_sentence` and `sentences`")
    source, sentences = inputs.get("source_sentence"), inputs.get("sentences")
    if not isinstance(source, str):
        raise ApiError(400, "`inputs.source_sentence` must be a string")
    if not isinstance(sentences, list):  # TEI: a Vec<String>, so a string is refused, not read as a list of one
        raise ApiError(400, f"`inputs.sentences` must be a list of strings, not {type(sentences).__name__}")
    if len(sentences) + 1 > limits.max_client_batch:
        raise ApiError(413, f"`inputs.sentences` has {len(sentences)} inputs; at most {limits.max_client_batch - 1} "
                            "besides `source_sentence`", "request_too_large")
    params = _parameters(body)
    long, direction = _tei_long(params, default_long), _direction(params)
    cut = cut_end(long == "truncate", direction)
    sentences = texts_of(sentences, "inputs.sentences", limits, blank=False, cut=cut)
    if not source:
        raise empty("inputs.source_sentence")
    texts = [within_limit(source, "inputs.source_sentence", limits, cut), *sentences]
    return EmbedRequest(texts, None, long, False, None, "float", *_prompt(params, limits),
                        direction=direction), len(texts) - 1


def parse_tokenize(body, limits: Limits) -> tuple[list[str], bool, str | None, str | None]:
    """TEI /tokenize -> (texts, add_special_tokens, prompt_name, prompt): the prompt as /embed takes it."""
    body = _object(body)
    if "inputs" not in body:
        raise ApiError(400, "missing required field `inputs`")
    texts = texts_of(body["inputs"], "inputs", limits, blank=False)
    return texts, _bool(body, "add_special_tokens", True), *_prompt(body, limits)


def parse_vllm_tokenize(body, limits: Limits) -> tuple[str, bool, bool]:
    """vLLM's /tokenize (a completion's shape) -> (prompt, add_special_tokens, return_token_strs)."""
    body = _object(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, f"`prompt` must be a string, not {type(prompt).__name__}")
    return (within_limit(prompt, "prompt", limits), _bool(body, "add_special_tokens", True),
            _bool(body, "return_token_strs", False))


def parse_detokenize(body, limits: Limits, vocab: int) -> np.ndarray:
    """vLLM's /detokenize: `tokens`, one list of the model's token ids (each from 0 to `vocab` - 1)."""
    body = _object(body)
    if not isinstance(body.get("tokens"), list):
        raise ApiError(400, "`tokens` must be a list of token ids")
    ids = _token_ids(body["tokens"], "tokens")
    if len(ids) > limits.max_input_chars:
        raise ApiError(413, f"`tokens` has {len(ids)} ids; at most {limits.max_input_chars}", "request_too_large")
    if ids.max() >= vocab:
        raise ApiError(400, f"`tokens` has token id {int(ids.max())}, outside the vocabulary of {vocab}")
    return ids


def parse_decode(body, limits: Limits, vocab: int) -> tuple[list[list[int]], bool]:
    """TEI /decode: `ids` (one list of token ids, or a list of them), `skip_special_tokens` (default true)."""
    body = _object(body)
    if "ids" not in body:
        raise ApiError(400, "missing required field `ids`")
    ids = body["ids"]
    if isinstance(ids, list) and ids and all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        ids = [ids]
    if not isinstance(ids, list):
        raise ApiError(400, "`ids` must be a list of token ids or a list of such lists")
    _count(ids, "ids", limits)
    for i, seq in enumerate(ids):
        if not isinstance(seq, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                for t in seq):
            raise ApiError(400, f"`ids[{i}]` must be a list of token ids from 0 to {vocab - 1}")
        if not seq:
            raise empty(f"ids[{i}]")
        if len(seq) > limits.max_input_chars:
            raise ApiError(413, f"`ids[{i}]` has {len(seq)} ids; at most {limits.max_input_chars}", "request_too_large")
    return ids, _bool(body, "skip_special_tokens", True)


def shape_vectors(vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The first `dimensions` components (Matryoshka), then, with `normalize`, each row at unit length: cut first,
    as TEI and sentence-transformers' `truncate_dim` do, so `normalize: false` keeps the cut raw."""
    if dimensions is not None and dimensions != vectors.shape[1]:
        vectors = vectors[:, :dimensions]
    # normalize_rows makes a new array; a raw cut is a strided view, made contiguous as the encoders read rows
    return normalize_rows(vectors) if normalize else np.ascontiguousarray(vectors)


# Vectors as integers: Cohere's embedding types, and the same names on /v1/embeddings' `encoding_format` (Azure AI
# Model Inference's values there). See `quantize`.
QUANTIZED = ("int8", "uint8", "binary", "ubinary")
ENCODING_FORMATS = ("float", "base64", *QUANTIZED)


def quantize(vectors: np.ndarray, kind: str) -> np.ndarray:
    """[N, D] float vectors as one of `QUANTIZED`, each vector on its own (no other input of the request moves it).

    ubinary: the bits of `v > 0`, packed 8 to a byte, first dimension in the high bit (np.packbits: [N, ceil(D/8)]
    uint8; Hamming distance compares them); binary: ubinary - 128 as int8. int8: round(127 * v / max|v|), the
    vector's own largest magnitude as its scale, so it uses the whole range and clips nothing; uint8: int8 + 128.
    The scale is not returned: compare int8 vectors by cosine (or normalise them), not by raw dot products."""
    if kind in ("binary", "ubinary"):
        packed = np.packbits(vectors > 0, axis=-1)
        return packed if kind == "ubinary" else (packed ^ np.uint8(0x80)).view(np.int8)
    if kind not in ("int8", "uint8"):
        raise ValueError(f"unknown quantized type {kind!r}")
    vectors = np.asarray(vectors, np.float32)
    peak = np.abs(vectors).max(axis=-1, keepdims=True)
    unit = np.divide(vectors, peak, out=np.zeros_like(vectors), where=peak > 0)  # in [-1, 1]; a zero vector: zeros
    q = np.rint(unit * 127).astype(np.int8)
    return q if kind == "int8" else q.view(np.uint8) ^ np.uint8(0x80)


def b64_rows(vectors: np.ndarray, embed_dtype: str = "float32", endianness: str = "native") -> list[str]:
    """Each vector's bytes in base64 (OpenAI's and Cohere's `base64`; the OpenAI client's default): float32, or
    vLLM's `embed_dtype`, in the host's byte order or vLLM's `endianness`. pybase64's SIMD encoder reads each row
    from the array itself and returns its str: the standard library's encodes a byte at a time and needs a bytes
    copy before and after (docs/benchmarks.md)."""
    order = ">" if endianness == "big" or (endianness == "native" and sys.byteorder == "big") else "<"
    if embed_dtype in ("float32", "float16"):
        rows = np.ascontiguousarray(vectors, order + ("f4" if embed_dtype == "float32" else "f2"))
    else:  # numpy has no bfloat16 or fp8: ml_dtypes' (what JAX's come from), rounded to nearest even as torch's
        import ml_dtypes

        kind = {"bfloat16": ml_dtypes.bfloat16, "fp8_e4m3": ml_dtypes.float8_e4m3fn,
                "fp8_e5m2": ml_dtypes.float8_e5m2}[embed_dtype]
        bits = np.asarray(vectors, np.float32).astype(kind).view(np.uint16 if embed_dtype == "bfloat16" else np.uint8)
        rows = np.ascontiguousarray(bits, bits.dtype.newbyteorder(order))
    return [pybase64.b64encode_as_string(v) for v in rows]


def openai_body(vectors: np.ndarray, model: str, prompt_tokens: int, encoding_format: str,
                element: tuple[str, str] = FLOAT32) -> bytes:
    """The OpenAI embeddings response as JSON bytes: float32 vectors written at float32's shortest repr, base64
    of their bytes (`element`: vLLM's `embed_dtype` and `endianness`), or (`QUANTIZED`) integers."""
    if encoding_format == "base64":
        rows = b64_rows(vectors, *element)
    elif encoding_format in QUANTIZED:
        rows = quantize(vectors, encoding_format)
    else:
        rows = np.ascontiguousarray(vectors, np.float32)  # orjson writes numpy rows itself
    return orjson.dumps({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(rows)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }, option=orjson.OPT_SERIALIZE_NUMPY)


@dataclasses.dataclass(frozen=True)
class ClassifyRequest:
    inputs: list  # texts, or (text, text) pairs
    single: bool  # the body held one input (TEI answers it unwrapped)
    raw_scores: bool = False
    truncate: bool = True
    top_k: int | None = None
    direction: str = "right"
    function: str | None = None  # huggingface_hub's `function_to_apply` (FUNCTIONS); None: the model's default


def _pair_or_text(x, field: str, limits: Limits, cut: str | None, batch: bool = False):
    """A /predict input, a text or a [text, text] pair (`batch`: a [text] or [text, text] list, as a batch's items
    are in TEI), each text within `--max-input-chars` (or cut to it at the `cut` end); an empty text, or a pair of
    two, is TEI's 400 Empty."""
    texts = [x] if isinstance(x, str) and not batch else x
    if isinstance(texts, list) and len(texts) in (1, 2) and all(isinstance(s, str) for s in texts):
        if not any(texts):
            raise empty(field)
        texts = [within_limit(s, field if texts is not x else f"{field}[{i}]", limits, cut)
                 for i, s in enumerate(texts)]
        return texts[0] if len(texts) == 1 else (texts[0], texts[1])
    if batch:
        raise ApiError(400, f"`{field}` must be a [text] or [text, text] list: a batch of `inputs` is a list of "
                            "those, as TEI reads it")
    raise ApiError(400, f"`{field}` must be a string or a [text, text] pair")


FUNCTIONS = ("sigmoid", "softmax", "none")  # a classifier's scores, as huggingface_hub's `text_classification` asks


def parse_predict(body, limits: Limits, default_truncate: bool) -> ClassifyRequest:
    """TEI /predict: `inputs` is one input (a text, or a [text, text] pair, answered flat) or a batch: a list of
    [text] and [text, text] lists, mixed. As TEI reads it, a list that starts with a text is one input, so a list
    of three texts is refused rather than read as three (a batch of two texts is [[a], [b]])."""
    body = _object(body)
    if "inputs" not in body:
        raise ApiError(400, "missing required field `inputs`")
    raw = body["inputs"]
    if not isinstance(raw, (str, list)):
        raise ApiError(400, f"`inputs` must be a text, a [text, text] pair, or a list of [text] and [text, text] "
                            f"lists, not {type(raw).__name__}")
    if not raw and isinstance(raw, list):  # TEI's `PredictInput` refuses it as a body it cannot read: not Empty
        raise ApiError(400, "`inputs` must not be an empty list")
    single = isinstance(raw, str) or isinstance(raw[0], str)
    if single and isinstance(raw, list) and (len(raw) > 2 or not all(isinstance(x, str) for x in raw)):
        raise ApiError(400, "`inputs` that starts with a text is one input, a text or a [text, text] pair; a batch "
                            "is a list of [text] and [text, text] lists, e.g. [[\"a\"], [\"b\"], [\"c\"]]")
    items = [raw] if single else raw
    _count(items, "inputs", limits)
    truncate, direction = _bool(body, "truncate", default_truncate), _direction(body)
    cut = cut_end(truncate, direction)
    inputs = [_pair_or_text(x, f"inputs[{i}]" if not single else "inputs", limits, cut, batch=not single)
              for i, x in enumerate(items)]
    params = _parameters(body)  # huggingface_hub's InferenceClient sends top_k there
    own = lambda key: body[key] if body.get(key) is not None else params.get(key)  # the body's, else parameters'
    top_k = own("top_k")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ApiError(400, f"`top_k` must be a positive integer, not {_show(top_k)}")
    function = own("function_to_apply")
    if function is not None and function not in FUNCTIONS:
        raise ApiError(400, f"`function_to_apply` must be one of {', '.join(FUNCTIONS)}, not {_show(function)}")
    return ClassifyRequest(inputs, single, _bool(body, "raw_scores", False), truncate, top_k, direction, function)


def parse_rerank(body, limits: Limits, default_truncate: bool) -> tuple[str, list[str], bool, bool, bool, str]:
    """TEI /rerank -> (query, texts, raw_scores, return_text, truncate, truncation direction)."""
    body = _object(body)
    for key in ("query", "texts"):
        if key not in body:
            raise ApiError(400, f"missing required field `{key}`")
    query = body["query"]
    if not isinstance(query, str) or not query:
        raise ApiError(400, "`query` must be a non-empty string")
    truncate, direction = _bool(body, "truncate", default_truncate), _direction(body)
    cut = cut_end(truncate, direction)
    query = within_limit(query, "query", limits, cut)
    texts = texts_of(body["texts"], "texts", limits, cut=cut)
    return query, texts, _bool(body, "raw_scores", False), _bool(body, "return_text", False), truncate, direction


def parse_classify(body, limits: Limits, cut: str | None = None) -> list[str]:
    """vLLM-style /classify: `input` is a text or a list of texts (`cut`: `texts_of`')."""
    body = _object(body)
    if "input" not in body:
        raise ApiError(400, "missing required field `input`")
    texts = texts_of(body["input"], "input", limits, cut=cut)
    return texts


def scores(logits: np.ndarray, raw: bool, function: str | None = None) -> np.ndarray:
    """Logits -> probabilities: sigmoid for one logit (cross-encoders), softmax otherwise, unless `function` (one
    of FUNCTIONS) names one; `raw`, or `function` "none": the logits. A NaN (a logit past float range) is the
    batch's failure, as TEI answers it (424 Backend there), never a `null` score sorted anywhere."""
    if raw or function == "none":
        out = logits
    elif function == "sigmoid" or (function is None and logits.shape[-1] == 1):
        out = 1 / (1 + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max(-1, keepdims=True))
        out = e / e.sum(-1, keepdims=True)
    if np.isnan(out).any():
        raise ApiError(500, "score is NaN", "server_error")
    return out


def tei_order(scores) -> list[int]:
    """Indices best first as TEI's /rerank and /predict order them: a stable ascending sort reversed, so equal
    scores come highest index first."""
    return np.argsort(np.asarray(scores), kind="stable")[::-1].tolist()


# ---- Cohere's v2 API: /v2/embed and /v2/rerank ----

# Cohere's `input_type` -> the names of the checkpoint prompt it stands for, tried in order, case-insensitively:
# Nomic's prefixes by their own names, then sentence-transformers' usual "query"/"document" (Qwen3-Embedding,
# EmbeddingGemma, arctic-embed), then EmbeddingGemma's task names, then Jina-embeddings-v3's tasks (its
# `separation` is for clustering; `text-matching` has no input_type). None found: the request's default prompt.
# A Jina-v3 task other than the server's is refused by `EmbeddingConfig.prompt`, not served with the wrong adapter.
INPUT_TYPE_PROMPTS = {
    "search_query": ("search_query", "query", "retrieval-query", "retrieval.query"),
    "search_document": ("search_document", "document", "passage", "retrieval-document", "retrieval.passage"),
    "classification": ("classification",),
    "clustering": ("clustering", "separation"),
}
COHERE_TRUNCATE = {"NONE": ("error", "right"), "START": ("truncate", "left"), "END": ("truncate", "right")}
COHERE_EMBEDDING_TYPES = ("float", *QUANTIZED, "base64")


def cohere_prompt(input_type, prompts) -> str | None:
    """The name among `prompts` (the checkpoint's prompt names) that Cohere's `input_type` stands for, or None."""
    if input_type is None:
        return None
    if input_type == "image":
        raise ApiError(400, "`input_type` image: this server embeds text only")
    if not isinstance(input_type, str) or input_type not in INPUT_TYPE_PROMPTS:
        raise ApiError(400, f"`input_type` must be one of {', '.join(INPUT_TYPE_PROMPTS)}, not {_show(input_type)}")
    names = {}
    for name in prompts:
        names.setdefault(name.lower(), name)
    return next((names[n] for n in INPUT_TYPE_PROMPTS[input_type] if n in names), None)


def _cohere_max_tokens(body: dict, key: str, limit: int) -> None:
    """`max_tokens` / `max_tokens_per_doc`: inputs are cut at the model's limit, so only a value at or above it."""
    value = body.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < limit):
        raise ApiError(400, f"`{key}` must be an integer of at least {limit}: this server cuts inputs at the model's "
                            f"limit of {limit} tokens, not {_show(value)}")


def parse_cohere_embed(body, limits: Limits, dim: int, default_long: str, prompts, max_tokens: int,
                       declared: tuple[int, ...] = ()) -> tuple[EmbedRequest, tuple[str, ...]]:
    """Cohere /v2/embed (and v1's /v1/embed): `texts`, `input_type` (a prompt: `cohere_prompt`), `embedding_types`
    (absent: () and floats), `output_dimension` (Matryoshka: one of `declared` when the checkpoint declares them),
    `truncate` NONE/START/END (absent: the server's long-input mode) -> (the embed request, the types asked for)."""
    body = _object(body)
    for key in ("images", "inputs"):
        if body.get(key):
            raise ApiError(400, f"`{key}` is not supported: this server embeds text only; send `texts`")
    if "texts" not in body:
        raise ApiError(400, "missing required field `texts`")
    types = body.get("embedding_types")
    if types is None:
        types = []
    elif not isinstance(types, list) or not types or not all(t in COHERE_EMBEDDING_TYPES for t in types):
        raise ApiError(400, f"`embedding_types` must be a non-empty list of {', '.join(COHERE_EMBEDDING_TYPES)}, "
                            f"not {_show(types)}")
    truncate = body.get("truncate")
    if truncate is None:
        long, direction = default_long, "right"
    elif isinstance(truncate, str) and truncate.upper() in COHERE_TRUNCATE:
        long, direction = COHERE_TRUNCATE[truncate.upper()]
    else:
        raise ApiError(400, f"`truncate` must be one of {', '.join(COHERE_TRUNCATE)}, not {_show(truncate)}")
    texts = texts_of(body["texts"], "texts", limits, cut=cut_end(long == "truncate", direction))
    _cohere_max_tokens(body, "max_tokens", max_tokens)
    return EmbedRequest(texts, None, long, True, _dimensions(body, dim, declared, "output_dimension"), "float",
                        cohere_prompt(body.get("input_type"), prompts), direction=direction), tuple(dict.fromkeys(types))


def cohere_embed_body(vectors: np.ndarray, types: tuple[str, ...], texts: list[str], tokens: int,
                      version: str = "2") -> bytes:
    """Cohere's EmbedByTypeResponse as JSON bytes: per type asked for (v2's default: float), every vector in it
    (`quantize`, `b64_rows`). v1 without `embedding_types` answers its EmbeddingsFloatsEmbedResponse: a list of
    float vectors."""
    floats = np.ascontiguousarray(vectors, np.float32)
    if not types and version == "1":
        embeddings, kind = floats, "embeddings_floats"
    else:
        embeddings = {t: floats if t == "float" else b64_rows(vectors) if t == "base64" else quantize(vectors, t)
                      for t in types or ("float",)}
        kind = "embeddings_by_type"
    return orjson.dumps({"id": uuid.uuid4().hex, "embeddings": embeddings, "texts": texts,
                         "meta": {"api_version": {"version": version}, "billed_units": {"input_tokens": tokens}},
                         "response_type": kind}, option=orjson.OPT_SERIALIZE_NUMPY)


@dataclasses.dataclass(frozen=True)
class CohereRerank:
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = False


def parse_cohere_rerank(body, limits: Limits, max_tokens: int, cut: str | None = None) -> CohereRerank:
    """Cohere /v2/rerank: `query`, `documents` (strings), `top_n`, `return_documents` (v2's earlier field; the
    latest SDK sends none), `max_tokens_per_doc` (at least the model's limit); `relevant_spans` is accepted and
    none are returned (Cohere returns spans only where the model found some). `cut`: `texts_of`'."""
    body = _object(body)
    for key in ("query", "documents"):
        if key not in body:
            raise ApiError(400, f"missing required field `{key}`")
    query = body["query"]
    if not isinstance(query, str) or not query.strip():
        raise ApiError(400, "`query` must be a non-empty string")
    query = within_limit(query, "query", limits, cut)
    documents = texts_of(body["documents"], "documents", limits, cut=cut)
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
        raise ApiError(400, f"`top_n` must be a positive integer, not {_show(top_n)}")
    _cohere_max_tokens(body, "max_tokens_per_doc", max_tokens)
    return CohereRerank(query, documents, top_n, _bool(body, "return_documents", False))


def cohere_rerank_body(scores: np.ndarray, req: CohereRerank, tokens: int) -> bytes:
    """Cohere's V2RerankResponse as JSON bytes: the best `top_n` documents, best first (ties in input order)."""
    order = np.argsort(-scores, kind="stable")[: req.top_n].tolist()
    best = scores[order].tolist()
    results = [{"index": i, "relevance_score": s, **({"document": {"text": req.documents[i]}}
                                                     if req.return_documents else {})} for i, s in zip(order, best)]
    return orjson.dumps({"id": uuid.uuid4().hex, "results": results,
                         "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}}})

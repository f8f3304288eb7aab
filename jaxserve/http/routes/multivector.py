"""HTTP for multi-vector (ColBERT) models: PyLate's server route, and TEI's /rerank scored by MaxSim.

- `POST /v1/embeddings` (and `/embeddings`), as PyLate's server answers it:
  `{"input": str | [str], "is_query": true, "model"?}` -> `{"object": "list",
  "data": [{"object": "embedding", "embedding": [[float] * dim] * tokens,
  "index"}], "model", "usage"}`: per input its own tokens, no padding (queries:
  the fixed expansion length; documents: their tokens less the skiplist).
  Infinity's clients read multi-vector embeddings from the same OpenAI shape.
- `POST /rerank` (TEI's request and response): the query and the texts encoded
  as one query and many documents, in one batch window, scored by MaxSim as
  PyLate's `rank.rerank` and MultiVectorEncoder's `similarity` do.
"""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
from aiohttp import web

from jaxserve.heads import multivector
from jaxserve.http import api
from jaxserve.http.api import ApiError
from jaxserve.http.classes import NO_ASK, Ask
from jaxserve.http.handling import bytes_response, json_response, respond, run_request
from jaxserve.http.state import AppState


def _long(state: AppState) -> str:
    return "error" if state.config.long == "error" else "truncate"


async def encode(state: AppState, texts: list[str], kind: str, long: str,
                 ask: Ask = NO_ASK) -> tuple[list[np.ndarray], int]:
    """Texts through the batcher as `kind` sequences -> (per text its token vectors, tokens run)."""
    enc = state.encoder
    ran = await run_request(state, lambda: enc.multivector_pieces(texts, kind, long), output="tokens",
                            ask=ask, inputs=len(texts))
    vectors = [ran.job.token_vectors(p) for p in range(ran.pieces.count)]
    return multivector.outputs(enc.colbert, kind, ran.pieces.seqs, vectors), ran.tokens


async def embeddings(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    texts, kind = api.parse_multivector_embeddings(body, state.limits)
    vectors, tokens = await encode(state, texts, kind, _long(state), ask)
    floats = sum(v.size for v in vectors)
    encoded, _ = await respond(state, lambda: orjson.dumps({
        "object": "list",
        "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)],
        "model": state.model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }, option=orjson.OPT_SERIALIZE_NUMPY), floats)
    return bytes_response(encoded)


async def rerank(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    """TEI /rerank by MaxSim: [{index, score, text?}], best first (`raw_scores` changes nothing: MaxSim is raw)."""
    query, texts, _, return_text, truncate, direction = api.parse_rerank(body, state.limits, state.config.long != "error")
    if direction != "right":
        raise ApiError(400, "a multi-vector model truncates the right end only (as PyLate and MultiVectorEncoder)")
    long = "truncate" if truncate else "error"
    (q, _), (docs, _) = await asyncio.gather(encode(state, [query], "query", long, ask),
                                            encode(state, texts, "document", long, ask))
    scores = multivector.maxsim(q[0], docs, mean=state.encoder.colbert.similarity == "meanmaxsim")
    ranked = sorted(enumerate(scores.tolist()), key=lambda t: -t[1])
    return json_response([{"index": i, "score": s, **({"text": texts[i]} if return_text else {})} for i, s in ranked])

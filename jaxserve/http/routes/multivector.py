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

import numpy as np
import orjson
from aiohttp import web

from jaxserve.heads import multivector
from jaxserve.http import api
from jaxserve.http.api import ApiError
from jaxserve.http.classes import NO_ASK, Ask
from jaxserve.http.handling import Ran, bytes_response, respond, run_request, together
from jaxserve.http.state import AppState
from jaxserve.scheduling.jobs import ragged_arange


def _long(state: AppState) -> str:
    return "error" if state.config.long == "error" else "truncate"


async def run(state: AppState, texts: list[str], kind: str, long: str, ask: Ask = NO_ASK) -> Ran:
    """Texts through the batcher as `kind` sequences (their token outputs)."""
    enc = state.encoder
    return await run_request(state, lambda: enc.multivector_pieces(texts, kind, long), output="tokens", ask=ask,
                             inputs=len(texts))


def token_outputs(state: AppState, ran: Ran, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """A run's outputs as its texts' token vectors, back to back in text order, skiplist tokens dropped: (vectors
    [T, dim], offsets [texts + 1]). One gather of every kept token: on a respond thread when large."""
    job = ran.job
    order = ragged_arange(job.seq_start, job.lengths)  # the job's tokens (row order) in text order
    keep, offsets = multivector.kept(state.encoder.colbert, kind, ran.pieces.ids, ran.pieces.offsets)
    return ran.out[order if keep is None else order[keep]], offsets


async def embeddings(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    long = _long(state)
    texts, kind = api.parse_multivector_embeddings(body, state.limits, api.cut_end(long == "truncate"))
    ran = await run(state, texts, kind, long, ask)

    def encode() -> bytes:
        """The body, one text's vectors at a time: orjson holds the GIL for the whole of one call (as `+` of bytes
        does), so one call for a thousand texts' vectors would stall the event loop on this thread's behalf; one
        join of the pieces, which lets go of it, copies them once."""
        parts = [b'{"object":"list","data":[']
        for i, v in enumerate(multivector.split(*token_outputs(state, ran, kind))):
            parts += (b"," if i else b"", b'{"object":"embedding","embedding":',
                      orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY), b',"index":%d}' % i)
        rest = orjson.dumps({"model": state.model_name, "usage": {"prompt_tokens": ran.tokens,
                                                                  "total_tokens": ran.tokens}})
        return b"".join((*parts, b"],", rest[1:]))

    encoded, _ = await respond(state, encode, ran.floats)
    return bytes_response(encoded)


async def rerank(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    """TEI /rerank by MaxSim: [{index, score, text?}], best first (`raw_scores` changes nothing: MaxSim is raw)."""
    query, texts, _, return_text, truncate, direction = api.parse_rerank(body, state.limits, state.config.long != "error")
    if direction != "right":
        raise ApiError(400, "a multi-vector model truncates the right end only (as PyLate and MultiVectorEncoder)")
    long = "truncate" if truncate else "error"
    q, docs = await together(run(state, [query], "query", long, ask), run(state, texts, "document", long, ask))

    def ranked() -> bytes:
        scores = multivector.maxsim_flat(token_outputs(state, q, "query")[0], *token_outputs(state, docs, "document"),
                                         mean=state.encoder.colbert.similarity == "meanmaxsim")
        best = scores.tolist()
        return orjson.dumps([{"index": i, "score": best[i], **({"text": texts[i]} if return_text else {})}
                             for i in api.tei_order(scores)])

    encoded, _ = await respond(state, ranked, q.floats + docs.floats)
    return bytes_response(encoded)

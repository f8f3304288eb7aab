"""HTTP for BGE-M3 models: all three outputs of one forward in one request, and TEI's /embed_sparse.

- `POST /embed_m3`: TEI's /embed body (`inputs`, `truncate`, `truncation_direction`, `normalize`, `dimensions`,
  `prompt_name` / `prompt`) with FlagEmbedding's `encode` flags `return_dense`, `return_sparse` and
  `return_colbert_vecs` (each true unless sent false) -> FlagEmbedding's result, per input:
  `{"dense_vecs": [[float] * hidden], "lexical_weights": [{"<token id>": float}],
  "colbert_vecs": [[[float] * dim] * (tokens - 1)]}`, null for an output not asked for.
- `POST /embed_sparse` on a BGE-M3 server: its lexical weights in TEI's shape, per input
  [{"index", "value"}] in index order, as a SPLADE server answers.
/embed, /v1/embeddings and the other dense routes serve the dense output as for any embedding model (the
pooled executables: no token outputs copied back).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from jaxserve.heads import bge_m3
from jaxserve.http import api
from jaxserve.http.api import ApiError
from jaxserve.http.classes import NO_ASK, Ask
from jaxserve.http.handling import Ran, bytes_response, embedding_pieces, parsed, respond, run_request, tei_headers
from jaxserve.http.state import AppState

FLAGS = ("return_dense", "return_sparse", "return_colbert_vecs")  # FlagEmbedding's, in bge_m3.OUTPUTS' order


def require_m3(state: AppState, route: str) -> None:
    if state.encoder.m3 is None:
        raise api.wrong_model(f"{route} needs a BGE-M3 model ({bge_m3.COLBERT_FILE} and {bge_m3.SPARSE_FILE} "
                              f"beside its weights); this server serves {state.model_name}")
    if "tokens" not in state.encoder.engine.tables:
        raise ApiError(400, f"{route} needs token outputs, off on this server (started with --no-embed-all)")


def parse(body, state: AppState, route: str) -> tuple[api.EmbedRequest, tuple[str, ...]]:
    """/embed's fields and the three flags -> the request and the outputs it asks for (400 for none)."""
    req = api.parse_tei_embed(body, state.limits, state.encoder.dim, state.config.long)
    if req.long == "chunk":
        raise ApiError(400, f"{route} gives each input's own outputs: `long: chunk` does not apply")
    wanted = tuple(o for o, flag in zip(bge_m3.OUTPUTS, FLAGS) if api._bool(body, flag, True))
    if not wanted:
        raise ApiError(400, f"ask for at least one of {', '.join(FLAGS)}")
    return req, wanted


async def run(state: AppState, req: api.EmbedRequest, ask: Ask) -> Ran:
    """The request's inputs through the batcher for their token outputs (`forwards.m3_forward`'s rows)."""
    return await run_request(state, lambda: embedding_pieces(state, req), output="tokens", ask=ask, inputs=req.count)


def outputs(state: AppState, ran: Ran, wanted: tuple[str, ...]) -> dict:
    """A run's token outputs -> the outputs `wanted` (`bge_m3.outputs`): request-sized, on a respond thread."""
    vectors = [ran.job.token_vectors(p) for p in range(ran.pieces.count)]
    return bge_m3.outputs(state.encoder.m3, ran.pieces.ids, ran.pieces.offsets, vectors, wanted)


async def embed_m3(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    require_m3(state, "/embed_m3")
    req, wanted = await parsed(state, ask, lambda: parse(body, state, "/embed_m3"))
    ran = await run(state, req, ask)

    def encode() -> bytes:
        """One orjson call per input's ColBERT vectors (as the multi-vector route: orjson holds the GIL for a
        whole call), the pieces joined once."""
        got = outputs(state, ran, wanted)
        dump = lambda x: orjson.dumps(x, option=orjson.OPT_SERIALIZE_NUMPY)
        dense = got.get("dense")
        if dense is not None:
            dense = api.shape_vectors(dense, req.dimensions, req.normalize)
        colbert = got.get("multivector")
        return b"".join((
            b'{"dense_vecs":', b"null" if dense is None else dump(dense),
            b',"lexical_weights":', dump(bge_m3.lexical_weights(got["sparse"])) if "sparse" in got else b"null",
            b',"colbert_vecs":', b"null" if colbert is None else b"[" + b",".join(map(dump, colbert)) + b"]",
            b"}"))

    encoded, _ = await respond(state, encode, ran.floats)
    return bytes_response(encoded)


async def embed_sparse(state: AppState, body, ask: Ask = NO_ASK) -> web.Response:
    """TEI's /embed_sparse: per input its lexical weights [{"index", "value"}], index order."""
    require_m3(state, "/embed_sparse")
    req = await parsed(state, ask, lambda: api.parse_tei_embed_sparse(body, state.limits, state.config.long))
    ran = await run(state, req, ask)
    records = lambda: bge_m3.index_values(outputs(state, ran, ("sparse",))["sparse"])
    encoded, _ = await respond(state, lambda: orjson.dumps(records()), ran.floats)
    return bytes_response(encoded, tei_headers(state, ran, req.inputs))

"""The OpenAPI 3.1 document of every route (served at /openapi.json; fuzzed by schemathesis in the tests)."""

from __future__ import annotations

from jaxserve.http.api import COHERE_EMBEDDING_TYPES, EMBED_DTYPES, ENCODING_FORMATS, ENDIANNESS, FUNCTIONS

TEXTS = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]}
ONE_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
TOKEN_IDS = {"oneOf": [ONE_IDS, {"type": "array", "items": ONE_IDS, "minItems": 1}]}
# texts, token ids, or (TEI's `Input::Batch`) both in one list
TEXTS_OR_IDS = {"anyOf": [TEXTS, TOKEN_IDS, {"type": "array", "items": {"oneOf": [{"type": "string"}, ONE_IDS]},
                                             "minItems": 1}]}
LONG = {"type": "string", "enum": ["truncate", "chunk", "error"],
        "description": "what to do with an input over the model's limit (extension)"}

PROMPT = {"prompt_name": {"type": "string", "description": "one of the model's prompts (/info), put before each input"},
          "prompt": {"type": "string", "description": "a prompt text put before each input (not with prompt_name)"}}

DIRECTION = {"type": "string", "enum": ["Right", "Left", "right", "left"]}
INSTRUCTION = {"instruction": {"type": "string", "description": "the task in the prompt's instruction slot (LLM "
                               "rerankers with one, as Qwen3-Reranker); others refuse it with a 4xx"}}

VLLM_FIELDS = {  # vLLM's pooling fields
    "truncate_prompt_tokens": {"type": "integer", "minimum": -1, "description": "the tokens each input (or pair) "
                               "keeps, special tokens included, 1 to the model's limit; -1: the model's limit"},
    "truncation_side": {"type": "string", "enum": ["right", "left"],
                        "description": "which end a cut keeps (right: the first tokens)"},
    "use_activation": {"type": "boolean", "description": "false: the pooler's output without its activation (an "
                       "embedding not normalised, a logit)"}}

JINA_RERANK = {"type": "object", "required": ["query", "documents"], "properties": {  # vLLM's (Jina's) rerank body
    "query": {"type": "string", "minLength": 1}, "model": {"type": "string"},
    "documents": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "top_n": {"type": "integer", "minimum": 0}, "return_documents": {"type": "boolean"}, **INSTRUCTION, **VLLM_FIELDS}}

EMBED_BODY = {"type": "object", "required": ["inputs"], "properties": {
    "inputs": TEXTS_OR_IDS, "normalize": {"type": "boolean"}, "truncate": {"type": "boolean"},
    "truncation_direction": DIRECTION, "dimensions": {"type": "integer", "minimum": 1}, "long": LONG, **PROMPT}}
FUNCTION = {"type": "string", "enum": list(FUNCTIONS)}
# /embed's body less what a per-token or per-vocabulary-entry output has no use for (refused there: api._refuse)
TOKENS_BODY = {**EMBED_BODY, "properties": {k: v for k, v in EMBED_BODY["properties"].items()
                                           if k not in ("normalize", "dimensions")}}
MATRIX = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
M3_FLAGS = {flag: {"type": "boolean", "description": "FlagEmbedding's flag (default true)"}
            for flag in ("return_dense", "return_sparse", "return_colbert_vecs")}
# BGE-M3's three outputs, per input (FlagEmbedding's `encode` result); null for an output not asked for
M3_OK = {"type": "object", "required": ["dense_vecs", "lexical_weights", "colbert_vecs"], "properties": {
    "dense_vecs": {"oneOf": [{"type": "null"}, MATRIX]},
    "lexical_weights": {"oneOf": [{"type": "null"}, {"type": "array", "items": {
        "type": "object", "additionalProperties": {"type": "number"},
        "description": "token id (as a string) -> its weight"}}]},
    "colbert_vecs": {"oneOf": [{"type": "null"}, {"type": "array", "items": MATRIX}]}}}

EMBEDDINGS_BODY = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "input": TEXTS_OR_IDS,
        "model": {"type": "string"},
        "encoding_format": {"type": "string", "enum": list(ENCODING_FORMATS)},
        "embed_dtype": {"type": "string", "enum": list(EMBED_DTYPES), "description": "vLLM's: base64's element type"},
        "endianness": {"type": "string", "enum": list(ENDIANNESS), "description": "vLLM's: base64's byte order"},
        "dimensions": {"type": "integer", "minimum": 1},
        "user": {"type": "string"},
        "long": LONG,
        **VLLM_FIELDS,
        "is_query": {"type": "boolean", "description": "multi-vector (ColBERT) models, as PyLate's server: "
                     "encode as queries (default) or documents"},
        **PROMPT,
    },
}

TEI_ERROR = {"type": "object", "required": ["error", "error_type"],
             "properties": {"error": {"type": "string"}, "error_type": {"type": "string", "enum": [
                 "Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty", "Unauthorized"]}}}

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"],
                             "properties": {"message": {"type": "string"}, "type": {"type": "string"}}}},
}


COHERE_ERROR = {"type": "object", "required": ["message"], "properties": {"id": {"type": "string"},
                                                                        "message": {"type": "string"}}}


def _post(summary: str, body: dict, ok: dict, error: dict = ERROR) -> dict:
    """An OpenAI-shaped route (`error`: another API's error shape, the same codes)."""
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": ok}}},
            **{code: {"description": what, "content": {"application/json": {"schema": error}}} for code, what in [
                ("400", "invalid request, or a route this model does not support"), ("401", "missing or wrong API key"),
                ("413", "too large: body, inputs, characters, or an over-length input"),
                ("429", "queue or concurrency limit reached; see Retry-After"),
                ("500", "the device step of this request's batch failed"),
                ("503", "warming up, draining, or timed out; see Retry-After")]},
        },
    }}


def _tei(summary: str, body: dict, ok: dict) -> dict:
    """A TEI route: TEI's error shape and codes."""
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": ok}}},
            **{code: {"description": what, "content": {"application/json": {"schema": TEI_ERROR}}} for code, what in [
                ("400", "an empty input (Empty)"), ("401", "missing or wrong API key"),
                ("413", "body too large"), ("422", "invalid request (Validation, Tokenizer)"),
                ("424", "the device step of this request's batch failed (Backend)"),
                ("429", "queue or concurrency limit reached (Overloaded); see Retry-After"),
                ("503", "warming up, draining, timed out or unhealthy (Unhealthy); see Retry-After")]},
        },
    }}


def _get(summary: str, content_type: str = "application/json") -> dict:
    return {"get": {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {content_type: {"schema": {}}}},
        "401": {"description": "missing or wrong API key", "content": {"application/json": {"schema": ERROR}}},
        "503": {"description": "not ready", "content": {"application/json": {"schema": {}}}},
    }}}


def _by_name(get: dict) -> dict:
    """A GET of the served model by its name: the path's parameter, and a 404 for another name."""
    return {**get, "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {**get["responses"], "404": {"description": "no model of that name",
                                                      "content": {"application/json": {"schema": ERROR}}}}}


def spec(version: str) -> dict:
    # a vector, its base64, or (a multi-vector model) per token a vector
    vector = {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}, MATRIX]}
    embeddings_ok = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": {"type": "object", "required": ["index", "embedding"], "properties": {
            "object": {"const": "embedding"}, "index": {"type": "integer"}, "embedding": vector}}},
        "model": {"type": "string"},
        "usage": {"type": "object"},
        "explain": {"type": "object"},
    }}
    text_or_pair = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2}  # [text] or a pair
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve", "version": version,
                 "description": "Transformer encoders at static-shape buckets: OpenAI- and TEI-compatible routes."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{}, {"bearer": []}],
        "paths": {
            "/v1/embeddings": _post("OpenAI embeddings (`?explain=1` adds the latency math)", EMBEDDINGS_BODY,
                                    embeddings_ok),
            "/embeddings": _post("OpenAI embeddings (TEI's name for /v1/embeddings)", EMBEDDINGS_BODY, embeddings_ok),
            "/v1/plan": _post("The plan and predicted times of an embeddings body, without running it",
                              EMBEDDINGS_BODY, {"type": "object"}),
            "/embed": _tei("TEI /embed", EMBED_BODY, MATRIX),
            "/embed_all": _tei("TEI /embed_all: every token's last hidden state", TOKENS_BODY,
                               {"type": "array", "items": MATRIX}),
            "/embed_m3": _tei("BGE-M3: dense, sparse (lexical weights) and multi-vector (ColBERT) outputs of one "
                              "forward", {**EMBED_BODY, "properties": {**EMBED_BODY["properties"], **M3_FLAGS}},
                              M3_OK),
            "/embed_sparse": _tei("TEI /embed_sparse (SPLADE models): per input its non-zero weights, index order",
                                  TOKENS_BODY,
                                  {"type": "array", "items": {"type": "array", "items": {
                                      "type": "object", "required": ["index", "value"], "properties": {
                                          "index": {"type": "integer", "minimum": 0}, "value": {"type": "number"}}}}}),
            "/similarity": _tei("TEI /similarity: cosine of source_sentence to each of sentences", {
                "type": "object", "required": ["inputs"], "properties": {
                    "inputs": {"type": "object", "required": ["source_sentence", "sentences"], "properties": {
                        "source_sentence": {"type": "string"},
                        "sentences": {"type": "array", "items": {"type": "string"}, "minItems": 1}}},
                    "parameters": {"type": "object", "properties": {
                        "truncate": {"type": "boolean"}, "truncation_direction": DIRECTION, **PROMPT}}}},
                {"type": "array", "items": {"type": "number"}}),
            "/tokenize": _tei("TEI /tokenize; a body with `prompt` and no `inputs` as vLLM's /tokenize", {"anyOf": [
                {"type": "object", "required": ["inputs"], "properties": {
                    "inputs": TEXTS, "add_special_tokens": {"type": "boolean"}, **PROMPT}},
                {"type": "object", "required": ["prompt"], "properties": {  # vLLM's
                    "prompt": {"type": "string"}, "model": {"type": "string"},
                    "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"}}}]},
                {"oneOf": [{"type": "array"}, {"type": "object", "required": ["count", "max_model_len", "tokens"]}]}),
            "/detokenize": _post("vLLM's /detokenize", {"type": "object", "required": ["tokens"], "properties": {
                "tokens": ONE_IDS,
                "model": {"type": "string"}}}, {"type": "object", "required": ["prompt"]}),
            "/decode": _tei("TEI /decode", {"type": "object", "required": ["ids"], "properties": {
                "ids": TOKEN_IDS, "skip_special_tokens": {"type": "boolean"}}},
                {"type": "array", "items": {"type": "string"}}),
            "/predict": _tei("TEI /predict (classifier models)", {"type": "object", "required": ["inputs"], "properties": {
                "inputs": {"oneOf": [{"type": "string"}, text_or_pair,  # one input; else a batch of [text] and pairs
                                     {"type": "array", "items": text_or_pair, "minItems": 1}]},
                "raw_scores": {"type": "boolean"}, "truncate": {"type": "boolean"}, "truncation_direction": DIRECTION,
                "top_k": {"type": "integer", "minimum": 1}, "function_to_apply": FUNCTION,
                "parameters": {"type": "object", "properties": {  # huggingface_hub's text_classification
                    "top_k": {"type": "integer", "minimum": 1}, "function_to_apply": FUNCTION}}}}, {"type": "array"}),
            "/rerank": _tei("TEI /rerank (cross-encoder models; multi-vector models score by MaxSim); a body in Jina's "
                            "shape (documents, no texts) as vLLM's /v1/rerank", {"anyOf": [
                                {"type": "object", "required": ["query", "texts"],
                                 "properties": {"query": {"type": "string", "minLength": 1},
                                                "texts": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                                                "raw_scores": {"type": "boolean"}, "return_text": {"type": "boolean"},
                                                "truncate": {"type": "boolean"}, "truncation_direction": DIRECTION,
                                                **INSTRUCTION}},
                                JINA_RERANK]},
                            {"oneOf": [{"type": "array", "items": {"type": "object", "required": ["index", "score"]}},
                                       {"type": "object"}]}),
            "/": {**_tei("TEI's root: the model kind's route (/embed, /embed_sparse, /similarity, /predict or /rerank)",
                         {"type": "object"}, {"type": "array"}),
                  **_get("health (as TEI's GET /)")},
            "/invocations": _tei("SageMaker's route: as POST /", {"type": "object"}, {"type": "array"}),
            "/vertex": _tei("TEI's Vertex AI route: each of `instances` run as POST / runs it", {
                "type": "object", "required": ["instances"], "properties": {
                    "instances": {"type": "array", "items": {"type": "object"}, "minItems": 1}}},
                {"type": "object", "required": ["predictions"], "properties": {"predictions": {"type": "array"}}}),
            "/ping": _get("health (SageMaker)"),
            "/classify": _post("vLLM-style /classify (classifier models)", {"type": "object", "required": ["input"],
                               "properties": {"input": TEXTS, "model": {"type": "string"}, **VLLM_FIELDS}},
                               {"type": "object"}),
            "/v1/rerank": _post("vLLM's /v1/rerank (cross-encoder and LLM rerankers)", JINA_RERANK, {"type": "object"}),
            **{path: _post("vLLM's /score: text_1 against each of text_2, or pairwise", {
                "type": "object", "required": ["text_1", "text_2"], "properties": {
                    "text_1": TEXTS, "text_2": TEXTS, "model": {"type": "string"}, **INSTRUCTION, **VLLM_FIELDS}},
                {"type": "object"})
               for path in ("/score", "/v1/score")},
            **{path: _post(f"Cohere's {version} embed: float, int8, uint8, binary, ubinary and base64 embeddings", {
                "type": "object", "required": ["texts"], "properties": {
                    "texts": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    "model": {"type": "string"},
                    "input_type": {"type": "string", "enum": ["search_query", "search_document", "classification",
                                                              "clustering"]},
                    "embedding_types": {"type": "array", "items": {"type": "string",
                                                                   "enum": list(COHERE_EMBEDDING_TYPES)}},
                    "output_dimension": {"type": "integer", "minimum": 1},
                    "truncate": {"type": "string", "enum": ["NONE", "START", "END"]}}},
                {"type": "object"}, COHERE_ERROR) for path, version in (("/v2/embed", "v2"), ("/v1/embed", "v1"))},
            "/v2/rerank": _post("Cohere's v2 rerank", {
                "type": "object", "required": ["query", "documents"], "properties": {
                    "query": {"type": "string", "minLength": 1}, "model": {"type": "string"},
                    "documents": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    "top_n": {"type": "integer", "minimum": 1}}}, {"type": "object"}, COHERE_ERROR),
            "/health": _get("200 when ready; 503 while warming or draining (no auth)"),
            "/info": _get("model, device, limits and the bucket table with its memory math"),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/openapi.json": _get("this document"),
            "/v1/models": _get("OpenAI's model list: the served model (also /models, as Infinity)"),
            "/models": _get("OpenAI's model list, where Infinity serves it"),
            **{f"{prefix}/{{model}}": {"get": _by_name(_get("the served model by its name; 404 for another")["get"])}
               for prefix in ("/v1/models", "/models")},
            "/api-doc/openapi.json": _get("this document, where TEI serves it"),
        },
    }

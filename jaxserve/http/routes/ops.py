"""Operations routes: /health (TEI's and Kubernetes' probe), /info (TEI's fields and ours), /metrics, /openapi.json."""

from __future__ import annotations

from aiohttp import web

from jaxserve.http.handling import json_response
from jaxserve.http.state import STATE
from jaxserve.runtime import compiles


async def health(request: web.Request) -> web.Response:
    """200 when serving; 503 while warming or draining, or when the device pipeline is broken (restart me)."""
    state = request.app[STATE]
    if state.service is not None and state.service.draining:
        return json_response({"status": "draining"}, status=503)
    if not state.ready:
        if state.failed:
            return json_response({"status": state.failed}, status=503)
        return json_response({"status": "warming", "doing": state.startup.doing,
                              "phases": state.startup.shown()}, status=503)
    if (why := state.service.healthy) is not None:
        return json_response({"status": "unhealthy", "reason": why}, status=503)
    return json_response({"status": "ok"})


def tei_model_type(enc) -> dict:
    """TEI's `model_type`: {"embedding": {"pooling"}}, or {"classifier" | "reranker": {"id2label", "label2id"}}."""
    if enc.head.kind == "embedding":
        return {"embedding": {"pooling": enc.embedding_config.pooling}}
    if enc.head.kind == "sparse":  # TEI names SPLADE as an embedding model's pooling
        return {"embedding": {"pooling": "splade"}}
    if enc.head.kind == "multivector":  # no TEI kind: an embedding model whose "pooling" keeps every token
        return {"embedding": {"pooling": "multivector"}}
    labels = enc.head.labels
    kind = "reranker" if len(labels) == 1 else "classifier"
    return {kind: {"id2label": {str(i): label for i, label in enumerate(labels)},
                   "label2id": {label: i for i, label in enumerate(labels)}}}


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    enc, cfg = state.encoder, state.config
    body = {
        # TEI's fields (router/src/lib.rs `Info`), which TEI clients read
        "model_id": state.model_name, "model_sha": None, "served_model_name": state.model_name,
        "max_concurrent_requests": state.server_config.max_concurrent, "max_client_batch_size": cfg.max_client_batch,
        "max_batch_requests": None, "auto_truncate": cfg.long == "truncate", "tokenization_workers": state.pool_threads[0],
        "version": _version(), "sha": None, "docker_label": None,
        # jaxserve's
        "ready": state.ready,
        "limits": {
            "max_client_batch_size": cfg.max_client_batch, "max_input_chars": cfg.max_input_chars,
            "max_body_bytes": cfg.max_body_bytes, "max_inflight_bytes": state.server_config.max_inflight_bytes,
            "max_queue_tokens": state.service.batcher.max_queued if state.service else cfg.max_queue_tokens,
            "max_wait_ms": cfg.max_wait_ms, "tokenizer_threads": state.pool_threads[0],
            "respond_threads": state.pool_threads[1],
            "default_long": cfg.long, "auth": bool(cfg.keys), "token_ids": cfg.token_ids,
        },
    }
    if enc is not None:
        c, e = enc.arch, enc.embedding_config
        body.update({
            "model_type": tei_model_type(enc), "model_dtype": enc.dtype, "max_input_length": e.max_seq_length,
            "architecture": c.model_type, "family": c.family, "dimensions": enc.dim,
            "pooling": e.pooling, "normalize": e.normalize,
            "dense_layers": [{"in": d.in_features, "out": d.out_features, "activation": d.activation} for d in e.dense],
            "prompts": dict(e.prompts), "default_prompt_name": cfg.default_prompt_name or e.default_prompt_name,
            "default_prompt": cfg.default_prompt,
            "kind": enc.head.kind, "labels": list(enc.head.labels),
        })
        if enc.splade is not None:  # dimensions: the vocabulary; cap: non-zeros shipped per input
            body.update(dimensions=c.vocab_size, pooling="splade",
                        sparse={"pooling_strategy": enc.splade.strategy, "activation_function": enc.splade.activation,
                                "cap": enc.splade.cap, "max_active_dims": enc.splade.max_active})
        if enc.colbert is not None:  # dimensions: of each token vector
            mv = enc.colbert
            body.update(dimensions=mv.dim, pooling="multivector", normalize=mv.normalize, multivector={
                "query_length": mv.lengths[0], "document_length": mv.lengths[1],
                "query_expansion": None if mv.expansion is None else {
                    "strategy": mv.expansion_strategy, "length": mv.expansion, "attend": mv.attend},
                "query_prefix": mv.prompts[0] or enc.tokenizer.tokenizer.id_to_token(mv.prefix_ids[0] or 0)
                if (mv.prompts[0] or mv.prefix_ids[0] is not None) else None,
                "document_prefix": mv.prompts[1] or enc.tokenizer.tokenizer.id_to_token(mv.prefix_ids[1] or 0)
                if (mv.prompts[1] or mv.prefix_ids[1] is not None) else None,
                "skiplist_ids": list(mv.skiplist), "similarity": mv.similarity,
                "routes": ["/v1/embeddings", "/rerank"]})
    if state.table is not None:
        body["max_batch_tokens"] = max(b.tokens for b in state.table.buckets)
        body["device"] = state.device
        body["buckets"] = state.table.to_json()  # each bucket's `attention` and `attention_fallback` among them
        if enc is not None:
            used = [b.attention for b in state.table.buckets]
            body["attention"] = {"choice": enc.attention, "implementations": {i: used.count(i) for i in sorted(set(used))},
                                 "fallbacks": sum(bool(b.attention_fallback) for b in state.table.buckets)}
        body["xla_compiles_total"] = (state.link.status.get("xla_compiles_total", 0) if state.link is not None
                                      else compiles.xla_compiles_total())
    if state.service is not None:  # the host time per dispatch that batch sizes are planned with (measured, or given)
        body["host_dispatch"] = state.service.host_dispatch
    body["processes"] = state.processes  # pids by role: one process, or a supervisor, an engine and front-ends
    if (simulated := state.simulated) is not None:
        body["SIMULATED_DEVICE"] = {
            "warning": "THIS SERVER RUNS NO MODEL. Its device is simulated (--simulate-device): every output is "
                       "zeros; use it to measure the host path (capacity planning), never for embeddings.",
            **simulated}
    body["startup"] = {"table": state.startup.source, "doing": state.startup.doing,
                       "phases": state.startup.shown()}
    return json_response(body)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.render(await state.engine_snapshot()), content_type="text/plain",
                        charset="utf-8")


async def openapi_json(request: web.Request) -> web.Response:
    from jaxserve.http.openapi import spec

    return json_response(spec(_version()))


def _version() -> str:
    from jaxserve import __version__

    return __version__


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/", health)  # TEI's (and some load balancers') probe
    app.router.add_get("/ping", health)  # SageMaker's
    app.router.add_get("/info", info)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/api-doc/openapi.json", openapi_json)  # where TEI serves it

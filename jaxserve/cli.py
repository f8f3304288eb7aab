"""The `jaxserve` command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys

DEMO_TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "Static shapes let XLA compile every bucket once.",
]


def cmd_demo(args) -> int:
    """Embed a few sentences and print their cosine similarities."""
    from jaxserve import Encoder

    enc = Encoder.from_pretrained(args.model, dtype=args.dtype, attention=args.attention, task=args.task)
    vecs = enc.embed(DEMO_TEXTS)
    print(f"model {enc.path} ({enc.model_config.model_type}, dim {enc.dim}, pooling {enc.embedding_config.pooling})")
    sims = vecs @ vecs.T
    for i, text in enumerate(DEMO_TEXTS):
        print(" ".join(f"{s:5.2f}" for s in sims[i]), " ", text)
    return 0


def table_for(enc, args):
    """What --buckets names: a table from its JSON file, or (`auto`) the options to derive one with."""
    from jaxserve.runtime.buckets import BucketTable

    if args.buckets and args.buckets != "auto":
        return BucketTable.load(args.buckets)
    return table_options(args)


@contextlib.contextmanager
def refused():
    """A config's ValueError (options that each parse but together, or against the config's rules, do not hold)
    as the command line's error: `jaxserve: ...` and status 2, as every other refusal, not a traceback."""
    from jaxserve.errors import JaxserveError

    try:
        yield
    except ValueError as err:
        raise JaxserveError(str(err)) from None


def table_options(args):
    """The table flags as the derivation's options."""
    from jaxserve.runtime.derivation import TableOptions

    with refused():
        return TableOptions(
            ladder=args.ladder, layout=args.layout, seqlens=args.seqlens,
            device_memory=args.device_memory, headroom=args.headroom, max_batch_tokens=args.max_batch_tokens,
            max_batch=args.max_batch, batch_multiple=args.batch_multiple, batch_ladder=args.batch_ladder == "on",
            knee=args.throughput_knee == "on",
        )


def cmd_buckets(args) -> int:
    """Derive a bucket table and print it with its memory math."""
    from jaxserve import Encoder
    from jaxserve.runtime.buckets import BucketTable, format_table

    enc = Encoder.from_pretrained(args.model, dtype=args.dtype, attention=args.attention, task=args.task)
    table = table_for(enc, args)
    if not isinstance(table, BucketTable):
        o = table
        table = enc.derive_table(o.ladder, o.layout, o.device_memory, o.headroom, o.max_batch_tokens, o.max_batch,
                                 o.seqlens, o.batch_multiple, o.batch_ladder)
    print(format_table(table))
    if args.write:
        table.save(args.write)
        print(f"wrote {args.write}")
    return 0


def cmd_warmup(args) -> int:
    """Compile and time the buckets and save the warm artifact (what `serve` then starts from in seconds)."""
    from jaxserve import Encoder
    from jaxserve.runtime import compiles, startup
    from jaxserve.runtime.buckets import format_table

    started = startup.Startup()
    started.add("import", startup.since_process_start())
    with started.phase("weights"):
        enc = Encoder.from_pretrained(args.model, dtype=args.dtype, attention=args.attention, task=args.task,
                                      devices=args.devices)
    cache = None if args.no_cache else startup.cache_root(args.cache_dir)
    table = startup.start(enc, table_for(enc, args), tokens=args.embed_all, cache=cache, startup=started,
                         progress=True, keep=args.keep_artifacts)
    print(format_table(table))
    source = started.source
    print(f"table: {source.get('source')}" + (f" ({source['artifact']}, made {source['created']})"
                                             if source.get("source") == "artifact" else "")
          + (f"; artifact skipped: {source['artifact_skipped']}" if "artifact_skipped" in source else "")
          + (f"; saved {source['artifact_saved']}" if "artifact_saved" in source else ""))
    print(f"start-up: {started.summary()}; "
          f"{compiles.xla_compiles_total()} executables built, {compiles.cache_hits_total()} from the persistent cache")
    if args.write:
        table.save(args.write)
        print(f"wrote {args.write}")
    return 0


def _seconds(text: str) -> float:
    """A time limit: a finite number of seconds above 0 (a NaN would never expire)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, not {text}")
    return value


def _route_priority(text: str) -> tuple[str, str]:
    from jaxserve.http.classes import parse_route

    try:
        return parse_route(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def cors_origins(given: list[str] | None) -> tuple[str, ...]:
    """--cors-allow-origin flags (each one origin or several, comma-separated) as origins; none given: any ("*"),
    as TEI; `none`: no CORS headers at all."""
    origins = tuple(o.strip() for flag in (given or ["*"]) for o in flag.split(",") if o.strip())
    return () if "none" in origins else origins


def api_keys(args) -> tuple[tuple[str, str | None], ...]:
    """--api-key flags, then the lines of --api-keys-file, each KEY or KEY=CLASS."""
    from jaxserve.errors import JaxserveError
    from jaxserve.http.classes import parse_key

    lines = list(args.api_key)
    if args.api_keys_file:
        try:
            with open(args.api_keys_file) as f:
                text = f.read()
        except OSError as err:
            raise JaxserveError(f"--api-keys-file {args.api_keys_file}: {err.strerror}") from None
        lines += [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return tuple(parse_key(line) for line in lines)


def sim_spec(args):
    """--simulate-device and its options as a SimSpec; None: the real device."""
    if args.simulate_device is None:
        return None
    from jaxserve.runtime.simulated import SimSpec

    overhead = {} if args.simulate_overhead_us is None else {"step_overhead_us": args.simulate_overhead_us}
    return SimSpec(args.simulate_device, sizes=tuple(args.simulate_size) if args.simulate_size else None, **overhead)


def serve_config(args):
    """`jaxserve serve`'s options as a ServerConfig."""
    from jaxserve.errors import JaxserveError
    from jaxserve.http.server import ServerConfig
    from jaxserve.runtime import host

    if args.simulate_device is None and (args.simulate_overhead_us is not None or args.simulate_size is not None):
        raise JaxserveError("--simulate-overhead-us and --simulate-size describe a simulated device: they need "
                            "--simulate-device")
    with refused():
        simulate = sim_spec(args)
        config = ServerConfig(
            model=args.model, model_name=args.served_model_name, dtype=args.dtype, attention=args.attention,
            task=args.task, buckets=args.buckets, ladder=args.ladder, layout=args.layout, max_wait_ms=args.max_wait_ms,
            max_queue_tokens=args.max_queue_tokens,
            max_client_batch=args.max_client_batch, max_input_chars=args.max_input_chars,
            max_body_bytes=args.max_body_bytes, long=args.long,
            api_key=os.environ.get("JAXSERVE_API_KEY") or None, api_keys=api_keys(args),
            route_priority=tuple(args.route_priority),
            cache_dir=args.cache_dir, use_cache=not args.no_cache, keep_artifacts=args.keep_artifacts,
            max_concurrent=args.max_concurrent_requests,
            request_timeout_s=args.request_timeout_s, devices=args.devices, max_inflight_bytes=args.max_inflight_bytes,
            default_prompt_name=args.default_prompt_name, default_prompt=args.default_prompt,
            token_ids=args.token_ids, embed_all=args.embed_all, table=table_options(args),
            default_priority=args.default_priority, interactive_max_sequences=args.interactive_max_sequences,
            interactive_max_tokens=args.interactive_max_tokens,
            bulk_dispatch_ms=args.bulk_dispatch_ms, host_dispatch_us=args.host_dispatch_us,
            tokenizer_threads=args.tokenizer_threads, respond_threads=args.respond_threads,
            workers=host.frontend_workers() if args.workers == "auto" else args.workers,
            engine_restarts=args.engine_restarts, simulate=simulate, access_log=args.access_log, malloc=args.malloc,
            cors_allow_origins=cors_origins(args.cors_allow_origin),
        )
    if simulate is not None:  # token outputs are not simulated: /embed_all is off
        config = dataclasses.replace(config, embed_all=False, use_cache=False)
    return config


def cmd_serve(args) -> int:
    """Serve the model over HTTP (OpenAI, TEI and Cohere routes)."""
    from jaxserve.http.server import serve

    config = serve_config(args)
    if config.workers > 1:
        from jaxserve.http.workers import serve_workers

        serve_workers(config, args.host, args.port)
    else:
        serve(config, args.host, args.port)
    return 0


def cmd_embed(args) -> int:
    """Stream a corpus through the buckets into .npy, .parquet or (SPLADE) .jsonl; resumable (jaxserve/offline/).

    Every input check (the corpus, the output, a partial or finished run's
    arguments) runs before warmup, so a bad input fails in seconds, not after
    compiling; a finished output with the same arguments is left as it is.
    """
    from tqdm import tqdm

    from jaxserve.errors import JaxserveError
    from jaxserve.offline.corpus import Corpus
    from jaxserve.offline.job import embed_corpus, encoder_embed, job_state
    from jaxserve.offline.sinks import SPARSE_SUFFIX, open_sink, sink_class

    corpus = Corpus(args.input, args.field, args.id_field)
    sink_class(args.output)
    files = corpus.files()
    if files != [args.input] and os.path.dirname(os.path.abspath(args.output)) in {  # a directory's or a glob's
            os.path.dirname(os.path.abspath(f)) for f in files}:
        raise JaxserveError(f"--output {args.output} is in a directory the input reads from: its files (the output, "
                            "its ids, progress and summary) would be read as input by a rerun; write it elsewhere")
    if args.ray_actors is not None and (not args.ray or args.ray_actors < 1):
        raise JaxserveError("--ray-actors needs --ray, and at least one actor")
    if args.ray and not args.output.endswith(".parquet"):
        raise JaxserveError("--ray writes .parquet: one part file per range, then the output in row order")
    if args.ray:
        try:
            import ray.data  # noqa: F401
        except ImportError:
            raise JaxserveError("--ray needs Ray Data: pip install 'jaxserve[ray,parquet]'") from None
    total = corpus.check()  # a streaming pass: nothing is held in memory
    from jaxserve import Encoder

    enc = Encoder.from_pretrained(args.model, dtype=args.dtype, attention=args.attention, task=args.task)  # loads weights; compiles nothing
    refuse_multivector(enc, "embed")
    sparse = enc.head.kind == "sparse"  # SPLADE: JSON Lines of {"index", "value"} lists
    if sparse != args.output.endswith(SPARSE_SUFFIX):
        raise JaxserveError(f"--output must end in {SPARSE_SUFFIX} for a sparse (SPLADE) model (per row its "
                            "[{index, value}] list), and in .npy or .parquet for a dense one")
    if sparse and args.long == "chunk":
        raise JaxserveError("a sparse model's weights are per sequence: --long chunk does not apply (truncate or error)")
    state = job_state(enc, corpus, total, args.long, args.prompt_name, args.prompt)
    sink = open_sink(args.output, state, ids=args.id_field is not None)
    if sink.check():
        print(f"{args.output} is already complete: {total} rows, written with these arguments "
              f"({sink.summary_path}); nothing to do")
        return 0
    if args.ray:
        return embed_on_ray(args, corpus, sink, table_for(enc, args), total)
    enc.start(table_for(enc, args), progress=True)  # as `serve` starts: from the warm artifact, else warm and save
    done = sink.resume()
    if done:
        print(f"resuming at row {done} of {total}", flush=True)
    with tqdm(total=total, initial=done, unit="doc", desc="embed") as bar:
        summary = embed_corpus(corpus.records(), encoder_embed(enc, args.long, state["prompt"]), sink, done,
                               args.chunk, bar.update)
    print(f"wrote {args.output}: {total} " + ("sparse rows" if sparse else f"x {enc.dim} float32"))
    print(f"{summary.line()}; summary in {sink.summary_path}")
    return 0


def embed_on_ray(args, corpus, sink, table, total: int) -> int:
    """`jaxserve embed --ray`: the checked job run by an actor pool on a Ray cluster
    (jaxserve/integrations/ray_data.py)."""
    from tqdm import tqdm

    from jaxserve.integrations import ray_data
    from jaxserve.runtime.startup import cache_root

    # Every actor loads the model as named here (a path the nodes share, or a hub id), at the dtype the driver
    # resolved and recorded (not each device's `auto`), and warm-starts from the artifact in this cache directory.
    local = args.model is not None and os.path.exists(args.model)  # a path, made absolute: workers have their own cwd
    model = {"model": os.path.abspath(args.model) if local else args.model, "table": table,
             "dtype": sink.state["dtype"], "attention": args.attention, "task": sink.state.get("task"),
             "long": args.long, "prompt": sink.state["prompt"], "cache_dir": os.path.abspath(cache_root(None))}
    with tqdm(total=total, unit="doc", desc="embed") as bar:
        def resumed(rows: int) -> None:
            if rows:
                print(f"resuming: {rows} of {total} rows already written", flush=True)
                bar.update(rows)

        run = ray_data.run_job(args.ray, sink, corpus, model, args.chunk, args.ray_actors, on_range=bar.update,
                               on_resume=resumed)
    print(f"wrote {args.output}: {total} x {sink.dim} float32; {run.ranges} ranges on {run.actors} actors")
    print(f"{run.summary.line()}; summary in {sink.summary_path}")
    return 0


def refuse_multivector(enc, command: str) -> None:
    """The offline commands run pooled outputs: a multi-vector model's are per token (`Encoder.embed_multivector`)."""
    from jaxserve.errors import JaxserveError

    if enc.head.kind == "multivector":
        raise JaxserveError(f"jaxserve {command} does not run multi-vector (ColBERT) models; use "
                            "Encoder.embed_multivector or POST /v1/embeddings with is_query (docs/models.md)")


def cmd_explain(args) -> int:
    """The batches of a file of documents and the latency math; with --run, also run it and measure."""
    import time

    from jaxserve import Encoder
    from jaxserve.offline.corpus import Corpus
    from jaxserve.scheduling.explain import LiveTimings, explain, format_report

    corpus = Corpus(args.file, args.field)
    corpus.check()  # before any compile
    docs = list(corpus.texts())
    enc = Encoder.from_pretrained(args.model, dtype=args.dtype, attention=args.attention, task=args.task)
    refuse_multivector(enc, "explain")
    prompt = enc.embedding_config.prompt(args.prompt_name, args.prompt)  # before any compile: an unknown name fails
    table = enc.warmup(table_for(enc, args), progress=True)
    pieces, rows = enc.prepare(docs, long=args.long, prompt=prompt)
    measured = None
    if args.run:
        enc.run(pieces, rows)  # once to settle caches; the second run is the measurement
        start = time.perf_counter()
        enc.run(pieces, rows)
        measured = {"run_s": time.perf_counter() - start}
    print(f"{len(docs)} documents from {args.file}; model {enc.path}; device {table.device}")
    print(format_report(explain(rows, table, LiveTimings(table), pieces.doc), measured))
    return 0


CORPUS_HELP = ("documents: one per line (UTF-8), JSONL (.jsonl, or lines starting with `{`) or Parquet (.parquet, "
               "read a row group at a time); a directory (its .parquet, .jsonl, .ndjson and .txt files) or a quoted "
               "glob: its files one after another, sorted by name; checked in full before any compile")
FIELD_HELP = "the text field of JSONL (default: `text`, else `input`) or the text column of Parquet (required there)"


def build_parser() -> argparse.ArgumentParser:
    from jaxserve.runtime.host import MALLOC_CHOICES

    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="embed a few sentences with a model and print their similarities")
    _model_args(demo)
    demo.set_defaults(func=cmd_demo)

    buckets = sub.add_parser("buckets", help="derive the bucket table for this device and print its memory math")
    _model_args(buckets)
    _table_args(buckets, timed=False)
    buckets.add_argument("--write", metavar="FILE", help="save the table as JSON")
    buckets.set_defaults(func=cmd_buckets)

    warmup = sub.add_parser("warmup", help="compile and time the buckets and save the warm artifact `serve` starts from")
    _model_args(warmup)
    _table_args(warmup)
    warmup.add_argument("--cache-dir", help="where the warm artifact goes (in warm/) "
                        "(default $JAXSERVE_CACHE_DIR or ~/.cache/jaxserve); `serve` with the same flags starts from it")
    warmup.add_argument("--no-cache", action="store_true", help="neither read nor write the warm artifact")
    _keep_artifacts_arg(warmup)
    _devices_arg(warmup)
    warmup.add_argument("--embed-all", default=True, action=argparse.BooleanOptionalAction,
                        help="also warm token outputs for TEI's /embed_all (as `serve` does by default)")
    warmup.add_argument("--write", metavar="FILE", help="save the table, with measured times, as JSON")
    warmup.set_defaults(func=cmd_warmup)

    explain = sub.add_parser("explain", help="the plan, padding, memory and predicted time for a file of documents")
    explain.add_argument("file", help=CORPUS_HELP)
    explain.add_argument("--field", default=None, help=FIELD_HELP)
    _model_args(explain)
    _table_args(explain)
    explain.add_argument("--long", default="truncate", choices=["truncate", "chunk", "error"])
    explain.add_argument("--run", action="store_true", help="also run the plan and print measured times")
    _prompt_args(explain)
    explain.set_defaults(func=cmd_explain)

    embed = sub.add_parser("embed", help="embed a corpus file into .npy, .parquet or (SPLADE) .jsonl, streaming "
                           "and resumable")
    embed.add_argument("--input", required=True, help=CORPUS_HELP)
    embed.add_argument("--field", default=None, help=FIELD_HELP)
    embed.add_argument("--id-field", default=None,
                       help="JSONL field or Parquet column carried into the output: an `id` column in .parquet, "
                            "FILE.ids.jsonl (one JSON value per row) beside .npy, {id, weights} lines in .jsonl")
    embed.add_argument("--output", required=True,
                       help=".npy ([rows, dim] float32) or .parquet (columns row, embedding[, id]), rows in input "
                            "order; a sparse (SPLADE) model: .jsonl, per row its [{index, value}] list; a summary "
                            "(documents, tokens, seconds, docs/s, tokens/s, padding, and the arguments a rerun must "
                            "match) lands in OUTPUT.summary.json")
    embed.add_argument("--chunk", type=_at_least_one, default=1024,
                       help="documents per step (and per progress checkpoint; with --ray, per range)")
    embed.add_argument("--long", default="truncate", choices=["truncate", "chunk", "error"])
    embed.add_argument("--ray", metavar="ADDRESS", help="run on a Ray cluster (ADDRESS as ray.init takes it, e.g. "
                       "auto or ray://head:10001; local: start one here): an actor pool, one per GPU, each range of "
                       "--chunk rows written once as a part file; .parquet output; input, model and cache directory "
                       "readable from every node")
    embed.add_argument("--ray-actors", type=int, metavar="N",
                       help="with --ray: actors in the pool (default: one per GPU of the cluster, else one per node)")
    _prompt_args(embed)
    _model_args(embed)
    _table_args(embed)
    embed.set_defaults(func=cmd_embed)

    from jaxserve.http import classes, server

    serve = sub.add_parser("serve", help="serve the model over HTTP (OpenAI /v1/embeddings, TEI /embed)")
    _model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8080, help="0: any free port")
    _table_args(serve)
    serve.add_argument("--max-wait-ms", type=float, default=server.MAX_WAIT_MS,
                       help="batch window: how long a partial batch waits while the device is busy")
    serve.add_argument("--max-queue-tokens", type=int, help="tokens waiting for the device before 429, each row "
                       "counted at its seqlen (default: 2 s of the device's measured best rate, 2**18..2**24)")
    serve.add_argument("--max-client-batch", type=int, default=server.MAX_CLIENT_BATCH, help="inputs per request")
    serve.add_argument("--max-input-chars", type=int, default=server.MAX_INPUT_CHARS, help="characters per input")
    serve.add_argument("--max-body-bytes", type=int, default=server.MAX_BODY_BYTES, help="request body size (413 past it)")
    serve.add_argument("--max-concurrent-requests", type=int, default=server.MAX_CONCURRENT_REQUESTS,
                       help="model requests handled at once (429 past it)")
    serve.add_argument("--max-inflight-bytes", type=int, default=server.MAX_INFLIGHT_BODY_BYTES,
                       help="bytes of request bodies handled at once (429 past it)")
    serve.add_argument("--request-timeout-s", type=_seconds, default=server.REQUEST_TIMEOUT_S,
                       help="per request; 503 past it, and its waiting rows are dropped")
    serve.add_argument("--long", default="truncate", choices=["truncate", "chunk", "error"],
                       help="default for inputs over the model's limit")
    prompts = serve.add_mutually_exclusive_group()
    prompts.add_argument("--default-prompt-name", help="prompt (of the model's config_sentence_transformers.json) "
                         "for requests that name none")
    prompts.add_argument("--default-prompt", help="prompt text for requests that name none")
    serve.add_argument("--token-ids", default="openai", choices=["openai", "model"],
                       help="token-id inputs on /v1/embeddings: OpenAI's tokenizer's ids (tiktoken, what OpenAI's and "
                            "LangChain's clients send), or this model's own sequences, run as given (vLLM's)")
    serve.add_argument("--embed-all", default=True, action=argparse.BooleanOptionalAction,
                       help="compile token outputs for TEI's /embed_all (one more shape per seqlen)")
    serve.add_argument("--default-priority", choices=("auto", "interactive", "bulk"), default="auto",
                       help="request class of requests that ask for none (body `priority` or X-Jaxserve-Priority) "
                            "and whose key and route give none: auto = interactive if within the interactive limits")
    serve.add_argument("--interactive-max-sequences", type=int, default=classes.INTERACTIVE_MAX_SEQUENCES,
                       help="interactive limit: a request of more sequences (after chunking) runs as bulk, whatever "
                            "it asks for")
    serve.add_argument("--interactive-max-tokens", type=int, default=classes.INTERACTIVE_MAX_TOKENS,
                       help="interactive limit: a request of more tokens runs as bulk, whatever it asks for")
    serve.add_argument("--bulk-dispatch-ms", type=float, default=server.BULK_DISPATCH_MS,
                       help="while interactive requests are likely, bulk batches are sized to run at most this long "
                            "(by the table's timings; never below 90%% of the seqlen's best throughput)")
    serve.add_argument("--host-dispatch-us", type=float, metavar="US",
                       help="the host's time per dispatch that batch sizes are planned with (default: measured as "
                            "batches run: the engine's CPU per batch, never below warm-up's figure)")
    serve.add_argument("--tokenizer-threads", type=int, help="threads decoding, tokenizing and packing requests "
                       "(default: half the usable cores, at least 2)")
    serve.add_argument("--respond-threads", type=int, help="threads combining and encoding responses "
                       "(default: a quarter of the usable cores, at least 2)")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY[=CLASS]",
                       help="require `Authorization: Bearer KEY` (or set JAXSERVE_API_KEY); repeat for more keys; "
                            "=interactive or =bulk: the most that key's requests may ask for (bulk: bulk only), and "
                            "their class when they ask for none")
    serve.add_argument("--api-keys-file", metavar="FILE", help="more keys, one KEY[=CLASS] per line (# comments)")
    serve.add_argument("--route-priority", action="append", default=[], type=_route_priority, metavar="ROUTE=CLASS",
                       help="the most a route's requests may ask for, and their class when they ask for none, e.g. "
                            "/embed=bulk; repeatable")
    _devices_arg(serve)
    serve.add_argument("--served-model-name", help="model name reported in responses")
    serve.add_argument("--cache-dir", help="where warm artifacts are (in warm/) "
                       "(default $JAXSERVE_CACHE_DIR or ~/.cache/jaxserve)")
    serve.add_argument("--no-cache", action="store_true", help="neither start from a warm artifact nor save one")
    _keep_artifacts_arg(serve)
    serve.add_argument("--workers", default="auto", type=_workers, metavar="N|auto",
                       help="front-end processes (HTTP, tokenizing, encoding) feeding one engine process that owns "
                            "the device; 1: one process does everything; auto: 1 below 4 usable cores, else all "
                            "cores but two (at most 32)")
    serve.add_argument("--malloc", default="auto", choices=MALLOC_CHOICES,
                       help="with several workers: the engine's and the front-ends' memory allocator (preloaded); "
                            "auto: mimalloc, else jemalloc, where installed (libmimalloc.so.2, libjemalloc.so.2), "
                            "else glibc's; glibc: none added. An allocator in your own LD_PRELOAD stands (ours goes "
                            "after it). With one worker, preload it yourself (docs/operations.md)")
    serve.add_argument("--cors-allow-origin", action="append", metavar="ORIGIN[,ORIGIN]|*|none",
                       help="origins whose browser pages may call the API (CORS: preflights answered without the API "
                            "key, Access-Control-Allow-Origin on responses); repeatable; default * (any, as TEI); "
                            "none: no CORS headers")
    serve.add_argument("--access-log", action="store_true",
                       help="log one line per request (off by default: at thousands of requests per second the "
                            "log line costs more CPU than a small request's own work)")
    serve.add_argument("--engine-restarts", type=int, default=3, metavar="N",
                       help="with several workers: how many times an engine process that died is restarted "
                            "(then /health stays 503)")
    sim = serve.add_argument_group("simulated device (capacity planning: NO MODEL RUNS, outputs are zeros)")
    sim.add_argument("--simulate-device", type=float, metavar="TFLOPS",
                     help="serve on a simulated device of this achieved rate: each dispatch costs overhead + "
                          "FLOPs / rate on one device clock; measures this host's request path without a GPU")
    sim.add_argument("--simulate-overhead-us", type=float, metavar="US",
                     help="the simulated device's launch and synchronisation time per dispatch (default 30)")
    sim.add_argument("--simulate-size", type=_sizes, metavar="H,I,L",
                     help="simulate a model of this hidden size, intermediate size and layer count (e.g. "
                          "768,3072,12 for bge-base) instead of the checkpoint's")
    serve.set_defaults(func=cmd_serve)
    return parser


def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be auto or a whole number of at least 1, not {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdecimal() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, 0 to 65535, not {text!r}")
    return int(text)


def _positive_ints(text: str) -> list[int] | None:
    """Comma-separated positive whole numbers; None if `text` is not that."""
    parts = [p.strip() for p in text.split(",")]
    return [int(p) for p in parts] if all(p.isdecimal() and int(p) > 0 for p in parts) else None


def _seqlens(text: str) -> tuple[int, ...]:
    if (seqlens := _positive_ints(text)) is None:
        raise argparse.ArgumentTypeError(f"must be positive whole numbers, comma-separated, not {text!r}")
    return tuple(seqlens)


def _sizes(text: str) -> list[int]:
    if (sizes := _positive_ints(text)) is None or len(sizes) != 3:
        raise argparse.ArgumentTypeError(f"must be three positive whole numbers H,I,L, not {text!r}")
    return sizes


def _devices_arg(p: argparse.ArgumentParser) -> None:
    """`serve`'s and `warmup`'s: the device count is part of the warm artifact's key."""
    p.add_argument("--devices", default="1", type=lambda v: v if v == "all" else int(v),
                   help="local devices sharing each batch (data parallel): a number, or all")


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return int(text)


def _keep_artifacts_arg(p: argparse.ArgumentParser) -> None:
    from jaxserve.runtime.artifact import KEEP

    p.add_argument("--keep-artifacts", type=_at_least_one, default=KEEP, metavar="N",
                   help="after saving a warm artifact, keep this model's newest N in the cache and delete the "
                        f"older ones (stale after an upgrade or a flag change; default {KEEP})")


def _table_args(p: argparse.ArgumentParser, timed: bool = True) -> None:
    """The table flags; `timed=False` (`jaxserve buckets`: an untimed table) leaves out the knee: it needs times."""
    from jaxserve.runtime.buckets import LADDERS, LAYOUTS
    from jaxserve.runtime.device import DEFAULT_HEADROOM

    p.add_argument("--buckets", default="auto", metavar="FILE|auto", help="a bucket table JSON file, or auto (derive)")
    p.add_argument("--ladder", default="default", choices=LADDERS, help="seqlen ladder to derive")
    p.add_argument("--layout", default="packed", choices=LAYOUTS, help="one document per row, or several packed")
    p.add_argument("--seqlens", type=_seqlens, help="explicit seqlen ladder, comma-separated (overrides --ladder's)")
    p.add_argument("--device-memory", type=int, metavar="BYTES", help="derive for a device of this memory (default: this device's)")
    p.add_argument("--headroom", type=float, help=f"fraction of device memory the buckets may use (default {DEFAULT_HEADROOM})")
    p.add_argument("--max-batch-tokens", type=int, help="cap on batch*seqlen per dispatch (default: the device's)")
    p.add_argument("--max-batch", type=int, help="cap on rows per dispatch (default: 256 on CPU, none on GPU)")
    p.add_argument("--batch-ladder", default="on", choices=["on", "off"],
                   help="also compile batches 1, 4, 16, ... below each seqlen's largest")
    if timed:
        p.add_argument("--throughput-knee", default="on", choices=["on", "off"],
                       help="derived tables, once timed: keep each seqlen's batches up to where a 4x larger batch "
                            "is no longer 5%% faster per token")
    else:
        p.set_defaults(throughput_knee="on")
    p.add_argument("--batch-multiple", type=int, help="round batches down to a multiple of this (default: 8 on GPU, 1 on CPU)")


def _prompt_args(parser) -> None:
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt-name", help="one of the checkpoint's prompts, in front of every document "
                         "(default: the checkpoint's default_prompt_name, if any)")
    prompts.add_argument("--prompt", help="a prompt text in front of every document")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or hub id (default: $JAXSERVE_MODEL, else the bundled all-MiniLM-L6-v2)")
    p.add_argument("--task", default=None,
                   help="the task adapter of a checkpoint that has them (Jina-embeddings-v3's LoRA: retrieval.query, "
                        "retrieval.passage, separation, classification, text-matching), merged at load; default "
                        "$JAXSERVE_TASK, else none")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights and activations (auto: float32 on CPU, bfloat16 on GPU/TPU)")
    p.add_argument("--attention", default="auto", choices=["auto", "pallas", "cudnn", "xla", "blockwise"],
                   help="attention kernel per bucket: auto (GPU: cuDNN, then Pallas, then XLA; CPU: XLA), or the one "
                        "named; where it cannot take a bucket or fails to compile, the next one does (logged, and "
                        "shown per bucket in /info)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxserve.errors import JaxserveError

    try:
        return args.func(args)
    except JaxserveError as exc:
        print(f"jaxserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

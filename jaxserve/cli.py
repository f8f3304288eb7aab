"""The `jaxserve` command line."""

from __future__ import annotations

import argparse
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

    enc = Encoder.from_pretrained(args.model, dtype=args.dtype)
    vecs = enc.embed(DEMO_TEXTS)
    print(f"model {enc.path} ({enc.model_config.model_type}, dim {enc.dim}, pooling {enc.embedding_config.pooling})")
    sims = vecs @ vecs.T
    for i, text in enumerate(DEMO_TEXTS):
        print(" ".join(f"{s:5.2f}" for s in sims[i]), " ", text)
    return 0


def table_for(enc, args):
    """The bucket table named by --buckets: a JSON file, or `auto` (derived with the ladder and layout flags)."""
    from jaxserve.buckets import BucketTable

    if args.buckets and args.buckets != "auto":
        return BucketTable.load(args.buckets)
    seqlens = [int(x) for x in args.seqlens.split(",")] if args.seqlens else None
    return enc.derive_table(
        ladder=args.ladder, layout=args.layout, device_memory=args.device_memory, headroom=args.headroom,
        max_batch_tokens=args.max_batch_tokens, max_batch=args.max_batch, seqlens=seqlens,
        batch_multiple=args.batch_multiple, batch_ladder=args.batch_ladder == "on",
    )


def derived_knee(args) -> bool:
    """Whether to cut a derived table at each seqlen's throughput knee once timed (never a table from a file)."""
    return (not args.buckets or args.buckets == "auto") and args.throughput_knee == "on"


def cmd_buckets(args) -> int:
    """Derive a bucket table and print it with its memory math."""
    from jaxserve import Encoder
    from jaxserve.buckets import format_table

    enc = Encoder.from_pretrained(args.model, dtype=args.dtype)
    table = table_for(enc, args)
    print(format_table(table))
    if args.write:
        table.save(args.write)
        print(f"wrote {args.write}")
    return 0


def cmd_warmup(args) -> int:
    """Compile and run every bucket, fill the persistent cache, record the timings."""
    import time

    from jaxserve import Encoder, compiles
    from jaxserve.buckets import format_table

    start = time.perf_counter()
    if not args.no_cache:
        cache = compiles.enable_persistent_cache(args.cache_dir)
        print(f"persistent compilation cache: {cache}")
    enc = Encoder.from_pretrained(args.model, dtype=args.dtype)
    loaded = time.perf_counter()
    table = enc.warmup(table_for(enc, args), progress=True, knee=derived_knee(args))
    done = time.perf_counter()
    print(format_table(table))
    print(
        f"load {loaded - start:.1f} s, buckets {done - loaded:.1f} s, total {done - start:.1f} s; "
        f"{compiles.xla_compiles_total()} executables built, {compiles.cache_hits_total()} from the persistent cache"
    )
    if args.write:
        table.save(args.write)
        print(f"wrote {args.write}")
    return 0


def cmd_serve(args) -> int:
    """Serve the model over HTTP (OpenAI and TEI routes)."""
    from jaxserve.server import ServerConfig, serve

    config = ServerConfig(
        model=args.model, model_name=args.served_model_name, dtype=args.dtype, buckets=args.buckets,
        ladder=args.ladder, layout=args.layout, max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
        max_client_batch=args.max_client_batch, max_input_chars=args.max_input_chars,
        max_body_bytes=args.max_body_bytes, long=args.long, api_key=args.api_key or os.environ.get("JAXSERVE_API_KEY"),
        cache_dir=args.cache_dir, use_cache=not args.no_cache, max_concurrent=args.max_concurrent_requests,
        request_timeout_s=args.request_timeout_s, devices=args.devices, max_inflight_bytes=args.max_inflight_bytes,
        default_prompt_name=args.default_prompt_name, default_prompt=args.default_prompt,
        token_ids=args.token_ids, embed_all=args.embed_all,
        default_priority=args.default_priority, interactive_max_sequences=args.interactive_max_sequences,
    )
    serve(config, args.host, args.port)
    return 0


def iter_documents(path: str):
    """One document per line, or JSONL with a `text` (or `input`) field per line; blank lines skipped."""
    import json

    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                obj = json.loads(line)
                yield obj.get("text", obj.get("input"))
            else:
                yield line


def read_documents(path: str) -> list[str]:
    return list(iter_documents(path))


def cmd_embed(args) -> int:
    """Stream a corpus through the buckets into .npy or .parquet; resumable (see jaxserve/offline.py)."""
    from tqdm import tqdm

    from jaxserve import Encoder
    from jaxserve.offline import embed_corpus, open_sink

    enc = Encoder.from_pretrained(args.model, dtype=args.dtype)
    enc.warmup(table_for(enc, args), progress=True, knee=derived_knee(args))
    total = sum(1 for _ in iter_documents(args.input))  # a counting pass: nothing is held in memory
    sink = open_sink(args.output, total, enc.dim, os.path.abspath(args.input))
    done = sink.resume()
    if done:
        print(f"resuming at row {done} of {total}", flush=True)
    with tqdm(total=total, initial=done, unit="doc", desc="embed") as bar:
        embed_corpus(iter_documents(args.input), lambda docs: enc.embed(docs, long=args.long), sink, done,
                     args.chunk, bar.update)
    print(f"wrote {args.output}: {total} x {enc.dim} float32")
    return 0


def cmd_explain(args) -> int:
    """The batches of a file of documents and the latency math; with --run, also run it and measure."""
    import time

    from jaxserve import Encoder
    from jaxserve.explain import LiveTimings, explain, format_report

    enc = Encoder.from_pretrained(args.model, dtype=args.dtype)
    table = enc.warmup(table_for(enc, args), progress=True, knee=derived_knee(args))
    docs = read_documents(args.file)
    pieces, rows = enc.prepare(docs, long=args.long)
    measured = None
    if args.run:
        enc.run(pieces, rows)  # once to settle caches; the second run is the measurement
        start = time.perf_counter()
        enc.run(pieces, rows)
        measured = {"run_s": time.perf_counter() - start}
    print(f"{len(docs)} documents from {args.file}; model {enc.path}; device {table.device}")
    print(format_report(explain(rows, table, LiveTimings(table), pieces.doc), measured))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="embed a few sentences with a model and print their similarities")
    _model_args(demo)
    demo.set_defaults(func=cmd_demo)

    buckets = sub.add_parser("buckets", help="derive the bucket table for this device and print its memory math")
    _model_args(buckets)
    _table_args(buckets)
    buckets.add_argument("--write", metavar="FILE", help="save the table as JSON")
    buckets.set_defaults(func=cmd_buckets)

    warmup = sub.add_parser("warmup", help="compile and time every bucket; fill the persistent compilation cache")
    _model_args(warmup)
    _table_args(warmup)
    warmup.add_argument("--cache-dir", help="persistent compilation cache (default $JAXSERVE_CACHE_DIR or ~/.cache/jaxserve/xla)")
    warmup.add_argument("--no-cache", action="store_true", help="do not use the persistent compilation cache")
    warmup.add_argument("--write", metavar="FILE", help="save the table, with measured times, as JSON")
    warmup.set_defaults(func=cmd_warmup)

    explain = sub.add_parser("explain", help="the plan, padding, memory and predicted time for a file of documents")
    explain.add_argument("file", help="documents: one per line, or JSONL with a `text` field")
    _model_args(explain)
    _table_args(explain)
    explain.add_argument("--long", default="truncate", choices=["truncate", "chunk", "error"])
    explain.add_argument("--run", action="store_true", help="also run the plan and print measured times")
    explain.set_defaults(func=cmd_explain)

    embed = sub.add_parser("embed", help="embed a corpus file into .npy or .parquet, streaming and resumable")
    embed.add_argument("--input", required=True, help="documents: one per line, or JSONL with a `text` field")
    embed.add_argument("--output", required=True, help=".npy ([rows, dim] float32) or .parquet (columns row, embedding), rows in input order")
    embed.add_argument("--chunk", type=int, default=1024, help="documents per step (and per progress checkpoint)")
    embed.add_argument("--long", default="truncate", choices=["truncate", "chunk", "error"])
    _model_args(embed)
    _table_args(embed)
    embed.set_defaults(func=cmd_embed)

    from jaxserve import server

    serve = sub.add_parser("serve", help="serve the model over HTTP (OpenAI /v1/embeddings, TEI /embed)")
    _model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--buckets", default="auto", metavar="FILE|auto", help="a bucket table JSON file, or auto")
    serve.add_argument("--ladder", default="default", choices=["default", "max", "pow2", "fine"])
    serve.add_argument("--layout", default="packed", choices=["padded", "packed"])
    serve.add_argument("--max-wait-ms", type=float, default=server.MAX_WAIT_MS,
                       help="batch window: how long a partial batch waits while the device is busy")
    serve.add_argument("--max-queue", type=int, default=server.MAX_QUEUE, help="sequences waiting before 429")
    serve.add_argument("--max-client-batch", type=int, default=server.MAX_CLIENT_BATCH, help="inputs per request")
    serve.add_argument("--max-input-chars", type=int, default=server.MAX_INPUT_CHARS, help="characters per input")
    serve.add_argument("--max-body-bytes", type=int, default=server.MAX_BODY_BYTES, help="request body size (413 past it)")
    serve.add_argument("--max-concurrent-requests", type=int, default=server.MAX_CONCURRENT_REQUESTS,
                       help="model requests handled at once (429 past it)")
    serve.add_argument("--max-inflight-bytes", type=int, default=server.MAX_INFLIGHT_BODY_BYTES,
                       help="bytes of request bodies handled at once (429 past it)")
    serve.add_argument("--request-timeout-s", type=float, default=server.REQUEST_TIMEOUT_S,
                       help="per request; 503 past it, and its waiting rows are dropped")
    serve.add_argument("--long", default="truncate", choices=["truncate", "chunk", "error"],
                       help="default for inputs over the model's limit")
    prompts = serve.add_mutually_exclusive_group()
    prompts.add_argument("--default-prompt-name", help="prompt (of the model's config_sentence_transformers.json) "
                         "for requests that name none")
    prompts.add_argument("--default-prompt", help="prompt text for requests that name none")
    serve.add_argument("--token-ids", default="openai", choices=["openai", "model"],
                       help="token-id inputs on /v1/embeddings: OpenAI's tokenizer's ids (tiktoken, what OpenAI's and "
                            "LangChain's clients send), or this model's own vocabulary")
    serve.add_argument("--embed-all", default=True, action=argparse.BooleanOptionalAction,
                       help="compile token outputs for TEI's /embed_all (one more shape per seqlen)")
    serve.add_argument("--default-priority", choices=("auto", "interactive", "bulk"), default="auto",
                       help="request class of requests that ask for none (body `priority` or X-Jaxserve-Priority): "
                            "auto = interactive up to --interactive-max-sequences sequences, else bulk")
    serve.add_argument("--interactive-max-sequences", type=int, default=8,
                       help="auto class threshold: requests of at most this many sequences are interactive")
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` (or set JAXSERVE_API_KEY)")
    serve.add_argument("--devices", default="1", type=lambda v: v if v == "all" else int(v),
                       help="local devices sharing each batch (data parallel): a number, or all")
    serve.add_argument("--served-model-name", help="model name reported in responses")
    serve.add_argument("--cache-dir", help="persistent compilation cache directory")
    serve.add_argument("--no-cache", action="store_true", help="do not use the persistent compilation cache")
    serve.set_defaults(func=cmd_serve)
    return parser


def _table_args(p: argparse.ArgumentParser) -> None:
    from jaxserve.buckets import LADDERS, LAYOUTS
    from jaxserve.device import DEFAULT_HEADROOM

    p.add_argument("--buckets", default="auto", metavar="FILE|auto", help="a bucket table JSON file, or auto (derive)")
    p.add_argument("--ladder", default="default", choices=LADDERS, help="seqlen ladder to derive")
    p.add_argument("--layout", default="packed", choices=LAYOUTS, help="one document per row, or several packed")
    p.add_argument("--seqlens", help="explicit seqlen ladder, comma-separated (overrides --ladder's)")
    p.add_argument("--device-memory", type=int, metavar="BYTES", help="derive for a device of this memory (default: this device's)")
    p.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, help="fraction of device memory the buckets may use")
    p.add_argument("--max-batch-tokens", type=int, help="cap on batch*seqlen per dispatch (default: the device's)")
    p.add_argument("--max-batch", type=int, help="cap on rows per dispatch (default: 256 on CPU, none on GPU)")
    p.add_argument("--batch-ladder", default="on", choices=["on", "off"],
                   help="also compile batches 1, 4, 16, ... below each seqlen's largest")
    p.add_argument("--throughput-knee", default="on", choices=["on", "off"],
                   help="derived tables, once timed: keep each seqlen's batches up to where a 4x larger batch "
                        "is no longer 5%% faster per token")
    p.add_argument("--batch-multiple", type=int, help="round batches down to a multiple of this (default: 8 on GPU, 1 on CPU)")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or hub id (default: $JAXSERVE_MODEL, else the bundled all-MiniLM-L6-v2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights and activations (auto: float32 on CPU, bfloat16 on GPU/TPU)")


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

"""`jaxserve embed`'s run: a corpus streamed through the buckets into a sink (`sinks.py`), chunk by chunk.

Chunks run as a two-stage pipeline: a thread reads and tokenizes chunk i+1
while chunk i runs on the device and is written, so the device does not wait
for the tokenizer; chunks are written in input order, one at a time.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import itertools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from jaxserve.errors import InputError
from jaxserve.offline.corpus import Corpus
from jaxserve.offline.sinks import Sink


@dataclass
class Summary:
    """What a run did: printed at the end and written beside the output as OUTPUT.summary.json (by `Sink.finish`,
    with the run's state)."""

    documents: int = 0
    tokens: int = 0  # real tokens, special tokens included
    compiled_tokens: int = 0  # batch x seqlen of every dispatch: what the device computed
    seconds: float = 0.0

    def as_dict(self) -> dict:
        s = max(self.seconds, 1e-9)
        padding = 1 - self.tokens / self.compiled_tokens if self.compiled_tokens else 0.0
        return {"documents": self.documents, "tokens": self.tokens, "seconds": round(self.seconds, 3),
                "docs_per_s": round(self.documents / s, 1), "tokens_per_s": round(self.tokens / s, 1),
                "padding": round(padding, 4)}

    def line(self) -> str:
        d = self.as_dict()
        return (f"{d['documents']} documents, {d['tokens']} tokens in {d['seconds']} s: {d['docs_per_s']} docs/s, "
                f"{d['tokens_per_s']} tokens/s, padding {d['padding']:.1%}")


@dataclass(frozen=True)
class Stages:
    """A chunk's two stages: `prepare(texts)` on the host (tokenize, pack; runs on a thread, one chunk ahead) and
    `run(prepared)` -> (the chunk's rows for the sink, real tokens, compiled tokens) on the device. `longs`: the
    `--long` modes that embed a document over the model's limit, what a `--long error` stop suggests."""

    prepare: Callable[[list[str]], object]
    run: Callable[[object], tuple[object, int, int]]
    longs: tuple[str, ...] = ("truncate", "chunk")


def embed_corpus(records: Iterable[tuple[object, str]],
                 embed: Stages | Callable[[list[str]], tuple[object, int, int]],
                 sink: Sink, start: int, chunk: int, on_chunk: Callable[[int], None] = lambda n: None) -> Summary:
    """Embed (id, text) `records` from row `start` (what `sink.resume()` said) chunk by chunk into `sink`.

    `embed`: the `Stages`, or one function texts -> (rows, real tokens,
    compiled tokens) (then only reading runs ahead). The next chunk is read
    and prepared on a thread while this one runs and is written. Returns the
    summary of the rows this run embedded (also what `sink.finish` records).
    """
    stages = embed if isinstance(embed, Stages) else Stages(lambda texts: texts, embed)
    summary, began = Summary(), time.perf_counter()
    done = start
    rest = itertools.islice(records, start, None)

    def read_and_prepare():
        batch = list(itertools.islice(rest, chunk))
        return batch, (stages.prepare([text for _, text in batch]) if batch else None)

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-embed-prepare") as ahead:
        upcoming = ahead.submit(read_and_prepare)
        while True:
            try:
                batch, prepared = upcoming.result()
                if not batch:
                    break
                upcoming = ahead.submit(read_and_prepare)  # chunk i+1 tokenizes while chunk i runs and is written
                rows, tokens, compiled = stages.run(prepared)
            except InputError as exc:  # its "input N" counts from the chunk's first row
                raise InputError(f"in the chunk from row {done}: {exc}; the rows before it are written, but a rerun "
                                 "with these arguments stops here again and one with others is refused: delete "
                                 f"{sink.leftovers()} and start over with --long {' or '.join(stages.longs)} (a "
                                 "document over the model's limit) or without that document") from None
            if done + len(batch) > sink.rows:
                raise InputError(f"the input has more than the {sink.rows} documents it had when the run began: it "
                                 "changed during the run; rerun it whole")
            sink.write(done, rows, [i for i, _ in batch])
            done += len(batch)
            summary.documents += len(batch)
            summary.tokens += tokens
            summary.compiled_tokens += compiled
            on_chunk(len(batch))
    if done != sink.rows:  # never recorded as finished with rows missing
        raise InputError(f"the input has {done} documents, {sink.rows} when the run began: it changed during the "
                         "run; rerun it whole")
    summary.seconds = time.perf_counter() - began
    sink.finish(summary.as_dict())
    return summary


def plan_ranges(rows: int, block: int, finished: list[tuple[int, int]],
                cuts: Iterable[int] = ()) -> list[tuple[int, int]]:
    """The (start, count) ranges left to embed, in row order: the rows no `finished` range holds, cut into ranges
    of at most `block` rows that never cross a finished one (a range is written whole under its own name, so two
    ranges that overlapped would write a row twice), nor a row in `cuts` (where an input file starts)."""
    todo, at, cuts = [], 0, sorted(set(cuts))
    for start, count in sorted(finished) + [(rows, 0)]:
        edges = [at, *(c for c in cuts if at < c < start), start]
        for lo, hi in itertools.pairwise(edges):
            todo += [(s, min(block, hi - s)) for s in range(lo, hi, block)]
        at = max(at, start + count)
    return todo


def encoder_embed(enc, long: str, prompt: str | None) -> Stages:
    """The `Stages` of `embed_corpus` for an encoder: `Encoder.embed` (checkpoint's normalisation), or a SPLADE
    model's `embed_sparse`, cut in two, counting tokens. Tokenizing (with `prompt`) and packing are the prepare
    stage. A SPLADE model's weights are per sequence: `--long chunk` does not apply to it."""
    from jaxserve.heads import sparse

    def prepare(texts: list[str]):
        pieces, rows = enc.prepare(texts, long, prompt)
        return pieces, rows, len(texts)

    def run(prepared) -> tuple[object, int, int]:
        pieces, rows, n = prepared
        if enc.splade is not None:
            out = sparse.decode(enc.run(pieces, rows), enc.splade)
        else:
            out = enc.embed_prepared(pieces, rows, n)
        compiled = sum(d.bucket.batch * d.bucket.seqlen for d in enc.last_dispatches)
        return out, pieces.tokens, compiled

    return Stages(prepare, run, ("truncate",) if enc.splade is not None else Stages.longs)


def model_id(path: Path) -> str:
    """What identifies a checkpoint's outputs: `model_digest` (configs, tokenizer, weight shapes: what the warm
    artifact's executables depend on) and the weights' values, which it leaves out and every vector depends on
    (read whole: an offline job reads them anyway). Shortened: it names a model in a message."""
    from jaxserve.runtime.artifact import model_digest

    h = hashlib.sha256(model_digest(path).encode())
    for f in sorted(Path(path).rglob("*.safetensors")):
        if not any(part.startswith(".") for part in f.relative_to(path).parts):
            h.update(f.relative_to(path).as_posix().encode() + b"\0")
            with open(f, "rb") as weights:
                h.update(hashlib.file_digest(weights, "sha256").digest())
    return h.hexdigest()[:16]


def input_files(corpus: Corpus) -> str:
    """What identifies the input's contents without reading them: a file's size and modification time (a corpus
    rewritten in place is another input); for a directory or glob, its files' names, sizes and times, digested."""
    files = corpus.files()
    stats = [os.stat(f) for f in files]
    if files == [corpus.path]:
        modified = datetime.datetime.fromtimestamp(stats[0].st_mtime_ns / 1e9, datetime.UTC).isoformat()
        return f"{stats[0].st_size} bytes, modified {modified}"
    listing = hashlib.sha256("".join(f"{os.path.basename(f)}\0{st.st_size}\0{st.st_mtime_ns}\n"
                                     for f, st in zip(files, stats, strict=True)).encode()).hexdigest()[:16]
    return f"{len(files)} files, {sum(st.st_size for st in stats)} bytes, listing {listing}"


def job_state(enc, corpus: Corpus, rows: int, long: str, prompt_name: str | None, prompt: str | None) -> dict:
    """Everything that decides an output's rows, recorded with it: a resume (or a rerun of a finished job) must
    match it, or the file would mix two runs' rows (or keep a stale one's). `prompt_name` and `prompt` as given (neither: the
    checkpoint's default); the prompt's text as resolved."""
    emb = enc.embedding_config
    return {"input": os.path.abspath(corpus.path), "input_file": input_files(corpus),
            "rows": rows,
            "dim": enc.splade.vocab_size if enc.splade is not None else enc.dim,
            "field": corpus.field, "id_field": corpus.id_field, "model": model_id(enc.path), "dtype": enc.dtype,
            "long": long, "prompt_name": None if prompt is not None else (prompt_name or emb.default_prompt_name),
            "prompt": emb.prompt(prompt_name, prompt),
            **({"task": emb.task} if emb.task else {})}  # a task adapter's weights differ: recorded where there is one

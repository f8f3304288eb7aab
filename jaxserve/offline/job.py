"""`jaxserve embed`'s run: a corpus streamed through the buckets into a sink (`sinks.py`), chunk by chunk.

Chunks run as a two-stage pipeline: a thread reads and tokenizes chunk i+1
while chunk i runs on the device and is written, so the device does not wait
for the tokenizer; chunks are written in input order, one at a time.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from jaxserve.offline.sinks import Sink, write_json_atomic


@dataclass
class Summary:
    """What a run did: printed at the end and written beside the output as FILE.summary.json."""

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
    `run(prepared)` -> (vectors, real tokens, compiled tokens) on the device."""

    prepare: Callable[[list[str]], object]
    run: Callable[[object], tuple[np.ndarray, int, int]]


def embed_corpus(records: Iterable[tuple[object, str]],
                 embed: Stages | Callable[[list[str]], tuple[np.ndarray, int, int]],
                 sink: Sink, start: int, chunk: int, on_chunk: Callable[[int], None] = lambda n: None) -> Summary:
    """Embed (id, text) `records` from row `start` (what `sink.resume()` said) chunk by chunk into `sink`.

    `embed`: the `Stages`, or one function texts -> (vectors, real tokens,
    compiled tokens) (then only reading runs ahead). The next chunk is read
    and prepared on a thread while this one runs and is written. Returns the
    summary of the rows this run embedded.
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
            batch, prepared = upcoming.result()
            if not batch:
                break
            upcoming = ahead.submit(read_and_prepare)  # chunk i+1 tokenizes while chunk i runs and is written
            vectors, tokens, compiled = stages.run(prepared)
            sink.write(done, vectors, [i for i, _ in batch])
            done += len(batch)
            summary.documents += len(batch)
            summary.tokens += tokens
            summary.compiled_tokens += compiled
            on_chunk(len(batch))
    sink.finish()
    summary.seconds = time.perf_counter() - began
    return summary


def encoder_embed(enc, long: str) -> Stages:
    """The `Stages` of `embed_corpus` for an encoder: `Encoder.embed` cut in two (default prompt, checkpoint's
    normalisation), counting tokens. Tokenizing and packing are the prepare stage."""
    prompt = enc.embedding_config.prompt(None, None)

    def prepare(texts: list[str]):
        pieces, rows = enc.prepare(texts, long, prompt)
        return pieces, rows, len(texts)

    def run(prepared) -> tuple[np.ndarray, int, int]:
        pieces, rows, n = prepared
        vectors = enc.embed_prepared(pieces, rows, n)
        compiled = sum(d.bucket.batch * d.bucket.seqlen for d in enc.last_dispatches)
        return vectors, int(pieces.lengths.sum()), compiled

    return Stages(prepare, run)


def write_summary(output: str, summary: Summary) -> str:
    path = os.path.splitext(output)[0] + ".summary.json"
    write_json_atomic(path, summary.as_dict())
    return path

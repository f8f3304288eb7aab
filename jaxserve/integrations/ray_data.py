"""Corpora larger than one machine: `jaxserve embed --ray`, and `Embedder` for a Ray Data pipeline of one's own.

`jaxserve embed --ray ADDRESS` runs the single-process job's checks on the
driver (the corpus, the output, a partial or finished run's arguments), then
cuts the rows left to do into ranges of `--chunk` rows (`plan_ranges`). Each
range is one row of a Ray Data dataset; an actor pool of `Encoder`s, one per
device, maps it (`RangeEmbedder`): reads its rows from the corpus (which every
node must be able to read), embeds them and writes them as the output's part
file part-START-COUNT.parquet (`ParquetSink.write`). The driver only counts
what comes back; at the end `ParquetSink.finish` streams the parts, in row
order, into the output file.

Exactly once. Ray Data gives at least once: a dead actor is restarted and its
range retried (an actor pool's default `max_restarts` and `max_task_retries`
are -1), while an exception raised in the stage fails the job. jaxserve makes
it exactly once: a range's part has one name whichever attempt writes it and
appears only whole (renamed into place); a rerun lists the parts, re-checks
the arguments and plans only the rows no part holds, in ranges that never
cross one; and `finish` refuses parts that do not tile the rows. A killed
driver's rerun redoes at most the ranges that were in flight.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import ray
import ray.data

from jaxserve.errors import JaxserveError
from jaxserve.offline.corpus import Corpus, CorpusError
from jaxserve.offline.job import Summary, encoder_embed, plan_ranges
from jaxserve.offline.sinks import ParquetSink


def started_encoder(model: str | None, dtype: str, attention: str, table, cache_dir: str | None,
                    task: str | None = None):
    """An embedding model's `Encoder` (with its task adapter `task`, where it has them), started from the warm
    artifact in `cache_dir` (built and saved there when there is none)."""
    from jaxserve import Encoder

    enc = Encoder.from_pretrained(model, dtype=dtype, attention=attention, task=task)
    if enc.head.kind != "embedding":
        raise JaxserveError(f"the Ray job writes dense embeddings; {enc.path} is a {enc.head.kind} model")
    enc.start(table, cache=cache_dir)
    return enc


class Embedder:
    """A callable class for `Dataset.map_batches`: each batch's `column` of texts gets an `embedding` column
    (float32 [rows, dim], the checkpoint's normalisation); the other columns pass through. Batches of numpy arrays
    (Ray Data's default) or pandas DataFrames (`batch_format="pandas"`). A text that is not a string (a null) fails
    the batch, naming its row.

        ds = ray.data.read_parquet("/data/corpus/").map_batches(
            Embedder, fn_constructor_kwargs={"model": "/models/minilm", "column": "body"},
            batch_size=1024, compute=ray.data.ActorPoolStrategy(size=8), num_gpus=1)

    Each actor loads the model and starts from the warm artifact in `cache_dir` (default $JAXSERVE_CACHE_DIR or
    ~/.cache/jaxserve; shared storage lets every host's actors start without compiling). `table`: a
    `BucketTable`, or `TableOptions` to derive one (default: derived for the actor's device).
    """

    def __init__(self, model: str | None = None, column: str = "text", table=None, dtype: str = "auto",
                 attention: str = "auto", long: str = "truncate", prompt_name: str | None = None,
                 prompt: str | None = None, cache_dir: str | None = None, task: str | None = None):
        self.enc = started_encoder(model, dtype, attention, table, cache_dir, task)
        self.column = column
        self.stages = encoder_embed(self.enc, long, self.enc.embedding_config.prompt(prompt_name, prompt))

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int, int]:
        """(vectors, real tokens, compiled tokens) of `texts`."""
        return self.stages.run(self.stages.prepare(texts))

    def __call__(self, batch) -> dict:
        """A batch as map_batches gives it: a dict of arrays, or (`batch_format="pandas"`) a DataFrame, whose
        columns are read by position (its index is its frame's own, not 0..rows)."""
        texts = np.asarray(batch[self.column])
        # a null (None; NaN where pandas made the column) is refused, as `jaxserve embed` refuses it: str() of it
        # would embed the word "None"
        if (row := next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)) is not None:
            others = ", ".join(f"{k}={np.asarray(v)[row]}" for k, v in batch.items() if k != self.column)
            raise JaxserveError(f"column {self.column!r} is {texts[row]!r}, not text, in row {row} of this batch "
                                f"(its other columns: {others or 'none'})")
        vectors, _, _ = self.embed([str(t) for t in texts])
        return {**batch, "embedding": vectors}


class RangeEmbedder(Embedder):
    """`jaxserve embed --ray`'s stage: each input row is a range of the corpus within one of its files (`start`,
    `count`, and `file`, `seek`, `seek_line`: where reading it begins, `Corpus.seek`'s); its rows are read, embedded and written as one part
    file, and what was done comes back (counts and the seconds spent per range)."""

    def __init__(self, corpus: Corpus, output: str, state: dict, ids: bool, **model):
        super().__init__(**model)
        self.corpus, self.sink = corpus, ParquetSink(output, state, ids)

    def __call__(self, batch: dict) -> dict:
        done: dict[str, list] = {"start": [], "count": [], "tokens": [], "compiled": [], "seconds": []}
        for start, count, path, seek, line in zip(batch["start"], batch["count"], batch["file"], batch["seek"],
                                                  batch["seek_line"], strict=True):
            began = time.perf_counter()
            start, count = int(start), int(count)
            records = self.corpus.records_from(start, count, (str(path), int(seek), int(line)))
            if len(records) != count:
                raise CorpusError(f"{self.corpus.path}: rows {start}..{start + count} are not there; was the input "
                                  "changed during the run?")
            vectors, tokens, compiled = self.embed([text for _, text in records])
            self.sink.write(start, vectors, [i for i, _ in records])
            for key, value in zip(done, (start, count, tokens, compiled, time.perf_counter() - began), strict=True):
                done[key].append(value)
        return {key: np.asarray(values) for key, values in done.items()}


@dataclass
class RayRun:
    """What the Ray side of a run did: the actors, the ranges embedded and the seconds the actors spent on them
    (reading, embedding, writing), beside the run's `Summary`."""

    actors: int = 0
    ranges: int = 0
    range_seconds: float = 0.0
    summary: Summary = field(default_factory=Summary)

    def as_dict(self) -> dict:
        return {"actors": self.actors, "ranges": self.ranges, "range_seconds": round(self.range_seconds, 3)}


def warm(model: dict) -> None:
    """Build (or check) the warm artifact `Embedder(**model)` starts from."""
    Embedder(**model)


def connect(address: str) -> bool:
    """Join the cluster at `address` (as `ray.init` takes it; `local` starts one on this machine), unless this
    process already has; True when this call connected (its caller then disconnects)."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address)  # "local": always a new cluster on this machine
    except (ConnectionError, ValueError) as exc:
        raise JaxserveError(f"--ray {address}: no Ray cluster there ({exc})") from None
    return True


def pool_resources(actors: int | None) -> tuple[int, dict]:
    """The pool's size and each actor's resources: one GPU each where the cluster has GPUs (default: as many
    actors as GPUs), else one CPU each (default: one per node, XLA using the node's cores)."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    nodes = sum(1 for node in ray.nodes() if node["Alive"])
    return (actors or gpus or nodes), ({"num_gpus": 1} if gpus else {"num_cpus": 1})


def run_job(address: str, sink: ParquetSink, corpus: Corpus, model: dict, chunk: int, actors: int | None = None,
            on_range: Callable[[int], None] = lambda n: None, on_resume: Callable[[int], None] = lambda n: None,
            stage: type[RangeEmbedder] = RangeEmbedder) -> RayRun:
    """Embed the rows of `corpus` no part of `sink` holds yet on the Ray cluster at `address`, then seal the
    output. `sink` has passed `check`; `model`: `Embedder`'s keyword arguments (model, table, dtype, attention,
    long, prompt, cache_dir). `on_range(rows)` after each range comes back; `on_resume(rows)` with the rows an
    earlier run left, before any is scheduled."""
    run = RayRun()
    corpus = dataclasses.replace(corpus, path=os.path.abspath(corpus.path))  # workers have their own cwd
    ranges = plan_ranges(sink.rows, chunk, sink.open_parts(), corpus.boundaries())
    on_resume(sink.rows - sum(count for _, count in ranges))
    began = time.perf_counter()
    if ranges:
        seek = corpus.seek({start for start, _ in ranges})
        items = [{"start": s, "count": n, "file": seek[s][0], "seek": seek[s][1], "seek_line": seek[s][2]}
                 for s, n in ranges]
        connected = connect(address)
        try:
            ray.data.DataContext.get_current().enable_progress_bars = False
            run.actors, resources = pool_resources(actors)
            # One actor-sized task builds the warm artifact first, so the pool's actors load it, not each compile.
            ray.get(ray.remote(**resources)(warm).options(max_retries=0).remote(model))
            ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
                stage, fn_constructor_kwargs={"corpus": corpus, "output": os.path.abspath(sink.path), "state": sink.state,
                                              "ids": sink.ids, **model},
                batch_size=1, compute=ray.data.ActorPoolStrategy(size=run.actors), **resources)
            for done in ds.iter_rows():
                run.ranges += 1
                run.range_seconds += float(done["seconds"])
                run.summary.documents += int(done["count"])
                run.summary.tokens += int(done["tokens"])
                run.summary.compiled_tokens += int(done["compiled"])
                on_range(int(done["count"]))
        finally:
            if connected:
                ray.shutdown()
    run.summary.seconds = time.perf_counter() - began
    sink.finish({**run.summary.as_dict(), "ray": run.as_dict()})
    return run

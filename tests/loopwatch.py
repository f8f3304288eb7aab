"""Which thread runs each step that handles a model's outputs: the check that nothing on the event loop grows
with the request, without timing anything.

The steps: every function of the heads that decode and score outputs (`jaxserve.heads.sparse`,
`jaxserve.heads.multivector`), combining and normalising (`Pieces.combine`, `normalize_rows`, `api.scores`,
`api.shape_vectors`, `api.openai_body`), checking token ids (`api._token_ids`, and /decode's and /tokenize's bodies: `api.parse_decode`,
`api.parse_tokenize`), a tokens job's gathers
(`Job.token_vectors`, `jobs.ragged_arange`), placing what the engine process gathered (`jobs.place`) and
encoding (`orjson.dumps`). `watch` wraps each wherever a module
holds it (its own module, and every jaxserve module that imported it by name), and records each call made on
the event loop's thread with its size: the elements of the largest array or container among its arguments and
its result (bytes and text count nothing: moving bytes is the loop's job). A step on the loop at a request's
largest size is the failure; the same steps on the loop for a small request are allowed (a thread hop costs
more than small work).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading

import numpy as np
import orjson

from jaxserve.checkpoint.tokenize import Pieces
from jaxserve.encoder import normalize_rows
from jaxserve.heads import multivector, sparse
from jaxserve.http import api
from jaxserve.scheduling import jobs


def size(value) -> int:
    """Elements of an array, items of a container (a dict: its largest value's), 0 for anything else."""
    if isinstance(value, np.ndarray):
        return value.size
    if isinstance(value, dict):
        return max(map(size, value.values()), default=0)
    if isinstance(value, list | tuple):
        return max(len(value), max(map(size, value[:1]), default=0))
    return 0


def steps() -> list[tuple[object, str, object]]:
    """(owner, attribute, function) of every step, owners being modules and classes."""
    found = [(m, name, f) for m in (sparse, multivector) for name, f in vars(m).items()
             if inspect.isfunction(f) and f.__module__ == m.__name__]
    found += [(Pieces, "combine", Pieces.combine), (jobs.Job, "token_vectors", jobs.Job.token_vectors),
              (jobs, "ragged_arange", jobs.ragged_arange), (jobs, "place", jobs.place), (api, "scores", api.scores),
              (api, "shape_vectors", api.shape_vectors), (api, "openai_body", api.openai_body),
              (api, "_token_ids", api._token_ids), (api, "parse_decode", api.parse_decode),
              (api, "parse_tokenize", api.parse_tokenize),
              (sys.modules[normalize_rows.__module__], "normalize_rows", normalize_rows),
              (orjson, "dumps", orjson.dumps)]
    imported = [(m, name, f) for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("jaxserve")
                for name, f in list(vars(m).items()) for _, _, step in found if f is step]
    return list({(id(o), n): (o, n, f) for o, n, f in found + imported}.values())


class LoopWatch:
    """Steps run on the loop thread, as (step, size) in call order, from `watch` on."""

    def __init__(self, loop_thread: int):
        self.loop_thread = loop_thread
        self.on_loop: list[tuple[str, int]] = []

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def watched(*args, **kwargs):
            result = fn(*args, **kwargs)
            if threading.get_ident() == self.loop_thread:
                self.on_loop.append((name, max([size(a) for a in (*args, *kwargs.values(), result)])))
            return result

        return watched

    def grown(self, inputs: int) -> list[tuple[str, int]]:
        """The loop's steps that grew with a request of `inputs` inputs: one at least that large, or a step the
        loop ran that many times (a per-input loop)."""
        calls = {}
        for name, n in self.on_loop:
            calls[name] = calls.get(name, 0) + 1
        return [(name, n) for name, n in self.on_loop if n >= inputs] + \
            [(f"{name} x {count}", 0) for name, count in calls.items() if count >= inputs]


def watch(monkeypatch) -> LoopWatch:
    """Wrap every step (undone with `monkeypatch`); call on the event loop's thread."""
    watcher = LoopWatch(threading.get_ident())
    for owner, name, fn in steps():
        monkeypatch.setattr(owner, name, watcher.wrap(f"{getattr(fn, '__qualname__', name)}", fn))
    return watcher

"""A front-end's tokenizer call for one-document requests: 400 corpus texts through `TextTokenizer.documents`, one
text a call against 8 a call (a turn's requests tokenized together), CPU per text, three alternating rounds.

    python results/issue37/tok_batch.py
"""
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

import harness

from jaxserve.checkpoint import loader
from jaxserve.checkpoint.tokenize import TextTokenizer

tok = TextTokenizer.from_dir(loader.resolve(None), 256)
docs = harness.documents(4000, seed=0)[:400]
calls = {"1 text a call": lambda: [tok.documents([d]) for d in docs],
         "8 texts a call": lambda: [tok.documents(docs[i : i + 8]) for i in range(0, len(docs), 8)]}


def timed(name: str, run) -> None:
    """Five passes of one way, CPU per text printed."""
    t0 = time.process_time()
    for _ in range(5):
        run()
    print(f"{name}: {1e6 * (time.process_time() - t0) / (5 * len(docs)):.1f} us per text", flush=True)


harness.rounds({name: functools.partial(timed, name, run) for name, run in calls.items()}, 3)

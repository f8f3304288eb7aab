"""bench_host's one-document floor pass by pass (100 bodies a pass, CPU per request), then bench_host.floor_ms
called three times in the same process: the first pass is cold, and a pass of ~10 ms can catch a hiccup of the VM.

    python results/issue37/floor_passes.py
"""
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

import bench_host
import harness
import numpy as np
import orjson
from tokenizers import Tokenizer

from jaxserve.checkpoint import loader

bodies = bench_host.request_bodies(harness.documents(4000, seed=0), 1, "base64")
tok = Tokenizer.from_file(str(loader.resolve(None) / "tokenizer.json"))
tok.no_padding()
tok.enable_truncation(256)
for p in range(12):
    t0 = time.process_time()
    for body in bodies:
        encodings = tok.encode_batch_fast(orjson.loads(body)["input"])
        np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), np.int32)
    print(f"pass {p}: {1e3 * (time.process_time() - t0) / len(bodies):.4f} ms a request (decode + tokenize)")
for _ in range(3):
    f = bench_host.floor_ms(bodies, "base64", 384, 256, None)
    print(f"floor_ms: {f['total']:.4f} ms over {f['requests']} requests")

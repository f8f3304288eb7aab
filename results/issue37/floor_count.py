"""bench_host.py's floor (orjson decode, the tokenizer's batch call with the ids read out, the base64 response
encoded) for N one-document requests, to count under callgrind: the difference of two runs is the floor's
instructions per request, to set beside frontend_callgrind.sh's.

    cd <repo> && for n in 0 1000; do valgrind --tool=callgrind --callgrind-out-file=/tmp/cgfl_$n.out \\
        .venv/bin/python results/issue37/floor_count.py $n; done
    # (totals of 1000 - totals of 0) / 1000
"""
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

import numpy as np  # noqa: E402
import orjson  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

import bench_host  # noqa: E402
import harness  # noqa: E402
from jaxserve.checkpoint import loader  # noqa: E402
from jaxserve.http import api  # noqa: E402

bodies = bench_host.request_bodies(harness.documents(4000, seed=0), 1, "base64")
tok = Tokenizer.from_file(str(loader.resolve(None) / "tokenizer.json"))
tok.no_padding()
tok.enable_truncation(256)
vectors = np.random.default_rng(0).standard_normal((1, 384)).astype(np.float32)


def floor(body: bytes) -> None:  # as bench_host.floor_ms does it
    texts = orjson.loads(body)["input"]
    encodings = tok.encode_batch_fast(texts)
    np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), np.int32)
    api.openai_body(vectors, "m", 0, "base64")


for b in bodies:  # warm, in both runs
    floor(b)
for i in range(int(sys.argv[1])):
    floor(bodies[i % len(bodies)])

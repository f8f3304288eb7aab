"""The OpenAI body at base64 (`api.openai_body`, the OpenAI client's default format) for 1 and 100 MiniLM-wide
vectors, CPU time per call, each tree in a process of its own (its jaxserve on PYTHONPATH), the order alternating;
then the Ray Serve handle's read of the 100-vector body (`JaxserveReplica.embed`): the standard library's json
and base64, as before 38b5dab, against orjson and pybase64.

    python results/issue37/b64_encode.py ROUNDS TREE...   # e.g. 2 /tmp/before "$PWD"
"""
import base64
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np
import orjson
import pybase64

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

import harness

from jaxserve.http import api

ONE = r"""
import sys, time
import numpy as np
from jaxserve.http import api
assert api.__file__.startswith(sys.argv[1]), api.__file__
v = np.random.default_rng(0).standard_normal((100, 384)).astype(np.float32)
out = []
for x, n in ((v, 2000), (v[:1], 100000)):
    api.openai_body(x, "m", 0, "base64")
    t = time.process_time()
    for _ in range(n):
        api.openai_body(x, "m", 0, "base64")
    out.append(f"{len(x)} vectors {1e6 * (time.process_time() - t) / n:.1f} us")
print(sys.argv[1] + ": " + ", ".join(out), flush=True)
"""


def read_timed(name: str, read) -> None:
    """1,000 reads of the body one way, their CPU time printed."""
    t = time.process_time()
    for _ in range(1000):
        read()
    print(f"read of the 100-vector body, {name}: {1e3 * (time.process_time() - t):.1f} us", flush=True)


if __name__ == "__main__":
    rounds, trees = int(sys.argv[1]), sys.argv[2:]
    # run from / so that the current directory's jaxserve does not shadow the tree's
    harness.rounds({tree: functools.partial(subprocess.run, [sys.executable, "-c", ONE, tree],
                                            env={"PYTHONPATH": tree}, cwd="/", check=True) for tree in trees}, rounds)
    body = api.openai_body(np.random.default_rng(0).standard_normal((100, 384)).astype(np.float32), "m", 0, "base64")
    ways = {
        "json + base64": lambda: np.stack([np.frombuffer(base64.b64decode(d["embedding"]), np.float32)
                                           for d in json.loads(body)["data"]]),
        "orjson + pybase64": lambda: np.stack([np.frombuffer(pybase64.b64decode(d["embedding"]), "<f4")
                                               for d in orjson.loads(body)["data"]]),
    }
    assert all((f() == ways["json + base64"]()).all() for f in ways.values())
    harness.rounds({name: functools.partial(read_timed, name, f) for name, f in ways.items()}, 2)

"""The OpenAI body at base64 (`api.openai_body`, the OpenAI client's default format) for 1 and 100 MiniLM-wide
vectors, CPU time per call, each tree in a process of its own (its jaxserve on PYTHONPATH), the order alternating:

    python results/issue37/b64_encode.py ROUNDS TREE...   # e.g. 2 /tmp/before "$PWD"
"""
import subprocess
import sys

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

if __name__ == "__main__":
    rounds, trees = int(sys.argv[1]), sys.argv[2:]
    for r in range(rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            # run from / so that the current directory's jaxserve does not shadow the tree's
            subprocess.run([sys.executable, "-c", ONE, tree], env={"PYTHONPATH": tree}, cwd="/", check=True)

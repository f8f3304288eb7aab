"""The models and tables of docs/benchmarks.md's "/health under the sparse and multi-vector routes": the tests'
tiny SPLADE, and their tiny ColBERT at ColBERT's sizes (128-dimensional token vectors, 180-token documents).

    python results/issue36/loop/make_models.py /tmp/loopbench    # from the repository root
"""
import sys
from pathlib import Path

sys.path.insert(0, "tests")
import test_multivector as mv  # noqa: E402
from test_sparse import splade_checkpoint  # noqa: E402

from jaxserve.runtime.buckets import fixed  # noqa: E402

root = Path(sys.argv[1])
print(splade_checkpoint(root / "splade"))
mv.DIM, mv.DOCUMENT_LENGTH = 128, 180
print(mv.st_checkpoint(root / "colbert"))
fixed([(4, 128), (16, 128)], layout="packed").save(root / "splade-table.json")
fixed([(4, 16), (16, 16), (4, 256), (8, 256)], layout="packed").save(root / "colbert-table.json")

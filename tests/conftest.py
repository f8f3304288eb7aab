import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

# Never reach for the network: hub lookups must fail fast with our clear error.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"

from jaxserve.buckets import fixed  # noqa: E402

# Small tables keep the tiny-model tests quick; the default derived table is
# exercised by the MiniLM float32 parity test and the server tests.
TINY_TABLE = fixed([(1, 16), (4, 16), (1, 32), (4, 32), (1, 64), (4, 64)], layout="packed")
MINILM_SMALL_TABLE = fixed([(4, 64), (8, 64), (4, 128), (2, 256), (8, 256)], layout="packed")


@pytest.fixture(scope="session")
def minilm():
    from jaxserve import Encoder

    return Encoder.from_pretrained(None)


@pytest.fixture(scope="session")
def minilm_reference():
    meta = json.loads((FIXTURES / "minilm_reference.json").read_text())
    return meta["texts"], np.load(FIXTURES / "minilm_reference.npy")


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """Factory: write a tiny random checkpoint and return its directory."""
    def make(name="tiny", **kw):
        return tiny.write_checkpoint(tmp_path / name, **kw)
    return make


def cosine_rows(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))

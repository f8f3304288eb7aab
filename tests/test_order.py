"""Rows come back in input order, whatever the batching does."""

import numpy as np
from conftest import TINY_TABLE, warm_encoder


def test_order_preserved_across_length_groups(tiny_checkpoint):
    enc = warm_encoder(tiny_checkpoint(), TINY_TABLE)
    rng = np.random.default_rng(1)
    texts = ["the " * int(n) + f"doc {i}" for i, n in enumerate(rng.integers(0, 60, size=70))]
    batched = enc.embed(texts)
    singles = np.concatenate([enc.embed([t]) for t in texts])
    np.testing.assert_allclose(batched, singles, atol=1e-5)
    perm = rng.permutation(len(texts))
    np.testing.assert_allclose(enc.embed([texts[i] for i in perm]), batched[perm], atol=1e-5)


def test_empty_list_gives_empty_array(tiny_checkpoint):
    enc = warm_encoder(tiny_checkpoint(), TINY_TABLE)
    out = enc.embed([])
    assert out.shape == (0, 32) and out.dtype == np.float32

"""What the host reads of a model (jaxserve/view.py): here, its normalisation."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.view import normalize_rows


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1100), st.integers(-30, 12), st.integers(0, 2**32 - 1), st.booleans())
def test_one_vector_normalises_to_the_same_floats_as_in_a_batch(dim, scale, seed, zero):
    """A query's vector takes a short path; it must equal, float for float, the same vector normalised among
    others (a document's embedding does not depend on the request it came in)."""
    x = (np.random.default_rng(seed).standard_normal((3, dim)) * 10.0**scale).astype(np.float32)
    if zero:
        x[1] = 0
    batch = normalize_rows(x)
    for i in range(3):
        one = normalize_rows(x[i : i + 1])
        assert one.dtype == np.float32 and one.shape == (1, dim)
        np.testing.assert_array_equal(one, batch[i : i + 1])
    if scale > -10:  # far from the 1e-12 floor below which a norm is not divided by
        np.testing.assert_allclose(np.linalg.norm(batch[[0, 2]], axis=1), 1, rtol=1e-5)

"""Slot chunks of a pooled output: they partition it, and the leading ones that `needed` picks hold every filled slot."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from jaxserve.runtime import output_chunks
from jaxserve.runtime.buckets import MAX_SLOTS


def test_ends_of_the_served_slot_counts():
    assert output_chunks.ends(1) == (1,)
    assert output_chunks.ends(2) == (1, 2)
    assert output_chunks.ends(8) == (1, 4, 8)
    assert output_chunks.ends(32) == (1, 4, 16, 32)


@given(st.integers(1, MAX_SLOTS), st.data())
def test_chunks_partition_the_output_and_the_needed_ones_hold_the_filled_slots(slots, data):
    out = np.arange(3 * slots * 2).reshape(3, slots, 2)  # [B, K, D]
    chunks = output_chunks.split(out, slots)
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), out)  # nothing duplicated, nothing lost
    sequences = data.draw(st.integers(0, slots))
    n = output_chunks.needed(slots, sequences)
    kept = output_chunks.join(list(chunks[:n]))
    assert kept.shape[1] >= max(1, sequences)  # every filled slot comes back
    np.testing.assert_array_equal(kept, out[:, : kept.shape[1]])  # as the leading slots, in order
    if n > 1:  # and no fewer chunks would do
        assert output_chunks.ends(slots)[n - 2] < sequences
    assert kept.shape[1] <= max(4 * sequences, 1)  # at most 4x the filled slots (K <= 32 < 4 x 17)

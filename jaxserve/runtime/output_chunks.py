"""A pooled output in slot chunks, so that a batch ships only the slots its rows fill.

A pooled executable's output is [B, K, D]: one vector per slot, K = the most
sequences a row can hold. Most batches fill far fewer (a row of one long
document fills one slot of up to 32), and an output size must be fixed when
the executable is compiled. So the executable returns its output cut along
the slot axis at 1, 4, 16 (and K): chunks [B, 1, D], [B, 3, D], [B, 12, D],
[B, K - 16, D]. They partition the output, so device memory is what it was.
The host knows how many sequences the batch's fullest row holds, and copies
only the leading chunks that cover them.
"""

from __future__ import annotations

import numpy as np

EDGES = (1, 4, 16)  # slot counts a batch's copy can stop at, below K


def ends(slots: int) -> tuple[int, ...]:
    """Each chunk's end along the slot axis: the edges below `slots`, then `slots`."""
    return (*(e for e in EDGES if e < slots), slots)


def split(out, slots: int) -> tuple:
    """[B, K, ...] -> its chunks along axis 1 (inside the traced forward: each becomes its own output buffer)."""
    starts = (0, *ends(slots)[:-1])
    return tuple(out[:, a:b] for a, b in zip(starts, ends(slots)))


def needed(slots: int, sequences: int) -> int:
    """How many leading chunks hold slots 1..`sequences` (at least one: an all-padding batch still answers)."""
    return next(i + 1 for i, end in enumerate(ends(slots)) if end >= sequences)


def join(chunks: list[np.ndarray]) -> np.ndarray:
    """Host chunks -> [B, k, ...], k = their slots together (no copy when there is one)."""
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=1)

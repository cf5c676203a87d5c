"""Token bitmasks: rows of uint32 words; bit ``t % 32`` of word ``t // 32`` set means token ``t``
is allowed; a row has :func:`mask_words` ``(n_vocab)`` words for the model's ``n_vocab`` (the
width of its logits); bits past ``n_vocab`` are always clear.
"""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------- token bitmasks

def mask_words(n_vocab: int) -> int:
    """uint32 words in one mask row for a vocabulary of n_vocab tokens."""
    return (n_vocab + 31) // 32


def allocate_masks(rows: int, n_vocab: int) -> np.ndarray:
    """A (rows, words) uint32 array of mask rows, every token forbidden."""
    return np.zeros((rows, mask_words(n_vocab)), dtype=np.uint32)


def allowed_tokens(row: np.ndarray, n_vocab: int) -> np.ndarray:
    """A mask row as booleans, one per token (length n_vocab)."""
    bits = (row.astype(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.astype(bool).reshape(-1)[:n_vocab]


def is_allowed(row: np.ndarray, token: int) -> bool:
    """Whether a mask row allows `token`."""
    return 0 <= token < 32 * len(row) and bool((int(row[token >> 5]) >> (token & 31)) & 1)

"""Token masks read back in tests: the inverse of ``verifier.pack_mask`` and a logits row with a
mask row applied (what a constrained target samples from)."""

from __future__ import annotations

import numpy as np

from localspec.decoding.grammar.masks import allowed_tokens


def unpack_mask(masks: np.ndarray, n_vocab: int) -> np.ndarray:
    """Inverse of ``verifier.pack_mask``: uint32 ``[..., words]`` -> boolean ``[..., n_vocab]``."""
    m = np.ascontiguousarray(np.asarray(masks, dtype=np.uint32)).astype("<u4")
    bits = np.unpackbits(m.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :n_vocab].astype(np.bool_)


def mask_logits(logits: np.ndarray, row: np.ndarray) -> np.ndarray:
    """Forbidden tokens' logits set to -inf, in place (logits: one row of n_vocab floats)."""
    logits[~allowed_tokens(row, logits.shape[-1])] = -np.inf
    return logits

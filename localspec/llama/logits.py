"""Rows of logits that llama.cpp owns: :class:`LogitsPointer`, what a model's last decode gives
(``Model.logits``) and what the verifier reads without copying (``localspec.verify.verifier``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LogitsPointer:
    """Rows of float32 logits owned by someone else (e.g. llama.cpp's output buffer)."""

    address: int
    n_rows: int
    n_vocab: int
    row_stride: int | None = None  # floats between rows; default n_vocab

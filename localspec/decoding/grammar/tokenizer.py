"""The tokenizer: llguidance's view of a model's own vocabulary (:func:`tokenizer_for`, built once
per model and kept on the model, ``Model.grammar_tokenizer``). Building it reads every token of
the vocabulary (~0.9 s for a 152k vocabulary on a 2-core CPU, holding the GIL), in a thread
(:func:`start_tokenizer`); a caller that knows of a constraint before the model loads builds it
from the file's vocabulary while the weights load (:func:`prestart_tokenizer`). A constrained
generation waits for it when it is set up: the grammar's start is checked over this vocabulary
before the prefill.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import llama_cpp as lc
import llguidance

from localspec.errors import ModelError
from localspec.llama import compat
from localspec.llama.model import Model

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- the tokenizer

class VocabModel(Protocol):
    """What building a tokenizer needs of a model (localspec.llama.model.Model has it), and where
    the model keeps its tokenizer once started (:func:`start_tokenizer`; None before)."""

    n_vocab: int
    grammar_tokenizer: Any  # TokenizerFuture | None

    @property
    def vocab_pointer(self) -> Any: ...

    def is_eog(self, token: int) -> bool: ...


SPECIAL_ATTRS = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN | lc.LLAMA_TOKEN_ATTR_UNUSED
SPECIAL_PREFIX = b"\xff"  # llguidance's mark of a special token: never text, only named in grammars


def end_tokens(model: VocabModel) -> list[int]:
    """Every end-of-generation token of the model (EOS, EOT, <|im_end|>, ...)."""
    return [t for t in range(model.n_vocab) if model.is_eog(t)]


def token_pieces(vocab: Any, n_vocab: int) -> list[bytes]:
    """What each token is to llguidance: the bytes it adds to the output — exactly what
    ``Model.token_bytes`` renders — or, for a token that renders as nothing (control, unknown,
    unused) or looks like a marker (a user-defined ``<...>``), its text after llguidance's
    special prefix, so that no grammar of text allows it."""
    buf = ctypes.create_string_buffer(256)
    pieces = []
    for token in range(n_vocab):
        n = lc.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
        piece = buf.raw[:max(n, 0)]
        attr = lc.llama_vocab_get_attr(vocab, token)
        marker = attr & lc.LLAMA_TOKEN_ATTR_USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">")
        if not piece or attr & SPECIAL_ATTRS or marker:
            piece = SPECIAL_PREFIX + (lc.llama_vocab_get_text(vocab, token) or b"")
        pieces.append(piece)
    return pieces


def build_tokenizer(model: VocabModel) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for the model's vocabulary, every end-of-generation token an end
    token (uncached; see :func:`tokenizer_for`). It keeps llama.cpp's vocabulary pointer to
    tokenize forced text, so it is valid only while the model is open."""
    started = time.perf_counter()
    vocab = model.vocab_pointer
    ends = end_tokens(model)
    if not ends:
        raise ModelError("the model's vocabulary has no end-of-generation token; a constrained "
                         "generation could never end")
    pieces = token_pieces(vocab, model.n_vocab)
    tokenize = compat.tokenize_address()
    # llguidance's stub (_lib.pyi) lacks from_llamacpp, which its own llamacpp.py calls
    tokenizer = llguidance.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=pieces, vocab_ptr=vocab, tokenize_fptr=tokenize, eos_token=ends)
    log.debug("llguidance tokenizer for %d tokens (ends %s) in %.2f s", model.n_vocab, ends,
              time.perf_counter() - started)
    return tokenizer


class TokenizerFuture:
    """A tokenizer being built in a background thread (:func:`start_tokenizer`,
    :func:`prestart_tokenizer`); the model it reads must stay open until :meth:`result` returns."""

    def __init__(self, model: VocabModel | None = None, path: Path | None = None) -> None:
        self._future: concurrent.futures.Future[llguidance.LLTokenizer] = concurrent.futures.Future()
        self.vocabulary: VocabModel | None = None  # the vocabulary-only model a file's tokenizer reads: kept open
        self.checked: set[bytes] = set()  # digests of the grammars whose start was followed over this vocabulary
        self._thread = threading.Thread(target=self._build, args=(model, path), name="localspec-tokenizer",
                                        daemon=True)
        self._thread.start()

    def _build(self, model: VocabModel | None, path: Path | None) -> None:
        if not self._future.set_running_or_notify_cancel():
            return
        try:
            if model is None:  # from the file, while its weights load
                assert path is not None
                model = self.vocabulary = Model.vocabulary(path)
            self._future.set_result(build_tokenizer(model))
        except BaseException as exc:  # handed to whoever waits for the result
            self._future.set_exception(exc)

    def done(self) -> bool:
        return self._future.done()

    def failed(self) -> bool:
        """Whether the build ended with an error (a later start_tokenizer tries again)."""
        return self._future.done() and self._future.exception() is not None

    def result(self, timeout: float | None = None) -> llguidance.LLTokenizer:
        """The tokenizer, waiting for it; the build's error (ModelError, ...) is raised here."""
        return self._future.result(timeout)


_LOCK = threading.Lock()  # guards each model's tokenizer (Model.grammar_tokenizer)


def prestart_tokenizer(path: str | os.PathLike) -> TokenizerFuture:
    """Start building the tokenizer of the GGUF file at `path` from its vocabulary alone, in a
    background thread, so that it overlaps with loading the file's weights (a constrained
    generation known before the load); whoever loads the model hands it over (adopt_tokenizer)."""
    return TokenizerFuture(path=Path(path).expanduser().resolve())


def adopt_tokenizer(model: VocabModel, future: TokenizerFuture) -> None:
    """The model loaded from the file a prestart_tokenizer read takes its tokenizer (unless it has
    one, or that build failed: start_tokenizer then builds one again)."""
    with _LOCK:
        if model.grammar_tokenizer is None and not future.failed():
            model.grammar_tokenizer = future


def start_tokenizer(model: VocabModel) -> TokenizerFuture:
    """Start building the model's tokenizer in a background thread, once per model (a later
    call returns the same future, and one adopted from a prestart). The model keeps it
    (``model.grammar_tokenizer``): it lives as long as the model."""
    _ = model.vocab_pointer  # a closed model: ModelError now, not a crash in the thread
    with _LOCK:
        future = model.grammar_tokenizer
        if future is None or future.failed():
            future = model.grammar_tokenizer = TokenizerFuture(model)
        return future


def tokenizer_for(model: VocabModel) -> llguidance.LLTokenizer:
    """The model's llguidance tokenizer, built once per model (waits for one being built)."""
    _ = model.vocab_pointer  # refuse a closed model: the tokenizer points into its vocabulary
    return start_tokenizer(model).result()

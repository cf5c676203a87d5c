"""A model's vocabulary through llama.cpp: tokenizing, the bytes each token stands for (decoded
incrementally, UTF-8 safe), the special tokens and markers llama.cpp's tokenizer reads out of
text and the model's chat template (rendered by localspec.prompt with jinja2).

:class:`Vocabulary` is the vocabulary side of a loaded model (``localspec.llama.model.Model``
derives from it): it needs the model's ``llama_model_p`` and ``llama_vocab_p`` (``_model`` and
``_vocab``, None once closed), its ``path`` and a dictionary of rendered pieces (``_pieces``).
"""

from __future__ import annotations

import codecs
import ctypes
from pathlib import Path
from typing import Any

import llama_cpp as lc

from localspec.errors import ModelError, PromptError

# tokens llama.cpp's tokenizer reads out of text where parse_special is on
_SPECIAL_ATTRS = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN


class IncrementalDetokenizer:
    """Token ids -> text pieces, never splitting a UTF-8 character across pieces."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self._vocabulary = vocabulary
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self._decoder.decode(self._vocabulary.token_bytes(token))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class Vocabulary:
    """The vocabulary of a loaded model (see the module docstring for what it needs)."""

    path: Path
    _model: Any
    _vocab: Any
    _pieces: dict[int, bytes]

    def _live(self) -> None:
        """A ModelError, never a crash or an AttributeError, for a model used after close()."""
        if self._model is None:
            raise ModelError(f"{self.path.name} is closed; load it again to use it")

    @property
    def bos(self) -> int:
        self._live()
        return int(lc.llama_vocab_bos(self._vocab))

    @property
    def eos(self) -> int:
        self._live()
        return int(lc.llama_vocab_eos(self._vocab))

    @property
    def add_bos(self) -> bool:
        self._live()
        return bool(lc.llama_vocab_get_add_bos(self._vocab))

    @property
    def vocab_type(self) -> int:
        self._live()
        return int(lc.llama_vocab_type(self._vocab))

    @property
    def vocab_pointer(self) -> Any:
        """llama.cpp's vocabulary of this model (a ``llama_vocab_p``), for libraries that read it
        themselves (llguidance's tokenizer). Valid while the model is open: close() frees it."""
        self._live()
        return self._vocab

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT, <|im_end|>, ...)."""
        self._live()
        return bool(lc.llama_vocab_is_eog(self._vocab, token))

    def token_text(self, token: int) -> bytes:
        self._live()
        return lc.llama_vocab_get_text(self._vocab, token) or b""

    def _attr(self, token: int) -> int:
        """llama.cpp's LLAMA_TOKEN_ATTR_* bits of a token (control, user-defined, byte, ...)."""
        self._live()
        return int(lc.llama_vocab_get_attr(self._vocab, token))

    def is_marker(self, token: int) -> bool:
        """A token llama.cpp's tokenizer reads out of text: a control or unknown token (with
        parse_special), or a user-defined marker such as <tool_call> (even without it)."""
        attr = self._attr(token)
        if attr & _SPECIAL_ATTRS:
            return True
        if not attr & lc.LLAMA_TOKEN_ATTR_USER_DEFINED:
            return False
        text = self.token_text(token)
        return text.startswith(b"<") and text.endswith(b">")

    def strips(self, token: int) -> tuple[bool, bool]:
        """Whether llama.cpp's tokenizer, reading this marker out of text, drops the whitespace
        before it and the whitespace after it (its LSTRIP and RSTRIP attributes)."""
        attr = self._attr(token)
        return bool(attr & lc.LLAMA_TOKEN_ATTR_LSTRIP), bool(attr & lc.LLAMA_TOKEN_ATTR_RSTRIP)

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> token ids (add_special: BOS if the model wants one; parse_special: read
        control tokens such as <|im_start|> written in the text, as chat templates do). The text is
        passed with its length, so a NUL in it is text too; PromptError where the vocabulary has
        no token for it (llama.cpp would drop it)."""
        self._live()
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise ModelError("tokenization failed")
        tokens = list(buf[:n])
        if b"\0" in data and b"".join(map(self.token_bytes, tokens)).count(b"\0") < data.count(b"\0"):
            raise PromptError(f"the text holds a NUL character (U+0000), for which the vocabulary of {self.path.name} "
                              "has no token; remove it")
        return tokens

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for in generated text (control tokens render as nothing)."""
        piece = self._pieces.get(token)
        if piece is None:
            self._live()
            buf = ctypes.create_string_buffer(64)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = buf.raw[: max(n, 0)]
            self._pieces[token] = piece
        return piece

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)

    @property
    def chat_template(self) -> str | None:
        self._live()
        tmpl = lc.llama_model_chat_template(self._model, None)
        return tmpl.decode("utf-8", "replace") if tmpl else None


"""Which draft can draft for which target, and a draft loaded only when it is needed.

:func:`check_pair` applies llama.cpp's rules (common/speculative.cpp) to two loaded models;
:func:`check_lazy_pair` reads only a lazy draft's vocabulary, once per machine when given the
cost profiles (the verdict is kept in the target's profile); :class:`LazyModel` loads on first
use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from pathlib import Path

from localspec.decoding.profiles import Profiles
from localspec.llama.host import identity, key_of
from localspec.config import ModelOptions
from localspec.errors import ModelError
from localspec.llama.model import Model, _check_gguf_file, claimed

log = logging.getLogger(__name__)

VOCAB_MAX_SIZE_DIFFERENCE = 128  # llama.cpp common/speculative: tolerated n_vocab gap
VOCAB_CHECK_START_TOKEN_ID = 5  # ... and tokens compared from this id on


class LazyModel:
    """A model loaded on first use (a draft the planner may never need). The planner records its
    load time (`load_seconds`) in its cost profile."""

    def __init__(self, path: str | os.PathLike, options: ModelOptions | None = None, paired: bool = False) -> None:
        self.path = Path(path).expanduser()
        self.options = options or ModelOptions()
        self.paired = paired  # a registry pair: its vocabulary is known to match the target's
        _check_gguf_file(self.path)
        self.identity = identity(self.path, self.options)
        self._model: Model | None = None
        self._busy = threading.Lock()
        self.load_seconds: float | None = None  # set when it is loaded

    def in_use(self) -> contextlib.AbstractContextManager[None]:
        """Claim the draft for one generation (localspec.llama.model.claimed)."""
        return claimed(self._busy, self.path.name)

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size

    @property
    def name(self) -> str:
        return self._model.name if self._model is not None else self.path.stem

    def get(self) -> Model:
        if self._model is None:
            t0 = time.perf_counter()
            self._model = Model(self.path, self.options)
            self.load_seconds = time.perf_counter() - t0
            log.info("loaded the draft %s in %.2f s", self.path.name, self.load_seconds)
        return self._model

    def close(self) -> None:
        if self._model is not None:
            self._model.close()
            self._model = None


def check_lazy_pair(target: Model, draft: LazyModel, store: Profiles) -> None:
    """check_pair for a draft that is not loaded: its vocabulary alone is read, once per machine
    when `store` is saved (the verdict is kept in the target's profile)."""
    if draft.paired:
        return
    profile = store.get(target.identity)
    key = "pair:" + key_of(draft.identity)
    verdict = profile.checks.get(key)
    if verdict is None:
        verdict = _vocabulary_verdict(target, draft.path)
        profile.checks[key] = verdict
        profile.dirty = True
    if verdict != "ok":
        raise ModelError(verdict)


def _vocabulary_verdict(target: Model, draft_path: Path) -> str:
    """"ok" when the draft file's vocabulary can draft for the target, else why not."""
    vocab = Model.vocabulary(draft_path)
    try:
        check_pair(target, vocab)
        return "ok"
    except ModelError as exc:
        return str(exc)
    finally:
        vocab.close()


_checked_pairs: "weakref.WeakKeyDictionary[Model, weakref.WeakSet[Model]]" = weakref.WeakKeyDictionary()


def check_pair(target: Model, draft: Model) -> None:
    """Can `draft` propose tokens for `target`? llama.cpp's rules (common/speculative.cpp):
    same vocabulary type, same BOS/EOS and add-BOS, vocab sizes within 128, and the same token
    text from id 5 on. Raises ModelError naming the first difference."""
    t, d = target, draft
    if d in _checked_pairs.get(t, ()):
        return  # checked once per loaded pair: it compares the whole vocabulary

    def fail(why: str) -> None:
        raise ModelError(f"draft {d.path.name} cannot draft for target {t.path.name}: {why}")

    if t.vocab_type != d.vocab_type:
        fail(f"vocabulary types differ (target {t.vocab_type}, draft {d.vocab_type})")
    if t.add_bos != d.add_bos or t.bos != d.bos:
        fail(f"BOS differs (target {t.bos} add={t.add_bos}, draft {d.bos} add={d.add_bos})")
    if t.eos != d.eos:
        fail(f"EOS differs (target {t.eos}, draft {d.eos})")
    if abs(t.n_vocab - d.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        fail(f"vocabulary sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE} "
             f"(target {t.n_vocab}, draft {d.n_vocab})")
    for tok in range(VOCAB_CHECK_START_TOKEN_ID, min(t.n_vocab, d.n_vocab)):
        a, b = t.token_text(tok), d.token_text(tok)
        if a != b:
            fail(f"token {tok} is {a!r} in the target but {b!r} in the draft")
    _checked_pairs.setdefault(t, weakref.WeakSet()).add(d)

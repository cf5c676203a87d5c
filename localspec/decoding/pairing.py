"""Which draft can draft for which target.

:func:`check_pair` applies llama.cpp's rules (common/speculative.cpp) to two loaded models;
:func:`check_lazy_pair` reads only the vocabulary of a draft not loaded yet
(``localspec.llama.lazy.LazyModel``). Either checks a target and a draft once: the verdict is kept
in one place, the target's ``Model.checked_drafts`` (so a lazy draft that loads later is not
compared again).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from localspec.errors import ModelError
from localspec.llama.host import key_of
from localspec.llama.lazy import LazyModel
from localspec.llama.model import Model

VOCAB_MAX_SIZE_DIFFERENCE = 128  # llama.cpp common/speculative: tolerated n_vocab gap
VOCAB_CHECK_START_TOKEN_ID = 5  # ... and tokens compared from this id on


def check_lazy_pair(target: Model, draft: LazyModel) -> None:
    """check_pair for a draft that is not loaded: its vocabulary alone is read, once per target
    and draft."""
    if draft.paired:
        return
    _check(target, draft, lambda: _vocabulary_verdict(target, draft.path))


def _vocabulary_verdict(target: Model, draft_path: Path) -> str:
    """"ok" when the draft file's vocabulary can draft for the target, else why not."""
    vocab = Model.vocabulary(draft_path)
    try:
        return _verdict(target, vocab)
    finally:
        vocab.close()


def _check(target: Model, draft: Model | LazyModel, verdict: Callable[[], str]) -> None:
    """Raise ModelError unless the pair passes; `verdict` runs only for a pair not checked yet
    (the target keeps each draft's verdict, by the draft's identity)."""
    key = key_of(draft.identity)
    found = target.checked_drafts.get(key)
    if found is None:
        found = target.checked_drafts[key] = verdict()
    if found != "ok":
        raise ModelError(found)


def _verdict(target: Model, draft: Model) -> str:
    try:
        _compare(target, draft)
        return "ok"
    except ModelError as exc:
        return str(exc)


def check_pair(target: Model, draft: Model) -> None:
    """Can `draft` propose tokens for `target`? llama.cpp's rules (common/speculative.cpp):
    same vocabulary type, same BOS/EOS and add-BOS, vocab sizes within 128, and the same token
    text from id 5 on. Raises ModelError naming the first difference. Once per target and draft:
    it compares the whole vocabulary."""
    _check(target, draft, lambda: _verdict(target, draft))


def _compare(target: Model, draft: Model) -> None:
    """check_pair's comparison, every time."""
    t, d = target, draft

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

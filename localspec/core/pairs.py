"""What a call asks the core to hold: a typed pair spec (:class:`PairSpec`).

A model file is keyed by what it is, not by its name: its device, inode, size, modification
and change time (:class:`ModelFile`). A file replaced in place with its old size and
modification time restored (``cp`` + ``touch -r``, ``rsync -t``) still has a new change time
(or a new inode), so it is another file, never served from the old weights. The load options are
one type per model (:class:`~localspec.settings.models.PairOptions`).

The ``localspec`` client makes these (it resolves registry names, fetching them, and relative
paths itself): the standard library and :mod:`localspec.settings` only.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from localspec.settings.models import PairOptions
from localspec.settings.validation import WIRE_CONFIG

TYPE_CHECKING = False  # no typing at run time: the `localspec` client imports this module
if TYPE_CHECKING:
    from typing import Any


@dataclass(frozen=True)
class ModelFile:
    """A GGUF file as it was when a call named it: its absolute path and what identifies its
    contents on this machine."""

    __pydantic_config__ = WIRE_CONFIG  # a resident service validates requests with pydantic

    path: str  # absolute (os.fsdecode: bytes that are not UTF-8 kept as surrogate escapes)
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or "\0" in self.path or not os.path.isabs(self.path):
            raise ValueError(f"a model file's path must be absolute, without NUL, got {self.path!r:.80}")

    @classmethod
    def at(cls, path: str | os.PathLike) -> ModelFile:
        """The file at `path` now (OSError when it cannot be read; a symbolic link is followed)."""
        absolute = os.path.abspath(os.fsdecode(path))
        st = os.stat(absolute)
        return cls(absolute, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @property
    def identity(self) -> tuple[int, int, int, int, int]:
        """What changes when the file is replaced, whatever its name."""
        return self.device, self.inode, self.size, self.mtime_ns, self.ctime_ns

    def is_current(self) -> bool:
        """Whether `path` still holds this file."""
        try:
            return ModelFile.at(self.path).identity == self.identity
        except (OSError, ValueError):
            return False

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


@dataclass(frozen=True)
class PairSpec:
    """A target, its draft (None: no draft model) and how both load; `target_name` is how the
    call named the target (a registry name, or the path given), what its output reports."""

    __pydantic_config__ = WIRE_CONFIG

    target: ModelFile
    draft: ModelFile | None
    target_name: str
    paired: bool  # the registry's own pair: its vocabularies are known to match
    options: PairOptions

    @property
    def target_key(self) -> tuple:
        """What a loaded target is kept under: its file and its load options."""
        return (self.target.identity, self.options.target)

    @property
    def draft_key(self) -> tuple | None:
        return None if self.draft is None else (self.draft.identity, self.options.draft)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

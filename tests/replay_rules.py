"""Fixed rules the replay tests hand to the replays (benchmarks/replay) where the best fixed rule's
mapping of kind to depth goes."""

from __future__ import annotations


class Always(dict):
    """A fixed rule that drafts every kind of proposal this deep."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth

    def get(self, kind, default=None):  # noqa: ANN001, ANN201 (the replay's mapping lookup)
        return self.depth

"""The n-gram drafter's ceiling on a recorded answer: at each position, how many of the answer's
next tokens localspec's context lookup proposes right in a row (with first-token alternatives: a
tree of candidates whose right branch is known in advance), and the least target time any planner
of that drafter could take (every step drafts only tokens the lookup gets right, all accepted,
n-gram drafts free, costs from a cost curve): the bound the replays and the head-to-head
benchmark measure planners against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from localspec.decoding.lookup import ContextLookup

NGRAM_HORIZON = 31  # longest n-gram draft the ceiling considers (decodes of up to 32 tokens)


def first_token_alternatives(lookup: ContextLookup, exclude: int | None, limit: int,
                             horizon: int) -> list[tuple[int, ...]]:
    """Other continuations the context offers (what a tree of candidates would add to the
    lookup's proposal): walking from the longest earlier-occurring suffix to shorter ones (suffix
    links), each token that followed an earlier occurrence and is not `exclude` or found already,
    with what followed its first occurrence; at most `limit`."""
    sam, seen = lookup.sam, {exclude}
    out: list[tuple[int, ...]] = []
    state = sam.link[sam.last] if sam.last else -1
    while state > 0 and len(out) < limit:
        for token, child in sam.next[state].items():
            if token not in seen and len(out) < limit:
                seen.add(token)
                start = sam.first_end[child]
                out.append(tuple(lookup.tokens[start: start + horizon]))
        state = sam.link[state]
    return out


def matched_run(proposed: Sequence[int], actual: Sequence[int]) -> int:
    """How many proposed tokens equal the actual ones, in a row from the first."""
    run = 0
    for p, a in zip(proposed, actual, strict=False):  # the shorter decides
        if p != a:
            break
        run += 1
    return run


def ngram_runs(prompt: Sequence[int], output: Sequence[int], horizon: int = NGRAM_HORIZON,
               alternatives: int = 0) -> list[int]:
    """For each output position i: how many of output[i], output[i+1], ... localspec's context
    lookup proposes correctly in a row from the context prompt + output[:i]; with `alternatives`
    > 0, the best of its proposal and that many first-token alternatives (a tree of candidates
    whose right branch is known in advance)."""
    lookup = ContextLookup()
    context = list(prompt)
    runs = []
    for i, token in enumerate(output):
        proposal = lookup.propose(context, horizon)
        candidates = [proposal.tokens] if proposal else []
        if alternatives:
            first = proposal.tokens[0] if proposal else None
            candidates += first_token_alternatives(lookup, first, alternatives, horizon)
        runs.append(max((matched_run(c, output[i:]) for c in candidates), default=0))
        context.append(token)
    return runs


def oracle_seconds(runs: Sequence[int], cost: Callable[[int], float], max_depth: int) -> float:
    """Least target time that produces the output when every step drafts j <= min(run, max_depth)
    tokens the lookup got right and all of them are accepted (j + 1 tokens for c(j + 1); n-gram
    drafts cost nothing): an upper bound on the speed of any planner with this drafter."""
    n = len(runs)
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = min(cost(j + 1) + best[min(n, i + j + 1)] for j in range(min(runs[i], max_depth) + 1))
    return best[0]


def ngram_ceiling(prompt: Sequence[int], output: Sequence[int], cost: Callable[[int], float],
                  alternatives: int = 0) -> float:
    """The n-gram drafter's decode ceiling on `output`: the target alone's time for it over
    oracle_seconds of the lookup's runs (with `alternatives`: of a tree, see ngram_runs)."""
    runs = ngram_runs(prompt, output, alternatives=alternatives)
    return len(output) * cost(1) / oracle_seconds(runs, cost, NGRAM_HORIZON)


"""Structured output, compiled and checked: a :class:`~localspec.settings.constraints.Constraint` (what the
caller asked for: a JSON schema, any JSON object, a regular expression, a Lark or GBNF grammar)
turned into an llguidance grammar and validated *before any decoding*.

:func:`compile_constraint` compiles it: a bad schema, grammar or regex is a
:class:`~localspec.errors.ConfigError` naming the setting (``param``) and, for a JSON schema,
where in the schema the problem is (a JSON pointer such as
``/properties/address/patternProperties``: :mod:`localspec.decoding.grammar.schema_errors`). It also
follows the grammar's start (:func:`start_problem`: first mask, forced tokens, a path of
:data:`START_TOKENS` tokens and a few other tokens at each of its steps, within llguidance's
limits) over a vocabulary of bytes, and :class:`~localspec.decoding.grammar.follower.GrammarFollower`
again over the model's (once per model and grammar) when a generation is set up: a grammar no
output matches, or one that exceeds llguidance's limits, is a ConfigError before the first token
too.

A constrained generation then uses, in this order: the model's tokenizer
(:mod:`localspec.decoding.grammar.tokenizer`, built once per model, possibly while the weights load),
and a :class:`~localspec.decoding.grammar.follower.GrammarFollower` that follows the committed tokens
and gives token bitmasks (:mod:`localspec.decoding.grammar.masks`).

JSON layout. The structure of JSON output is forced, not sampled: no optional whitespace, ``", "``
between items and ``": "`` between a key and its value, on one line — the layout of Python's
``json.dumps(value)`` (the layout models see most). Properties come in the schema's order;
strings use JSON's escapes. So everything between values (braces, keys of required properties,
separators) is forced and costs no sampling; the options (:data:`~localspec.settings.constraints.JSON_LAYOUT`)
override any ``x-guidance`` options in the caller's schema, and keywords llguidance cannot enforce
are errors, never silently ignored.
"""

from __future__ import annotations

import functools
import logging
import re

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from localspec.decoding.grammar.masks import allowed_tokens, mask_words
from localspec.decoding.grammar.schema_errors import first_line, regex_problem, schema_problem
from localspec.errors import ConfigError
from localspec.settings.constraints import JSON_LAYOUT, Constraint

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- compile and validate

NO_TOKENIZER_WARNING = "no tokenizer - can't validate"  # llguidance's, for a grammar naming special tokens

@functools.lru_cache(maxsize=64)
def compile_constraint(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint, validated without the model (call it when the
    request or the settings arrive): compiled, and its start followed (:func:`start_problem`)
    over a vocabulary of single bytes, unless it names special tokens (a model's vocabulary is
    needed for those: :class:`GrammarFollower` follows every grammar's start with it). A bad
    schema, grammar or regex, or one llguidance cannot follow, raises ConfigError with ``param``
    = ``constraint.param``; warnings are logged."""
    grammar = _to_grammar(constraint)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConfigError(_error_message(constraint, messages[0] if messages else "unknown error"),
                          constraint.param)
    for message in messages:
        if not message.startswith(NO_TOKENIZER_WARNING):  # special tokens are checked once the tokenizer is there
            log.warning("%s: %s", constraint.describe(), message)
    if not any(m.startswith(NO_TOKENIZER_WARNING) for m in messages):
        tokenizer = byte_tokenizer()
        problem = start_problem(llguidance.LLMatcher(tokenizer, grammar, log_level=0), tokenizer)
        if problem is not None:
            raise ConfigError(f"{constraint.describe()} cannot be enforced: {problem}", constraint.param)
    return grammar


# ---------------------------------------------------------------- can llguidance follow it?

START_TOKENS = 16  # how many tokens of a grammar's start are followed before any decoding
START_BRANCHES = 4  # tokens tried at each step of that path: the one it follows and others, a few tokens deep
BRANCH_TOKENS = 2  # how deep the others are followed



def start_problem(matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer) -> str | None:
    """Why llguidance cannot follow the grammar of `matcher` (None: it can), found by following
    its start as a generation would, each step within llguidance's limits: the first mask, the
    forced tokens, and a path of up to START_TOKENS tokens (each the token the grammar forces
    or, else, the first its mask allows other than an end token), trying at each step up to
    START_BRANCHES - 1 other allowed tokens (spread over the allowed ones) BRANCH_TOKENS deep.
    Catches what would otherwise fail in the first steps of a generation: a grammar no output
    matches (a regex with an empty language, a schema that is only a reference to itself), a
    rule that can never end, a repetition too large for the lexer. `matcher` is a new one (or a
    copy): it is left where the walk ends."""
    row = np.zeros(mask_words(tokenizer.vocab_size), dtype=np.uint32)
    ends = np.array(tokenizer.eos_tokens, dtype=np.int64)
    for step in range(START_TOKENS + 1):
        problem, tokens = _step(matcher, row, ends, tokenizer.vocab_size, step)
        if problem is not None or not tokens or step == START_TOKENS:  # only an end may come, or far enough
            return problem
        for other in tokens[1:]:
            problem = _branch(matcher.deep_copy(), other, row, ends, tokenizer.vocab_size, step + 1)
            if problem is not None:
                return problem
        matcher.consume_token(tokens[0])  # a failure shows in the next step
    return None


def _branch(matcher: llguidance.LLMatcher, token: int, row: np.ndarray, ends: np.ndarray, n_vocab: int,
            step: int) -> str | None:
    """The problem, if any, of following `token`, then what comes first after it, BRANCH_TOKENS deep."""
    for depth in range(BRANCH_TOKENS):
        matcher.consume_token(token)
        problem, tokens = _step(matcher, row, ends, n_vocab, step + depth)
        if problem is not None or not tokens:
            return problem
        token = tokens[0]
    return None


def _step(matcher: llguidance.LLMatcher, row: np.ndarray, ends: np.ndarray, n_vocab: int,
          step: int) -> tuple[str | None, list[int]]:
    """One step of a start followed: (the problem, if llguidance failed, after `step` tokens;
    the tokens to try next: the one forced, or up to START_BRANCHES the mask allows, end tokens aside)."""
    forced: list[int] = []
    if not matcher.is_error():
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    if not matcher.is_error():
        forced = matcher.compute_ff_tokens()
    if matcher.is_error():
        return _follow_problem(matcher.get_error(), step), []
    if forced:
        return None, [int(forced[0])]
    ok = allowed_tokens(row, n_vocab)
    ok[ends[ends < n_vocab]] = False
    allowed = np.flatnonzero(ok)
    if not len(allowed):
        return None, []
    picks = np.unique(np.arange(START_BRANCHES) * len(allowed) // START_BRANCHES)
    return None, [int(allowed[i]) for i in picks]


def _follow_problem(error: str, step: int) -> str:
    """A user-facing reason for llguidance's error after `step` tokens of a grammar's start."""
    text = first_line(error)
    if step == 0 and text.startswith("NoExtension"):
        return "no output can match it (nothing may come first: its language is empty)"
    after = f" after {step} token{'s' * (step != 1)} of its start" if step else ""
    if "Too many items" in text:
        return (f"it exceeds llguidance's parser limits{after} ({text}): a rule that can never end, such as a "
                "property required at every level of a schema that refers to itself, or a very ambiguous grammar")
    if m := re.search(r"Current row has (\d+) items; max is (\d+)", text):
        return (f"it exceeds llguidance's parser limits{after}: {m.group(1)} alternatives at one point, at most "
                f"{m.group(2)} are followed (thousands of optional properties, or an anyOf or enum of thousands of "
                "objects); split it, or make more properties required")
    if "lexer" in text or "too many expressions" in text:
        return (f"it exceeds llguidance's lexer limits{after} ({text}): a repetition or regex too large to "
                "follow, such as a{1000000}")
    if text.startswith("NoExtension"):
        return f"no output can match it: it allows no continuation{after}"
    return f"llguidance cannot follow it{after}: {text}"


_BYTE_END = b"\xff<|end|>"  # the end token of the byte vocabulary (llguidance's special-token prefix)


class _Bytes:
    """A vocabulary of the 256 single bytes and an end token, as llguidance's TokenizerWrapper reads it."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [_BYTE_END]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


@functools.lru_cache(maxsize=1)
def byte_tokenizer() -> llguidance.LLTokenizer:
    """A tokenizer of single bytes, which spells any text: to follow a grammar's start before
    any model is loaded."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def _to_grammar(c: Constraint) -> str:
    """An llguidance grammar (JSON text) for a constraint; not yet validated."""
    if c.kind in ("json_schema", "json_object"):
        schema = c.schema()
        if schema is False:
            raise ConfigError(f"{c.describe()} is false: no output can match it", c.param)
        try:  # llguidance applies its options to an object: the schema true is {} (any JSON value)
            return llguidance.LLMatcher.grammar_from_json_schema({} if schema is True else schema,
                                                                 overrides=JSON_LAYOUT)
        except ValueError as exc:
            raise ConfigError(f"{c.describe()} cannot be used: {exc}", c.param) from None
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.source)
    if c.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(c.source)
    try:
        lark = any_to_lark(c.source)
    except RecursionError:  # the translator is recursive: parentheses nested about 1000 deep
        raise ConfigError(f"{c.describe()} nests too deeply (parentheses within parentheses); flatten it into "
                          "rules", c.param) from None
    except Exception as exc:  # GbnfToLarkError, and plain Exception for a missing or duplicate rule
        raise ConfigError(f"{c.describe()} is not valid GBNF: {first_line(str(exc))}", c.param) from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _error_message(c: Constraint, message: str) -> str:
    """A user-facing message for llguidance's error about constraint `c`."""
    if c.kind in ("json_schema", "json_object"):
        return f"{c.describe()} cannot be enforced: {schema_problem(c.schema(), message)}"
    if c.kind == "regex":
        return f"{c.describe()} {c.source!r} is invalid: {regex_problem(message)}"
    if c.kind == "gbnf":  # llguidance compiled its Lark translation: its lines and columns are not the caller's
        return f"{c.describe()} is invalid: {first_line(message)} (in its Lark translation)"
    return f"{c.describe()} is invalid: {message.strip()}"

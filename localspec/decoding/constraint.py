"""Structured output: grammars that constrain what a generation may say, through llguidance.

Three parts, used in this order by a constrained generation:

* :class:`Constraint` — what the caller asked for, one type for every spelling: a JSON schema,
  any JSON object, a regular expression, a Lark grammar or a GBNF grammar (llama-server's
  ``grammar``). Made from OpenAI's ``response_format`` (:meth:`Constraint.from_response_format`),
  from grammar text (:meth:`Constraint.grammar`) or a file (:func:`grammar_from_file`).
  :func:`compile_constraint` turns it into an llguidance grammar and validates it *before any
  decoding*: a bad schema, grammar or regex is a :class:`~localspec.errors.ConfigError` naming
  the setting (``param``) and, for a JSON schema, where in the schema the problem is (a JSON
  pointer such as ``/properties/address/patternProperties``). It also follows the grammar's
  start (:func:`start_problem`: first mask, forced tokens, a path of :data:`START_TOKENS`
  tokens and a few other tokens at each of its steps, within llguidance's limits) over a
  vocabulary of bytes, and :class:`GrammarFollower` again over the model's (once per model and
  grammar) when a generation is set up: a grammar no output matches, or one that exceeds
  llguidance's limits, is a ConfigError before the first token too.
* The tokenizer — llguidance's view of the model's own vocabulary (:func:`tokenizer_for`, cached
  per model). Building it reads every token of the vocabulary (~0.9 s for a 152k vocabulary on
  a 2-core CPU, holding the GIL), in a thread (:func:`start_tokenizer`); a caller that knows of a
  constraint before the model loads builds it from the file's vocabulary while the weights load
  (:func:`prestart_tokenizer`). A constrained generation waits for it when it is set up: the
  grammar's start is checked over this vocabulary before the prefill.
* :class:`GrammarFollower` — a matcher that follows a model's committed tokens as a follower of
  its :class:`~localspec.llama.sequence.KVSequence` (``reset`` / ``commit`` / ``rollback``) and
  answers what may come next: a token bitmask (:meth:`GrammarFollower.mask`), the tokens the
  grammar forces (:meth:`GrammarFollower.forced`), whether the answer may end here
  (:meth:`GrammarFollower.accepts_end`), and masks along a draft path without committing it
  (:meth:`GrammarFollower.masks_along`).

JSON layout. The structure of JSON output is forced, not sampled: no optional whitespace, ``", "``
between items and ``": "`` between a key and its value, on one line — the layout of Python's
``json.dumps(value)`` (the layout models see most). Properties come in the schema's order;
strings use JSON's escapes. So everything between values (braces, keys of required properties,
separators) is forced and costs no sampling; the options (:data:`JSON_LAYOUT`) override any
``x-guidance`` options in the caller's schema, and keywords llguidance cannot enforce are
errors, never silently ignored.

Token bitmasks are rows of uint32 words: bit ``t % 32`` of word ``t // 32`` set means token ``t``
is allowed; a row has :func:`mask_words` ``(n_vocab)`` words for the model's ``n_vocab`` (the
width of its logits); bits past ``n_vocab`` are always clear.

Masks follow llguidance's canonical tokenization: where text is forced, only the tokens
llguidance would spell it with are allowed, and a byte token that spells the same text as
another token is refused, although the matcher would consume either. So validity is decided by
the mask (:meth:`GrammarFollower.masks_along`), never by what the matcher would consume.

llguidance's matcher never raises: a forbidden token puts it in an error state whose mask allows
only the end tokens. A follower checks for that state after every consume and rollback and
raises :class:`~localspec.errors.ConstraintError` — an error, never a finished answer, and
localspec's own (the caller's grammar was checked before decoding): its message says so.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import json
import logging
import os
import re
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

import llama_cpp as lc
import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from localspec.constraints import JSON_LAYOUT, Constraint, grammar_from_file
from localspec.errors import ConfigError, ConstraintError, ModelError
from localspec.llama.model import Model

log = logging.getLogger(__name__)

__all__ = ["Constraint", "GrammarFollower", "compile_constraint", "grammar_from_file", "start_tokenizer",
           "tokenizer_for"]  # Constraint and grammar_from_file live in localspec.config (settings), re-exported

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
MAX_CHECKED = 1024  # grammars remembered per model as followed (GrammarFollower): then forgotten, all at once


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
    picks = np.unique(np.arange(START_BRANCHES) * len(allowed) // START_BRANCHES) if len(allowed) else []
    return None, [int(allowed[i]) for i in picks]


def _follow_problem(error: str, step: int) -> str:
    """A user-facing reason for llguidance's error after `step` tokens of a grammar's start."""
    text = _first_line(error)
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
    from llguidance._tokenizer import TokenizerWrapper

    return llguidance.LLTokenizer(TokenizerWrapper(_Bytes()))


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
        raise ConfigError(f"{c.describe()} is not valid GBNF: {_first_line(str(exc))}", c.param) from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _error_message(c: Constraint, message: str) -> str:
    """A user-facing message for llguidance's error about constraint `c`."""
    if c.kind in ("json_schema", "json_object"):
        return f"{c.describe()} cannot be enforced: {_schema_problem(c.schema(), message)}"
    if c.kind == "regex":
        return f"{c.describe()} {c.source!r} is invalid: {_regex_problem(message)}"
    if c.kind == "gbnf":  # llguidance compiled its Lark translation: its lines and columns are not the caller's
        return f"{c.describe()} is invalid: {_first_line(message)} (in its Lark translation)"
    return f"{c.describe()} is invalid: {message.strip()}"


def _regex_problem(message: str) -> str:
    """llguidance wraps a regex into a one-line Lark grammar; its errors quote that wrapper:
    keep the regex parser's own explanation."""
    found = re.search(r"regex parse error:(.*?)(?:\n\s+\d+ \| |\Z)", message, re.S)
    if not found:
        return _first_line(message)
    lines = [line for line in found.group(1).splitlines() if line.strip()]
    errors = [line.strip().removeprefix("error:").strip() for line in lines if line.strip().startswith("error:")]
    return "; ".join(errors) or _first_line(message)


# ---------------------------------------------------------------- where in a schema

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_KEYWORD = re.compile(r"\b(min\w*|max\w*|exclusive\w*|multipleOf|required|enum|const|pattern|format|"
                      r"uniqueItems|contains|additionalProperties|items|prefixItems)\b")


def pointer_token(key: str) -> str:
    """One JSON pointer reference token (RFC 6901: ~ → ~0, / → ~1)."""
    return key.replace("~", "~0").replace("/", "~1")


def walk_schema(schema: Any, pointer: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every subschema (as an object) of a JSON schema with its JSON pointer, the root first;
    property *names* are never taken for keywords."""
    if not isinstance(schema, Mapping):
        return
    yield pointer, schema
    for key in _SCHEMA_MAPS:
        children = schema.get(key)
        if isinstance(children, Mapping):
            for name, child in children.items():
                yield from walk_schema(child, f"{pointer}/{key}/{pointer_token(str(name))}")
    for key in _SCHEMA_LISTS + _SCHEMA_ONE:
        child = schema.get(key)
        if isinstance(child, list):
            for i, item in enumerate(child):
                yield from walk_schema(item, f"{pointer}/{key}/{i}")
        else:
            yield from walk_schema(child, f"{pointer}/{key}")


def _schema_problem(schema: Any, message: str, root: Any = None, at: str = "") -> str:
    """llguidance's message about a schema, with where in the schema the problem is when it can
    be found (llguidance names keywords and values, never their place). `schema` is the
    subschema at JSON pointer `at` of `root` (the whole schema, whose $defs it may use)."""
    root = schema if root is None else root
    text = _first_line(message)
    if m := re.match(r"Unimplemented keys: (\[.*\])", text):
        try:
            keys = [str(k) for k in json.loads(m.group(1))]
        except json.JSONDecodeError:
            keys = []
        places = [_keyword_place(schema, key) for key in keys]
        found = [f'"{key}" at {at}{place}' for key, place in zip(keys, places) if place is not None]
        missing = [f'"{key}"' for key, place in zip(keys, places) if place is None]
        word, them = ("keyword", "it") if len(keys) == 1 else ("keywords", "them")
        return f"unsupported {word} {', '.join(found + missing)} (llguidance cannot enforce {them}; remove or rewrite {them})"
    if m := re.search(r"required property '(.*)' is unsatisfiable", text):
        deeper = _required_problem(schema, m.group(1), root, at)
        if deeper is not None:
            return deeper
    if "regex parse error" in message:
        text = f"invalid regex ({_regex_problem(message)})"
    place = _problem_place(schema, text, message)
    return f"{text} at {at}{place}" if place is not None else text


def _required_problem(schema: Any, name: str, root: Any, at: str) -> str | None:
    """Why a required property cannot be satisfied, found by compiling its own schema (with the
    root's definitions, which it may refer to): llguidance says only *that* it cannot."""
    for p, sub in walk_schema(schema):
        props = sub.get("properties")
        if not (isinstance(sub.get("required"), list) and name in sub["required"] and isinstance(props, Mapping)
                and name in props):
            continue
        child, child_at = props[name], f"{at}{p}/properties/{pointer_token(name)}"
        if not isinstance(child, Mapping):
            return None
        alone = dict(child)
        for defs in ("$defs", "definitions"):
            if isinstance(root, Mapping) and defs in root and defs not in alone:
                alone[defs] = root[defs]
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(alone, overrides=JSON_LAYOUT)
        except ValueError:
            return None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if not is_error or not messages:
            return None
        return _schema_problem(child, messages[0], root, child_at)
    return None


def _keyword_place(schema: Any, keyword: str) -> str | None:
    """The first place a keyword is used, outside $defs/definitions first (llguidance reports
    the keywords of schemas it compiles, i.e. those in use)."""
    places = [f"{p}/{pointer_token(keyword)}" for p, sub in walk_schema(schema) if keyword in sub]
    used = [p for p in places if not re.match(r"/(\$defs|definitions)/", p)]
    return (used or places or [None])[0]


def _problem_place(schema: Any, text: str, message: str) -> str | None:
    """A JSON pointer for one of llguidance's messages about a schema, or None."""
    subs = list(walk_schema(schema))
    if m := re.match(r"Unknown format: (.*)", text):
        return next((f"{p}/format" for p, s in subs if s.get("format") == m.group(1).strip()), None)
    if m := re.match(r"Invalid type: (.*)", text):
        name = m.group(1).strip()
        return next((f"{p}/type" for p, s in subs
                     if s.get("type") == name or (isinstance(s.get("type"), list) and name in s["type"])), None)
    if m := re.match(r"Pointer '(.*)' does not exist", text):
        ref = "#" + m.group(1)
        return next((f"{p}/$ref" for p, s in subs if s.get("$ref") in (ref, m.group(1))), None)
    if text.startswith("invalid regex"):
        return _bad_pattern_place(subs)
    if m := re.search(r"required property '(.*)' is unsatisfiable", text):
        return next((f"{p}/required" for p, s in subs
                     if isinstance(s.get("required"), list) and m.group(1) in s["required"]), None)
    keywords = set(_KEYWORD.findall(text))
    values = dict(re.findall(r"\b(\w+) \(([^)]*)\)", text))
    if keywords:
        return next((p for p, s in subs if keywords <= s.keys()
                     and all(json.dumps(s[k]) == v or str(s[k]) == v for k, v in values.items() if k in s)), None)
    return None


def _bad_pattern_place(subs: list[tuple[str, Mapping[str, Any]]]) -> str | None:
    """The first ``pattern`` (or ``patternProperties`` key) that is not a valid regex."""
    def invalid(regex: Any) -> bool:
        if not isinstance(regex, str):
            return False
        grammar = llguidance.LLMatcher.grammar_from_regex(regex)
        return llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]

    for p, s in subs:
        if invalid(s.get("pattern")):
            return f"{p}/pattern"
        props = s.get("patternProperties")
        if isinstance(props, Mapping):
            for key in props:
                if invalid(key):
                    return f"{p}/patternProperties/{pointer_token(str(key))}"
    return None


# ---------------------------------------------------------------- the tokenizer

class VocabModel(Protocol):
    """What building a tokenizer needs of a model (localspec.llama.model.Model has it)."""

    n_vocab: int

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
    tokenize = ctypes.cast(lc.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    tokenizer = llguidance.LLTokenizer.from_llamacpp(tokens=pieces, vocab_ptr=vocab, tokenize_fptr=tokenize,
                                                     eos_token=ends)
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


_TOKENIZERS: "weakref.WeakKeyDictionary[Any, TokenizerFuture]" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


_PRESTARTED: dict[str, TokenizerFuture] = {}  # by GGUF file (its resolved path): built before the model loads


def prestart_tokenizer(path: str | os.PathLike) -> None:
    """Start building the tokenizer of the GGUF file at `path` from its vocabulary alone, in a
    background thread, so that it overlaps with loading the file's weights: for a constrained
    generation known before the load. start_tokenizer of a model loaded from that file takes it."""
    key = str(Path(path).expanduser().resolve())
    with _TOKENIZERS_LOCK:
        future = _PRESTARTED.get(key)
        if future is None or future.failed():
            _PRESTARTED[key] = TokenizerFuture(path=Path(key))


def start_tokenizer(model: VocabModel) -> TokenizerFuture:
    """Start building the model's tokenizer in a background thread, once per model (a later
    call returns the same future; one prestart_tokenizer started for its file is taken)."""
    model.vocab_pointer  # a closed model: ModelError now, not a crash in the thread
    path = getattr(model, "path", None)
    with _TOKENIZERS_LOCK:
        future = _TOKENIZERS.get(model)
        if future is None or future.failed():
            early = _PRESTARTED.pop(str(Path(path).resolve()), None) if path is not None else None
            future = early if early is not None and not early.failed() else TokenizerFuture(model)
            _TOKENIZERS[model] = future
        return future


def tokenizer_for(model: VocabModel) -> llguidance.LLTokenizer:
    """The model's llguidance tokenizer, built once per model (waits for one being built)."""
    model.vocab_pointer  # refuse a closed model: the tokenizer points into its vocabulary
    return start_tokenizer(model).result()


# ---------------------------------------------------------------- token bitmasks

def mask_words(n_vocab: int) -> int:
    """uint32 words in one mask row for a vocabulary of n_vocab tokens."""
    return (n_vocab + 31) // 32


def allocate_masks(rows: int, n_vocab: int) -> np.ndarray:
    """A (rows, words) uint32 array of mask rows, every token forbidden."""
    return np.zeros((rows, mask_words(n_vocab)), dtype=np.uint32)


def allowed_tokens(row: np.ndarray, n_vocab: int) -> np.ndarray:
    """A mask row as booleans, one per token (length n_vocab)."""
    bits = (row.astype(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.astype(bool).reshape(-1)[:n_vocab]


def is_allowed(row: np.ndarray, token: int) -> bool:
    """Whether a mask row allows `token`."""
    return 0 <= token < 32 * len(row) and bool((int(row[token >> 5]) >> (token & 31)) & 1)


# ---------------------------------------------------------------- the matcher as a follower


class GrammarFollower:
    """A grammar matcher that follows a sequence's committed tokens (a
    :class:`~localspec.llama.sequence.Follower`): the grammar starts after the prompt
    (``reset``), consumes what is committed, withdraws what is rolled back; between those it
    says which tokens may come next. Any disagreement raises ConstraintError."""

    def __init__(self, constraint: Constraint | str, tokenizer: llguidance.LLTokenizer, n_vocab: int,
                 checked: set[bytes] | None = None) -> None:
        """`constraint`: a Constraint (compiled and validated here) or an llguidance grammar
        from :func:`compile_constraint`; `n_vocab`: the width of the model's logits. The
        grammar's start is followed over this vocabulary (:func:`start_problem`: ConfigError
        naming the constraint's setting) unless `checked`, the digests of grammars already
        followed with this tokenizer, holds it (then it is added there)."""
        self.constraint = constraint if isinstance(constraint, Constraint) else None
        grammar = compile_constraint(constraint) if isinstance(constraint, Constraint) else constraint
        self.n_vocab = n_vocab
        self.words = mask_words(n_vocab)
        self._tokenizer_words = mask_words(tokenizer.vocab_size)
        self._scratch = np.zeros(self._tokenizer_words, dtype=np.uint32)
        self._row = np.zeros(self.words, dtype=np.uint32)
        self._tail = np.uint32((1 << (n_vocab % 32)) - 1) if n_vocab % 32 else None
        self.end_tokens = list(tokenizer.eos_tokens)
        self._tokenizer = tokenizer
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self.n_consumed = 0  # tokens consumed since the prompt
        self.seconds = 0.0  # spent following committed tokens and computing forced tokens
        self._draft: list[int] = []  # draft tokens consumed past the committed ones (mask_after)
        digest = hashlib.sha256(grammar.encode("utf-8")).digest()
        if checked is None or digest not in checked:
            problem = start_problem(self._matcher.deep_copy(), tokenizer)  # this vocabulary: before any decoding
            if problem is not None:
                raise ConfigError(f"{self._describe()} cannot be used with this model's vocabulary: {problem}",
                                  self.constraint.param if self.constraint else None)
            if checked is not None:
                if len(checked) >= MAX_CHECKED:
                    checked.clear()
                checked.add(digest)

    @classmethod
    def for_model(cls, constraint: Constraint | str, model: VocabModel) -> "GrammarFollower":
        """A follower for a model's logits, with the model's (cached) tokenizer; a grammar's
        start is followed once per model."""
        model.vocab_pointer  # refuse a closed model: the tokenizer points into its vocabulary
        future = start_tokenizer(model)
        return cls(constraint, future.result(), model.n_vocab, future.checked)

    # ------------------------------------------------------------ the follower protocol

    def reset(self, tokens: Sequence[int]) -> None:
        """A new context: `tokens` is the prompt; the grammar starts after it."""
        self._matcher.reset()
        self.n_consumed = 0
        self._draft.clear()
        self._check("a reset")

    def commit(self, tokens: Sequence[int]) -> None:
        """Consume committed tokens; one the grammar forbids raises ConstraintError."""
        t0 = time.perf_counter()
        self.end_draft()
        for token in tokens:
            self._matcher.consume_token(int(token))
            self._check(f"token {int(token)} ({self._token_repr(int(token))})")
            self.n_consumed += 1
        self.seconds += time.perf_counter() - t0

    def rollback(self, n: int) -> None:
        """Withdraw the last `n` consumed tokens (never past the prompt)."""
        self.end_draft()
        if n <= 0:
            return
        if n > self.n_consumed:
            raise ConstraintError(f"cannot roll the grammar back by {n} tokens: only {self.n_consumed} were "
                                  "generated since the prompt")
        ok = self._matcher.rollback(n)
        self._check(f"a rollback of {n} tokens")
        if not ok:
            raise ConstraintError(f"llguidance could not roll back {n} tokens")
        self.n_consumed -= n

    # ------------------------------------------------------------ what may come next

    def mask(self, out_row: np.ndarray) -> np.ndarray:
        """Fill `out_row` (uint32, shape (words,)) with the tokens allowed next (after the committed
        tokens, or after the draft :meth:`mask_after` moved to); returns it."""
        if out_row.dtype not in (np.uint32, np.int32) or out_row.shape != (self.words,) \
                or not out_row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"a mask row is a contiguous uint32 array of shape ({self.words},), not "
                             f"{out_row.dtype} {out_row.shape}")
        if self._tokenizer_words == self.words:
            self._matcher.unsafe_compute_mask_ptr(out_row.ctypes.data, out_row.nbytes)
        else:  # the tokenizer's vocabulary is narrower or wider than the logits: pad with zeros or cut
            self._matcher.unsafe_compute_mask_ptr(self._scratch.ctypes.data, self._scratch.nbytes)
            n = min(self.words, self._tokenizer_words)
            out_row[:n] = self._scratch[:n]
            out_row[n:] = 0
        if self._tail is not None:
            out_row.view(np.uint32)[-1] &= self._tail
        self._check("computing a mask")
        return out_row

    def allows(self, token: int) -> bool:
        """Whether `token` may come next."""
        return is_allowed(self.mask(self._row), token)

    def forced(self) -> list[int]:
        """The tokens the grammar forces now (llguidance's fast-forward tokens): whatever is
        sampled, these come next; empty when there is a choice."""
        self.end_draft()
        tokens = self._matcher.compute_ff_tokens()
        self._check("computing forced tokens")
        return [int(t) for t in tokens]

    def accepts_end(self) -> bool:
        """Whether an end token may come now: the output so far is a complete answer."""
        self.end_draft()
        return bool(self._matcher.is_accepting())

    def must_end(self) -> bool:
        """Whether the grammar is complete and only an end token may follow (also true once an
        end token has been consumed)."""
        self.end_draft()
        return bool(self._matcher.is_stopped())

    def masks_along(self, path: Sequence[int], out: np.ndarray) -> int:
        """Masks along a draft path without committing it: ``out[i]`` is the mask after
        ``path[:i]``. Stops at the first token its row forbids; returns how many tokens of the
        path are allowed (``k``: rows 0..k are filled; k == len(path) when all are)."""
        if out.ndim != 2 or out.shape[0] < len(path) + 1:
            raise ValueError(f"masks_along needs at least {len(path) + 1} rows, got shape {out.shape}")
        self.end_draft()
        consumed = 0
        try:
            for i, token in enumerate(path):
                if not is_allowed(self.mask(out[i]), int(token)):
                    return i
                if self._matcher.is_stopped():
                    continue  # an end token after an end token: the matcher takes no step (nothing to roll back)
                self._matcher.consume_token(int(token))
                self._check(f"draft token {int(token)} ({self._token_repr(int(token))})")
                consumed += 1
            self.mask(out[len(path)])
            return len(path)
        finally:
            if consumed:
                self._matcher.rollback(consumed)
                self._check(f"rolling back {consumed} draft tokens")

    def mask_after(self, path: Sequence[int], out_row: np.ndarray) -> np.ndarray:
        """Fill `out_row` with the mask after the draft `path` (not committed; each of its tokens
        allowed by the mask before it: the caller checks, see :meth:`masks_along`); returns it.
        The matcher stays at the end of `path` until the next call, which moves it along the
        shared prefix only (a chain drafted level by level costs one consume per token), or
        until :meth:`end_draft`, which every other method calls first."""
        shared = 0  # path's tokens past an end token are never consumed: _draft may be shorter than a path
        limit = min(len(self._draft), len(path))
        while shared < limit and self._draft[shared] == path[shared]:
            shared += 1
        if len(self._draft) > shared:
            self._withdraw_draft(len(self._draft) - shared)
        for token in path[shared:]:
            if self._matcher.is_stopped():
                break  # past an end token only end tokens follow, and consuming them is no step to roll back
            self._matcher.consume_token(int(token))
            self._draft.append(int(token))
            self._check(f"draft token {int(token)} ({self._token_repr(int(token))})")
        return self.mask(out_row)

    def end_draft(self) -> None:
        """Withdraw the draft tokens :meth:`mask_after` consumed: back at the committed tokens."""
        if self._draft:
            self._withdraw_draft(len(self._draft))

    def _withdraw_draft(self, n: int) -> None:
        ok = self._matcher.rollback(n)
        del self._draft[len(self._draft) - n:]
        self._check(f"rolling back {n} draft tokens")
        if not ok:
            raise ConstraintError(f"llguidance could not roll back {n} draft tokens")

    # ------------------------------------------------------------ errors

    def _check(self, after: str) -> None:
        """ConstraintError when the matcher is in its error state: every grammar's start was
        followed before decoding (start_problem), so a failure here is localspec's own."""
        if self._matcher.is_error():
            detail = self._matcher.get_error()
            log.debug("grammar matcher error after %s: %s", after, detail)
            raise ConstraintError(f"internal error (a bug in localspec, please report it): the grammar matcher failed "
                                  f"after {after}, following {self._describe()}: {_first_line(detail)}")

    def _describe(self) -> str:
        return self.constraint.describe() if self.constraint else "the grammar"

    def _token_repr(self, token: int) -> str:
        if token in self.end_tokens:
            return "an end token"
        return self._tokenizer.dbg_tokens([token]) if 0 <= token < self._tokenizer.vocab_size else "out of range"

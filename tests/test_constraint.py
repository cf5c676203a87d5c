"""The constraint engine (localspec.settings.constraints; localspec.decoding.grammar: compiler, tokenizer,
masks, follower): specs, validation before decoding, the tokenizer from a GGUF vocabulary, and the
grammar matcher that follows a model's tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import llguidance
import numpy as np
import pytest

from localspec import errors
from localspec.settings import constraints
from localspec.settings.constraints import Constraint
from localspec.decoding.grammar import compiler as C
from localspec.decoding.grammar import masks as M, tokenizer as T
from localspec.decoding.grammar.follower import GrammarFollower
from localspec.errors import ConfigError, ConstraintError, ModelError
from localspec.llama.model import Model

import tiny_models as tiny
from masks import mask_logits

PROMPT = "def add(a, b): return a + b"
PERSON = {  # bounded: a greedy decode of a random model ends within a few dozen tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "high"]},
    },
    "required": ["name", "tags", "ok", "level"],
    "additionalProperties": False,
}
SPECS = {
    "json_object": Constraint.json_object(),
    "json_schema": Constraint.json_schema(PERSON, name="person"),
    "regex": Constraint.regex(r"(yes|no)[0-9]{1,3}"),
    "lark": Constraint.grammar('%llguidance {}\nstart: "def " NAME "():"\nNAME: /[a-z_]{1,8}/'),
    "gbnf": Constraint.grammar('root ::= "def " name "():"\nname ::= [a-z_] [a-z_]? [a-z_]? [a-z_]?'),
}


@pytest.fixture(scope="module")
def tok(tiny_target: Model) -> llguidance.LLTokenizer:
    return T.tokenizer_for(tiny_target)


def follower(c: Constraint, model: Model) -> GrammarFollower:
    f = GrammarFollower.for_model(c, model)
    f.reset(model.tokenize(PROMPT))
    return f


def allowed(f: GrammarFollower) -> np.ndarray:
    return M.allowed_tokens(f.mask(np.zeros(f.words, dtype=np.uint32)), f.n_vocab)


def text_of(model: Model, tokens: list[int]) -> str:
    return b"".join(model.token_bytes(t) for t in tokens).decode("utf-8")  # strict: valid UTF-8 or fail


# ---------------------------------------------------------------- the tokenizer

def test_tokenizer_from_the_models_vocabulary(tiny_target: Model, tok: llguidance.LLTokenizer) -> None:
    n = tiny_target.n_vocab
    ends = [t for t in range(n) if tiny_target.is_eog(t)]
    assert tok.vocab_size == n and sorted(tok.eos_tokens) == ends and len(ends) >= 2  # </s> and <|im_end|>
    for t in range(n):  # text tokens are the bytes the model outputs; the rest are special
        piece = tiny_target.token_bytes(t)
        if piece and not tok.is_special_token(t):
            assert tok.decode_bytes([t]) == piece, t
        else:
            assert tok.is_special_token(t) or t == 0, t  # <unk> renders as nothing: never text
    assert T.tokenizer_for(tiny_target) is tok  # once per model
    assert T.start_tokenizer(tiny_target).result() is tok


def test_tokenizer_in_the_background_and_closed_models(tiny_paths: tuple[Path, Path]) -> None:
    vocab = Model.vocabulary(tiny_paths[0])
    assert vocab.grammar_tokenizer is None
    future = T.start_tokenizer(vocab)
    assert T.start_tokenizer(vocab) is future and vocab.grammar_tokenizer is future  # kept on the model
    built = future.result(timeout=60)
    assert built.vocab_size == vocab.n_vocab and T.tokenizer_for(vocab) is built
    vocab.close()
    with pytest.raises(ModelError, match="closed"):
        T.tokenizer_for(vocab)  # its tokenizer points into the freed vocabulary: refused


def test_tokenizer_lives_on_its_model(tiny_paths: tuple[Path, Path]) -> None:
    """Threads that ask at once get one tokenizer (one build); it goes with its model (no module
    cache holds it); another model of the same file builds its own."""
    import gc
    import threading
    import weakref

    vocab = Model.vocabulary(tiny_paths[0])
    got: list[Any] = []
    barrier = threading.Barrier(8)

    def ask() -> None:
        barrier.wait()
        got.append(T.start_tokenizer(vocab))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(got) == 8 and all(future is got[0] for future in got) and vocab.grammar_tokenizer is got[0]
    got[0].result(timeout=60)
    again = Model.vocabulary(tiny_paths[0])
    try:
        assert T.start_tokenizer(again) is not got[0]
        again.grammar_tokenizer.result(timeout=60)
    finally:
        again.close()
    gone = weakref.ref(got[0])
    vocab.close()
    got.clear()
    vocab = None  # type: ignore[assignment]  # the last reference to the model
    gc.collect()
    assert gone() is None


def test_tokenizer_started_from_the_file_before_the_load(tiny_paths: tuple[Path, Path]) -> None:
    """prestart_tokenizer builds from the file's vocabulary alone; the model loaded from that file
    takes that tokenizer, and it masks as one built from the loaded model does."""
    early = T.prestart_tokenizer(tiny_paths[0])
    model = Model.vocabulary(tiny_paths[0])
    other = Model.vocabulary(tiny_paths[1])  # another file: not given the prestarted tokenizer
    try:
        T.adopt_tokenizer(model, early)
        assert T.start_tokenizer(model) is early and model.grammar_tokenizer is early
        early.result(timeout=60)
        assert early.vocabulary is not None and early.vocabulary is not model  # its own vocabulary, kept open
        assert T.start_tokenizer(other) is not early
        schema = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
        masks = []
        for tokenizer in (early.result(timeout=60), T.build_tokenizer(model)):
            follower = GrammarFollower(schema, tokenizer, model.n_vocab)
            follower.reset([1])
            masks.append((follower.mask(M.allocate_masks(1, model.n_vocab)[0]).copy(), follower.forced()))
        assert np.array_equal(masks[0][0], masks[1][0]) and masks[0][1] == masks[1][1] and masks[0][1]
    finally:
        model.close()
        other.close()


# ---------------------------------------------------------------- specs and validation

@pytest.mark.parametrize("kind", sorted(SPECS))
def test_every_kind_compiles_and_follows(kind: str, tiny_target: Model) -> None:
    c = SPECS[kind]
    assert c.kind == kind and isinstance(C.compile_constraint(c), str)
    f = follower(c, tiny_target)
    assert allowed(f).any() and not f.accepts_end() and f.n_consumed == 0


def test_response_format_shapes() -> None:
    assert Constraint.from_response_format(None) is None
    assert Constraint.from_response_format({"type": "text"}) is None
    assert Constraint.from_response_format({"type": "json_object"}) == Constraint.json_object()
    named = Constraint.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert named == Constraint.json_schema(PERSON, name="person") and named.param == "response_format"
    assert named.schema() == PERSON and list(named.schema()["properties"]) == list(PERSON["properties"])  # order kept
    assert Constraint.from_response_format({"type": "json_schema", "json_schema": {"name": "any"}}).kind == "json_object"
    server = Constraint.from_response_format({"type": "json_object", "schema": {"type": "array"}})  # llama-server
    assert server is not None and server.kind == "json_schema" and server.schema() == {"type": "array"}
    for bad in ("json", {"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": []},
                {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}},
                {"type": "json_schema", "json_schema": {"schema": [1]}}):
        with pytest.raises(ConfigError) as info:
            Constraint.from_response_format(bad)  # type: ignore[arg-type]
        assert info.value.param == "response_format"


def test_grammar_text_and_files(tmp_path: Path) -> None:
    assert Constraint.grammar('root ::= "a"').kind == "gbnf"
    assert Constraint.grammar('  %llguidance {}\nstart: "a"').kind == "lark"
    assert Constraint.grammar('start: "a"', lark=True).kind == "lark"
    (tmp_path / "g.lark").write_text('start: "a" | "b"\n')
    (tmp_path / "g.gbnf").write_text('root ::= "a" | "b"\n')
    (tmp_path / "g.txt").write_text('%llguidance {}\nstart: "a"\n')
    assert [constraints.grammar_from_file(tmp_path / n).kind for n in ("g.lark", "g.gbnf", "g.txt")] == ["lark", "gbnf", "lark"]
    for name in ("g.lark", "g.gbnf", "g.txt"):
        C.compile_constraint(constraints.grammar_from_file(tmp_path / name))
    (tmp_path / "bin.gbnf").write_bytes(b"root ::= \xff")
    for missing in (tmp_path / "nope.gbnf", tmp_path / "bin.gbnf", tmp_path):
        with pytest.raises(ConfigError) as info:
            constraints.grammar_from_file(missing)
        assert info.value.param == "grammar"


def nested(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` as a required property of a required property: its problems are two levels deep."""
    return {"type": "object", "required": ["address"], "properties": {"address": {
        "type": "object", "required": ["street"], "properties": {"street": schema}}}}


BAD = [  # (constraint, param, fragments of the message)
    (Constraint.json_schema({"type": "object", "properties": {"address": {
        "type": "object", "properties": {"if": {"type": "string"}}, "dependentRequired": {"a": ["b"]}}}}),
     "json_schema", ['unsupported keyword "dependentRequired" at /properties/address/dependentRequired']),
    (Constraint.json_schema({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}),
     "json_schema", ['"if" at /properties/a/if', '"then" at /properties/a/then', "unsupported keywords"]),
    (Constraint.json_schema(nested({"type": "string", "pattern": "[a-"})),
     "json_schema", ["invalid regex (unclosed character class)",
                     "/properties/address/properties/street/pattern"]),
    (Constraint.json_schema(nested({"type": "array", "minItems": 3, "maxItems": 1})),
     "json_schema", ["minItems (3) is greater than maxItems (1)", "at /properties/address/properties/street"]),
    (Constraint.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}),
     "json_schema", ["Invalid type: strin at /properties/a/type"]),
    (Constraint.json_schema({"properties": {"a": {"$ref": "#/$defs/nope"}}}),
     "json_schema", ["does not exist at /properties/a/$ref"]),
    (Constraint.json_schema({"type": "string", "format": "zipcode"}), "json_schema", ["Unknown format: zipcode at /format"]),
    (Constraint.json_schema(False), "json_schema", ["is false: no output can match it"]),
    (Constraint.json_schema({"type": "object", "properties": {"a": {"type": "array", "prefixItems": [
        {"type": "string", "pattern": "(?=x)"}]}}}, param="response_format"),
     "response_format", ["look-around", "at /properties/a/prefixItems/0/pattern"]),
    (Constraint.regex("[a-"), "regex", ["the regex '[a-' is invalid: unclosed character class"]),
    (Constraint.regex("a{3,2}"), "regex", ["invalid repetition count range"]),
    (Constraint.grammar("root ::= missing"), "grammar", ["not valid GBNF: Rule 'missing' not found"]),
    (Constraint.grammar('root ::= "a'), "grammar", ["not valid GBNF", "line 1"]),
    (Constraint.grammar("%llguidance {}\nstart: foo"), "grammar", ["Lark grammar is invalid", 'unknown name: "foo"']),
]


@pytest.mark.parametrize("constraint,param,fragments", BAD, ids=[f"{i}-{b[0].kind}" for i, b in enumerate(BAD)])
def test_bad_specs_are_config_errors_with_their_place(constraint: Constraint, param: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        C.compile_constraint(constraint)
    assert info.value.param == param
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert "Traceback" not in str(info.value) and "<state>" not in str(info.value)


def test_specs_that_are_not_even_parsed() -> None:
    for make, param in ((lambda: Constraint.json_schema("{not json"), "json_schema"),
                        (lambda: Constraint.json_schema([1, 2]), "json_schema"),  # type: ignore[arg-type]
                        (lambda: Constraint.regex(""), "regex"), (lambda: Constraint.grammar("  "), "grammar"),
                        (lambda: Constraint("yaml", "x"), None)):  # type: ignore[arg-type]
        with pytest.raises(ConfigError) as info:
            make()
        assert info.value.param == param


def test_errors_table() -> None:
    assert issubclass(ConstraintError, ModelError) and errors.exit_code(ConstraintError) == 1


# ---------------------------------------------------------------- masks, forced tokens, rollback

def reference(c: Constraint, tok: llguidance.LLTokenizer, prefix: list[int]) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(tok, C.compile_constraint(c), log_level=0)
    assert m.consume_tokens(prefix) and not m.is_error()
    return m


def consumable(ref: llguidance.LLMatcher, token: int) -> bool:
    copy = ref.deep_copy()
    return bool(copy.consume_token(token)) and not copy.is_error()


@pytest.mark.parametrize("kind", ["json_schema", "json_object", "regex", "gbnf"])
def test_masks_agree_with_consuming(kind: str, tiny_target: Model, tok: llguidance.LLTokenizer) -> None:
    c, f = SPECS[kind], follower(SPECS[kind], tiny_target)
    rng = np.random.default_rng(0)
    taken: list[int] = []
    for _ in range(8):  # a random walk through allowed tokens, checking every state on the way
        ok = allowed(f)
        ref = reference(c, tok, taken)
        forbidden = rng.choice(np.flatnonzero(~ok), size=min(60, int((~ok).sum())), replace=False)
        assert all(consumable(ref, int(t)) for t in np.flatnonzero(ok))  # the mask allows nothing refused
        spelled = [tok.decode_bytes([int(t)]) for t in np.flatnonzero(ok)]
        for t in forbidden:  # ... and refuses a token the matcher takes only as another spelling of
            piece = tok.decode_bytes([int(t)])  # allowed text: a byte token, or a piece of a forced token
            assert not consumable(ref, int(t)) or any(s.startswith(piece) for s in spelled), (t, piece)
        assert f.accepts_end() == bool(ok[tiny_target.eos]) == ref.is_accepting()
        choices = np.flatnonzero(ok & ~np.isin(np.arange(f.n_vocab), f.end_tokens))
        if not len(choices):
            break
        token = int(rng.choice(choices))
        f.commit([token])
        taken.append(token)
    assert f.n_consumed == len(taken)


def test_forced_tokens_of_a_fixed_key(tiny_target: Model, tok: llguidance.LLTokenizer) -> None:
    f = follower(Constraint.json_schema(PERSON), tiny_target)
    forced = f.forced()
    assert tok.decode_bytes(forced) == b'{"name": "'  # the layout of json.dumps: ", " and ": "
    rows = M.allocate_masks(len(forced) + 1, f.n_vocab)
    assert f.masks_along(forced, rows) == len(forced)
    for token, row in zip(forced, rows):  # each forced node allows exactly one token: the forced one
        assert list(np.flatnonzero(M.allowed_tokens(row, f.n_vocab))) == [token]
    assert M.allowed_tokens(rows[-1], f.n_vocab).sum() > 1  # then the name is free text
    assert f.n_consumed == 0 and f.forced() == forced  # masks_along committed nothing
    f.commit(forced)
    assert f.forced() == [] and np.array_equal(allowed(f), M.allowed_tokens(rows[-1], f.n_vocab))


def test_rollback_restores_masks(tiny_target: Model) -> None:
    f = follower(Constraint.json_schema(PERSON), tiny_target)
    f.commit(f.forced())
    before, forced_before = allowed(f), f.forced()
    path = [int(t) for t in tiny_target.tokenize("Bob", add_special=False)]
    f.commit(path)
    f.commit([int(np.flatnonzero(allowed(f))[0])])
    f.rollback(len(path) + 1)
    assert np.array_equal(allowed(f), before) and f.forced() == forced_before
    with pytest.raises(ConstraintError, match="since the prompt"):
        f.rollback(f.n_consumed + 1)  # never into the prompt
    f.reset([])
    assert f.n_consumed == 0 and text_of(tiny_target, f.forced()) == '{"name": "'


def test_follows_the_sequence_it_is_attached_to(tiny_target: Model) -> None:
    f = GrammarFollower.for_model(Constraint.json_schema(PERSON), tiny_target)
    seq = tiny_target.sequence
    seq.followers.append(f)
    try:
        seq.start(tiny_target.tokenize(PROMPT))
        forced = f.forced()
        seq.commit(forced)
        assert f.n_consumed == len(forced) and f.forced() == []
        seq.rollback(3)
        assert f.n_consumed == len(forced) - 3 and f.forced() == forced[-3:]
        seq.start(tiny_target.tokenize(PROMPT + " again"))  # a new prompt: the grammar starts over
        assert f.n_consumed == 0 and f.forced() == forced
    finally:
        seq.followers.remove(f)


def test_forbidden_tokens_raise_never_finish(tiny_target: Model) -> None:
    f = follower(Constraint.json_schema(PERSON), tiny_target)
    with pytest.raises(ConstraintError, match="an end token"):
        f.commit([tiny_target.eos])  # an end before the answer is complete: an error, not an answer
    f = follower(Constraint.regex("[a-z]+"), tiny_target)
    digit = tiny_target.tokenize("7", add_special=False)[-1]
    assert not f.allows(digit)
    with pytest.raises(ConstraintError, match="grammar matcher failed"):
        f.commit([digit])


def test_masks_along_stops_at_the_first_forbidden_token(tiny_target: Model) -> None:
    f = follower(Constraint.regex("[a-z]{1,20}"), tiny_target)
    word = [t for t in range(tiny.FIRST_PIECE_ID, tiny_target.n_vocab)
            if re.fullmatch(rb"[a-z]+", tiny_target.token_bytes(t))][:3]
    digit = tiny_target.tokenize("7", add_special=False)[-1]
    before = allowed(f)
    path = word + [digit] + word
    rows = M.allocate_masks(len(path) + 1, f.n_vocab)
    assert f.masks_along(path, rows) == len(word)
    assert not M.is_allowed(rows[len(word)], digit) and M.is_allowed(rows[len(word)], tiny_target.eos)
    assert f.n_consumed == 0 and np.array_equal(allowed(f), before)
    with pytest.raises(ValueError, match="rows"):
        f.masks_along(word, M.allocate_masks(len(word), f.n_vocab))
    with pytest.raises(ValueError, match="uint32"):
        f.mask(np.zeros(f.words + 1, dtype=np.uint32))


def test_mask_width_follows_the_logits_not_the_tokenizer(tiny_target: Model, tok: llguidance.LLTokenizer) -> None:
    c = Constraint.regex("[a-z]+")
    grammar = C.compile_constraint(c)
    exact = allowed(follower(c, tiny_target))
    assert exact.sum() > 0
    wide = GrammarFollower(grammar, tok, tok.vocab_size + 70)  # logits wider than the vocabulary: padded
    wide.reset([])
    wide_row = wide.mask(np.zeros(wide.words, dtype=np.uint32))
    assert wide.words == M.mask_words(tok.vocab_size + 70)
    assert np.array_equal(M.allowed_tokens(wide_row, wide.n_vocab)[:tok.vocab_size], exact)
    assert not M.allowed_tokens(wide_row, 32 * wide.words)[tok.vocab_size:].any()
    narrow = GrammarFollower(grammar, tok, 300)  # narrower: cut, no bit past n_vocab
    narrow.reset([])
    row = narrow.mask(np.zeros(narrow.words, dtype=np.uint32))
    assert np.array_equal(M.allowed_tokens(row, 300), exact[:300])
    assert not M.allowed_tokens(row, 32 * narrow.words)[300:].any()


# ---------------------------------------------------------------- a constrained greedy decode

def greedy(model: Model, prompt: list[int], f: GrammarFollower | None, max_tokens: int = 200) -> Iterator[int]:
    """Greedy decoding through the model's KVSequence, the follower (if any) following it:
    forced tokens are committed as they are, otherwise the masked argmax; ends at an end token."""
    seq = model.sequence
    if f is not None:
        seq.followers.append(f)
    try:
        seq.start(prompt)
        row = np.zeros(M.mask_words(model.n_vocab), dtype=np.uint32)
        for _ in range(max_tokens):
            forced = f.forced() if f is not None else []
            if forced:
                seq.commit(forced)
                yield from forced
                continue
            seq.fill()
            logits = np.array(model.logits_array(1)[0])
            if f is not None:
                mask_logits(logits, f.mask(row))
            token = int(np.argmax(logits))
            seq.commit([token])
            if model.is_eog(token):
                return
            yield token
    finally:
        if f is not None:
            seq.followers.remove(f)


def strings_blanked(text: str) -> str:
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def test_greedy_decode_under_a_schema_is_valid_json(tiny_target: Model) -> None:
    prompt = tiny_target.tokenize(PROMPT)
    f = GrammarFollower.for_model(Constraint.json_schema(PERSON), tiny_target)
    tokens = list(greedy(tiny_target, prompt, f))
    assert f.must_end() and f.accepts_end() and f.n_consumed == len(tokens) + 1  # + the end token
    text = text_of(tiny_target, tokens)
    value = json.loads(text)
    assert list(value) == ["name", "tags", "ok", "level"]  # the schema's order, nothing else
    assert isinstance(value["name"], str) and 1 <= len(value["name"]) <= 10
    assert isinstance(value["tags"], list) and 1 <= len(value["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 5 for t in value["tags"])
    assert isinstance(value["ok"], bool) and value["level"] in ("low", "high")
    assert strings_blanked(text) == strings_blanked(json.dumps(value, ensure_ascii=False))  # json.dumps's layout


def test_negative_control_unconstrained_decode_is_not_json(tiny_target: Model) -> None:
    prompt = tiny_target.tokenize(PROMPT)
    tokens = list(greedy(tiny_target, prompt, None, max_tokens=60))
    text = b"".join(tiny_target.token_bytes(t) for t in tokens).decode("utf-8", "replace")
    with pytest.raises(ValueError):
        json.loads(text)


def test_greedy_decode_under_a_regex_and_a_gbnf_grammar(tiny_target: Model) -> None:
    prompt = tiny_target.tokenize(PROMPT)
    for c, pattern in ((SPECS["regex"], r"(yes|no)[0-9]{1,3}"), (SPECS["gbnf"], r"def [a-z_]+\(\):")):
        f = GrammarFollower.for_model(c, tiny_target)
        text = text_of(tiny_target, list(greedy(tiny_target, prompt, f, max_tokens=60)))
        assert f.accepts_end() and re.fullmatch(pattern, text), (c.kind, text)

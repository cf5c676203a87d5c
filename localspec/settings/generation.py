"""Everything one generation needs besides the models and the prompt (:class:`GenerationConfig`),
built from flat keywords by :meth:`GenerationConfig.from_options` — the one settings path of the
CLI, the API and the server — and the defaults (:data:`DEFAULTS`). Keyword names equal the CLI
flags (``num_draft_tokens`` is ``--num-draft-tokens``). Its ``constraint`` is a
:class:`~localspec.settings.constraints.Constraint` (what the output must match)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from localspec.errors import ConfigError
from localspec.settings.constraints import CONSTRAINT_KEYS, Constraint, constraint_from_options, constraint_to_options
from localspec.settings.models import ModelOptions
from localspec.settings.sampling import DEFAULT_SAMPLING, SamplingParams
from localspec.settings.shape import Shape
from localspec.settings.validation import (
    INT32_MAX,
    as_float,
    as_int,
    choice,
    is_int,
    is_number,
    require,
    show,
    unknown_names,
)

VERIFIERS: tuple[str, ...] = ("greedy", "match", "token", "block", "gbv", "rrs", "rrsw", "traversal", "batch")
CHAIN_ONLY = ("token", "block")  # verify one chain
K_PATHS = ("gbv", "batch")  # verify K root-to-leaf chains
WITHOUT_REPLACEMENT = ("rrsw", "traversal")  # trees whose siblings are drawn without replacement
DRAFTERS: tuple[str, ...] = ("auto", "model", "ngram", "hybrid")
PLANS: tuple[str, ...] = ("auto", "fixed")
SEED_LIMIT = 2**64
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # every token is scanned for every stop string

def _stop_strings(stop: Any) -> tuple[str, ...]:
    """Stop strings as a tuple: none (None), one string, or a list/tuple of strings; each valid
    Unicode text (a lone surrogate could never match) and bounded in number and length (every
    token is scanned for every stop string)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    require(isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop), "stop",
            f"stop must be a string or a list of strings, got {show(stop)}")
    require(len(stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in stop), "stop",
            f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each")
    for s in stop:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"stop string {show(s)} is not valid Unicode text: a lone surrogate "
                              f"U+{ord(s[exc.start]):04X} at character {exc.start}", "stop") from None
    return tuple(stop)


_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")
_SHAPE_KEYS = ("num_draft_tokens", "paths", "tree")


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how to draft and verify it (models and prompt aside)."""

    max_tokens: int = 256
    sampling: SamplingParams = DEFAULT_SAMPLING
    seed: int | None = None  # None: a random seed
    verifier: str = "block"
    shape: Shape = Shape(32)  # the most a drafter may draft per step; plan auto chooses how many
    drafter: str = "auto"
    plan: str = "auto"  # auto: choose each step's depth (or none) from measured costs; fixed
    lenience: float = 0.0  # > 0: the LOSSY over-acceptance of Yin et al. (verifier token only)
    stop: tuple[str, ...] = field(default=())
    constraint: Constraint | None = None  # structured output: what the text must match (None: free text)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_tokens", as_int(self.max_tokens))
        object.__setattr__(self, "seed", as_int(self.seed))
        object.__setattr__(self, "lenience", as_float(self.lenience))
        require(is_int(self.max_tokens) and 1 <= self.max_tokens <= INT32_MAX, "max_tokens",
                f"max_tokens must be an integer in [1, {INT32_MAX}], got {show(self.max_tokens)}")
        require(self.seed is None or (is_int(self.seed) and 0 <= self.seed < SEED_LIMIT), "seed",
                f"seed must be an integer in [0, 2**64) (or none for a random seed), got {show(self.seed)}")
        require(isinstance(self.sampling, SamplingParams), "sampling",
                f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        require(isinstance(self.shape, Shape), "shape", f"shape must be a Shape, got {type(self.shape).__name__}")
        choice(self.verifier, "verifier", VERIFIERS)
        choice(self.drafter, "drafter", DRAFTERS)
        choice(self.plan, "plan", PLANS)
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        require(is_number(self.lenience) and math.isfinite(self.lenience) and self.lenience >= 0, "lenience",
                f"lenience must be a finite number >= 0, got {show(self.lenience)}")
        require(self.lenience == 0 or self.verifier == "token", "lenience",
                "lenience (lossy over-acceptance) needs verifier 'token'")
        require(self.constraint is None or isinstance(self.constraint, Constraint), "constraint",
                f"constraint must be a localspec.settings.constraints.Constraint (or None), got {type(self.constraint).__name__}")
        # a constraint says whether stop strings may come with it (tool calling's grammar: see Constraint)
        require(not (self.constraint is not None and not self.constraint.allow_stop_strings and self.stop), "stop",
                "stop strings cannot be combined with a constraint: the grammar decides where the output "
                "ends, and text cut at a stop string would no longer match it")
        self._check_shape()

    def _check_shape(self) -> None:
        s, v = self.shape, self.verifier
        branched = not s.is_chain
        require(not (branched and v in CHAIN_ONLY), "verifier",
                f"verifier {v!r} verifies one chain; use gbv/batch with paths, rrs/rrsw/traversal with a tree")
        require(not (s.branching is not None and v in K_PATHS), "tree",
                f"verifier {v!r} takes K paths (paths), not a tree")
        require(not (s.paths > 1 and v in WITHOUT_REPLACEMENT), "paths",
                f"verifier {v!r} needs a tree drawn without replacement (tree), not independent paths")
        require(not (self.drafter == "ngram" and branched), "drafter",
                "the n-gram drafter proposes a single chain; use drafter model or hybrid for paths and trees")

    @classmethod
    def from_options(cls, base: GenerationConfig | None = None, **options: Any) -> GenerationConfig:
        """A config from flat keyword names (those of the CLI flags and the request fields):
        max_tokens, temperature, top_k, top_p, min_p, seed, verifier, num_draft_tokens, paths,
        tree, drafter, plan, lenience, stop, and at most one constraint: response_format (OpenAI's),
        json_schema (a schema, llama-server's), regex, grammar (GBNF or Lark text) or constraint
        (a Constraint). What is left out (or None, for the sampling and
        shape keys) comes from `base` (default: the project's defaults)."""
        base = DEFAULTS if base is None else base
        require(isinstance(base, GenerationConfig), "config",
                f"config must be a GenerationConfig (or None), got {type(base).__name__}; pass settings as "
                "keywords instead, e.g. max_tokens=64")
        own = {f.name for f in fields(cls)} - {"sampling", "shape"}
        unknown = set(options) - own - set(_SAMPLING_KEYS) - set(_SHAPE_KEYS) - set(CONSTRAINT_KEYS)
        require(not unknown, sorted(unknown)[0] if unknown else "",
                unknown_names(unknown, SETTING_KEYS, "setting(s)")
                + ("; ctx_size, threads and the other model options belong to load_model"
                    if unknown & {f.name for f in fields(ModelOptions)} else ""))
        constraint = constraint_from_options(options)
        if constraint is not False:
            options["constraint"] = constraint
        sampling = {k: options.pop(k) for k in _SAMPLING_KEYS if options.get(k) is not None}
        shape = {k: options.pop(k) for k in _SHAPE_KEYS if k in options}
        changes = dict(options)
        if sampling:
            changes["sampling"] = replace(base.sampling, **sampling)
        if any(v is not None for v in shape.values()):
            changes["shape"] = _shape_from_options(base.shape, **shape)
        return replace(base, **changes)

    def options(self) -> dict[str, Any]:
        """The flat keyword names and values (inverse of from_options)."""
        s = self.shape
        return {"max_tokens": self.max_tokens, "temperature": self.sampling.temperature,
                "top_k": self.sampling.top_k, "top_p": self.sampling.top_p, "min_p": self.sampling.min_p,
                "seed": self.seed, "verifier": self.verifier, "num_draft_tokens": s.depth, "paths": s.paths,
                "tree": list(s.branching) if s.branching else None, "drafter": self.drafter,
                "plan": self.plan, "lenience": self.lenience, "stop": list(self.stop),
                **constraint_to_options(self.constraint)}

    @property
    def speculative(self) -> bool:
        return self.shape.depth > 0

    def is_target_alone(self, has_draft_model: bool) -> bool:
        """The one rule for "the target alone": nothing is ever drafted. That is num_draft_tokens
        0, or the model drafter without a draft model. `-d none` alone only means no draft
        *model*: the n-gram drafter (auto, ngram) still drafts from the context."""
        return not self.speculative or (self.drafter == "model" and not has_draft_model)

    def target_alone(self) -> GenerationConfig:
        """The same generation decoded by the target alone (no draft tokens)."""
        return replace(self, shape=Shape(0))

    def check_fits(self, n_batch: int, n_seq_max: int) -> None:
        """ConfigError unless the draft fits a loaded target: one KV sequence per branch, and one
        batch holds the root and at least one level of every branch. A chain or paths deeper than
        the batch holds are drafted less deep (localspec.decoding.depth.step_depth, the one place
        that cuts the depth, and says so in the statistics); a tree that does not fit is an error."""
        s = self.shape
        require(s.n_leaves <= n_seq_max, "tree",
                f"the draft {s.describe()} has {s.n_leaves} branches but the target context holds {n_seq_max} "
                f"sequences; use a tree of at most {n_seq_max} branches (or load the target with n_seq_max "
                f">= {s.n_leaves})")
        require(s.n_nodes + 1 <= n_batch or (s.branching is None and n_batch - 1 >= s.paths), "num_draft_tokens",
                f"the draft {s.describe()} has {s.n_nodes} nodes; at most n_batch - 1 = {n_batch - 1} fit")


def _shape_from_options(base: Shape, num_draft_tokens: int | None = None, paths: int | None = None,
                        tree: Any = None) -> Shape:
    require(not (isinstance(tree, (str, list, tuple)) and not (tree.strip() if isinstance(tree, str) else tree)),
            "tree", "tree is empty; leave it out for a chain, or give branching factors such as 3x2x1")
    if tree is not None:
        require(paths in (None, 1), "paths", "use either paths or tree, not both")
        shape = Shape.parse(tree)
        require(shape.branching is not None, "tree", f"tree {show(tree)} is not a tree; use e.g. 3x2x1")
        return shape
    depth = base.depth if num_draft_tokens is None else num_draft_tokens
    return Shape(depth=depth, paths=(base.paths if base.branching is None else 1) if paths is None else paths)


def describe_speculation(config: GenerationConfig, draft_name: str | None) -> str:
    """What drafts, in words (chat's banner, serve's start-up line): `draft_name` is the draft
    model's name, None without one."""
    if config.is_target_alone(draft_name is not None):
        return "the target alone (nothing drafted)"
    s = config.shape
    shape = (f"tree {'x'.join(map(str, s.branching))}" if s.branching
             else f"k={s.depth}" + (f", {s.paths} paths" if s.paths > 1 else ""))
    model = f"the draft model {draft_name}" if draft_name else ""
    drafts = {"ngram": "n-gram drafts from the context",
              "model": model,
              "hybrid": f"n-gram drafts and {model}",
              "auto": "n-gram drafts from the context" + (f", {model} where it pays" if model else
                                                          " (no draft model)")}[config.drafter]
    return f"{drafts}; verifier {config.verifier}, {shape}, plan {config.plan}"


DEFAULTS = GenerationConfig()
SETTING_KEYS: tuple[str, ...] = tuple(DEFAULTS.options())  # every setting's keyword (CLI flags, request fields)

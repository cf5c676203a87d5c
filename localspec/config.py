"""Settings, one type per concept, each validated once when it is made, with the defaults.

A leaf module (no numpy, no llama.cpp), so ``localspec --help`` stays fast and every layer can
import it:

* :class:`SamplingParams`: temperature, top-k, top-p, min-p (:data:`DEFAULT_SAMPLING` is what
  users get; the field defaults are the neutral "off" values);
* :class:`Shape`: what to draft per step (a chain, K paths, a tree), parsed from every spelling
  by :meth:`Shape.parse`;
* :class:`GenerationConfig`: everything one generation needs besides the models and prompt, its
  ``constraint`` a :class:`~localspec.constraints.Constraint` (what the output must match; defined
  in :mod:`localspec.constraints`, and importable from here too);
* :class:`ModelOptions`: how to load a model and size its context (its RPC servers parsed by
  :mod:`localspec.endpoints`).

The checks settings share live in :mod:`localspec.validation`. Keyword names equal the CLI flags
(``num_draft_tokens`` is ``--num-draft-tokens``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Sequence

# Constraint is public here too (GenerationConfig's errors name localspec.config.Constraint)
from localspec.constraints import CONSTRAINT_KEYS, Constraint, constraint_from_options, constraint_to_options
from localspec.endpoints import parse_endpoints
from localspec.errors import ConfigError
from localspec.validation import as_float, as_int, choice, is_int, is_number, require, show, unknown_names

VERIFIERS: tuple[str, ...] = ("greedy", "match", "token", "block", "gbv", "rrs", "rrsw", "traversal", "batch")
CHAIN_ONLY = ("token", "block")  # verify one chain
K_PATHS = ("gbv", "batch")  # verify K root-to-leaf chains
WITHOUT_REPLACEMENT = ("rrsw", "traversal")  # trees whose siblings are drawn without replacement
DRAFTERS: tuple[str, ...] = ("auto", "model", "ngram", "hybrid")
PLANS: tuple[str, ...] = ("auto", "fixed")
CACHE_TYPES: tuple[str, ...] = ("f16", "f32", "q8_0")
FLASH_ATTN: tuple[str, ...] = ("auto", "on", "off")
LOAD_MODES: tuple[str, ...] = ("read", "mmap", "auto")
CPU_KERNELS: tuple[str, ...] = ("auto", "llama", "repack", "plain")  # see localspec.llama.kernels

MAX_DRAFT_TOKENS = 64  # draft depth
MAX_PATHS = 16
MAX_BRANCHING = 16  # children per node at one depth
MAX_BRANCHES = 64  # root-to-leaf paths of one draft (KV sequences)
SEED_LIMIT = 2**64
INT32_MAX = 2**31 - 1  # what llama.cpp's int32 counts (tokens, threads, layers, top-k) hold
MIN_TEMPERATURE = 1e-4  # below, logits / temperature overflows float32: use 0 (greedy)
MAX_TEMPERATURE = 1e6
MIN_PROBABILITY = 2.0**-126  # smallest top_p and min_p > 0: the smallest normal float32 (C's FLT_MIN)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # every token is scanned for every stop string
MAX_THREADS = 1024


# ---------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingParams:
    """The plain sampler's settings. The verifier transforms the target exactly as plain sampling
    does: top-k, then top-p, then min-p on the temperature-1 distribution, then temperature."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", as_float(self.temperature))
        object.__setattr__(self, "top_k", as_int(self.top_k))
        object.__setattr__(self, "top_p", as_float(self.top_p))
        object.__setattr__(self, "min_p", as_float(self.min_p))
        # the ranges of the C verifier, which holds these as float32 (native/verifier.h: ls_sampling)
        t, p = self.temperature, self.min_p
        require(is_number(t) and math.isfinite(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
                "temperature", f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                                f"{MAX_TEMPERATURE:g}], got {show(t)}")
        require(is_int(self.top_k) and 0 <= self.top_k <= INT32_MAX, "top_k",
                f"top_k must be an integer in [0, {INT32_MAX}] (0: off), got {show(self.top_k)}")
        require(is_number(self.top_p) and MIN_PROBABILITY <= self.top_p <= 1, "top_p",
                f"top_p must lie in (0, 1] (1: off) and be at least 2**-126 (about 1.2e-38, the smallest normal "
                f"float32: the sampler computes in float32), got {show(self.top_p)}")
        require(is_number(p) and (p == 0 or MIN_PROBABILITY <= p <= 1), "min_p",
                f"min_p must lie in [0, 1] (0: off) and be 0 or at least 2**-126 (about 1.2e-38, the smallest "
                f"normal float32: the sampler computes in float32), got {show(p)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


DEFAULT_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)  # llama.cpp's defaults


# ---------------------------------------------------------------- draft shapes

SHAPE_SYNTAX = ("kN (a chain of N draft tokens), pKkN (K paths of N tokens), "
                "AxBx.. or tAxBx.. (a tree: A children at depth 1, B at depth 2, ...)")
# ASCII digits only (\d takes other scripts' digits too)
_SHAPE_RE = re.compile(r"^(?:k([0-9]+)|p([0-9]+)k([0-9]+)|t?([0-9]+(?:[x,][0-9]+)*))$")
_MAX_SHAPE_CHARS = 1024


def _shape_int(digits: str, param: str) -> int:
    """A number of a shape's spelling; never a parse of a huge string (Python refuses an int of
    over 4300 digits), and no number past what the limits hold."""
    require(len(digits) <= 9, param, f"{digits:.20}{'...' if len(digits) > 20 else ''} is too large for {param}")
    return int(digits)


@dataclass(frozen=True)
class Shape:
    """chain: paths 1, no branching; K paths: paths K; tree: a branching factor per depth.
    `depth` is the user's num_draft_tokens (a tree's: its number of branching factors), the most
    levels a step drafts; localspec.decoding.depth.step_depth cuts it where a step must draft fewer."""

    depth: int
    paths: int = 1
    branching: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "depth", as_int(self.depth))
        object.__setattr__(self, "paths", as_int(self.paths))
        if self.branching is not None:
            b = tuple(as_int(x) for x in self.branching)
            require(all(is_int(x) and 1 <= x <= MAX_BRANCHING for x in b) and bool(b), "tree",
                    f"tree branching factors must be integers in [1, {MAX_BRANCHING}], got {show(list(b))}")
            require(len(b) <= MAX_DRAFT_TOKENS, "tree",
                    f"a draft tree has at most {MAX_DRAFT_TOKENS} levels, got {len(b)}")
            require(self.paths == 1, "tree", "use either paths or tree, not both")
            object.__setattr__(self, "branching", b)
            object.__setattr__(self, "depth", len(b))
        require(is_int(self.depth) and 0 <= self.depth <= MAX_DRAFT_TOKENS, "num_draft_tokens",
                f"num_draft_tokens must be an integer in [0, {MAX_DRAFT_TOKENS}], got {show(self.depth)}")
        require(is_int(self.paths) and 1 <= self.paths <= MAX_PATHS, "paths",
                f"paths must be an integer in [1, {MAX_PATHS}], got {show(self.paths)}")
        require(self.n_leaves <= MAX_BRANCHES, "tree",
                f"the draft {self.describe()} has {self.n_leaves} branches; at most {MAX_BRANCHES} fit")

    @classmethod
    def chain(cls, num_draft_tokens: int) -> "Shape":
        return cls(depth=num_draft_tokens)

    @classmethod
    def k_paths(cls, paths: int, num_draft_tokens: int) -> "Shape":
        return cls(depth=num_draft_tokens, paths=paths)

    @classmethod
    def tree(cls, branching: Sequence[int]) -> "Shape":
        return cls(depth=len(branching), branching=tuple(branching))

    @classmethod
    def parse(cls, value: str | Sequence[int]) -> "Shape":
        """Every spelling: "k4" (chain), "p3k4" (3 paths of 4), "t3x2x1", "3x2x1", "3,2,1" or
        [3, 2, 1] (a tree)."""
        if isinstance(value, (bytes, bytearray)):
            value = value.decode("ascii", "replace")
        if not isinstance(value, str):
            items = list(value) if isinstance(value, (list, tuple)) else None
            require(bool(items) and all(is_int(b) for b in items), "tree",  # type: ignore[union-attr]
                    f"a draft tree is a list of branching factors such as [3, 2, 1], got {show(value)}")
            assert items is not None
            require(len(items) <= MAX_DRAFT_TOKENS, "tree",
                    f"a draft tree has at most {MAX_DRAFT_TOKENS} levels, got {len(items)}")
            return cls.tree(tuple(int(b) for b in items))
        m = _SHAPE_RE.match(value.strip().lower()) if len(value) <= _MAX_SHAPE_CHARS else None
        require(m is not None, "tree", f"{show(value)} is not a draft shape; use {SHAPE_SYNTAX}")
        assert m is not None
        if m.group(1) is not None:
            return cls.chain(_shape_int(m.group(1), "num_draft_tokens"))
        if m.group(2) is not None:
            return cls.k_paths(_shape_int(m.group(2), "paths"), _shape_int(m.group(3), "num_draft_tokens"))
        levels = re.split(r"[x,]", m.group(4))
        require(len(levels) <= MAX_DRAFT_TOKENS, "tree",
                f"a draft tree has at most {MAX_DRAFT_TOKENS} levels, got {len(levels)}")
        return cls.tree(tuple(_shape_int(b, "tree") for b in levels))

    @property
    def n_nodes(self) -> int:
        if self.branching is None:
            return self.paths * self.depth
        total, width = 0, 1
        for b in self.branching:
            width *= b
            total += width
        return total

    @property
    def n_leaves(self) -> int:
        return math.prod(self.branching) if self.branching is not None else self.paths

    @property
    def is_chain(self) -> bool:
        return self.paths == 1 and (self.branching is None or all(b == 1 for b in self.branching))

    @property
    def num_draft_tokens(self) -> int:
        return self.depth

    def truncated(self, depth: int) -> "Shape":
        """The same shape cut to at most `depth` levels (near the end of the context/budget)."""
        depth = max(0, min(depth, self.depth))
        if self.branching is not None:
            return Shape(0) if depth == 0 else Shape.tree(self.branching[:depth])
        return Shape(depth=depth, paths=self.paths)

    @property
    def label(self) -> str:
        """The compact spelling Shape.parse reads back: k4, p3k4, t3x2x1."""
        if self.branching is not None:
            return "t" + "x".join(map(str, self.branching))
        return f"p{self.paths}k{self.depth}" if self.paths > 1 else f"k{self.depth}"

    def describe(self) -> str:
        if self.branching is not None:
            return "tree " + "x".join(str(b) for b in self.branching)
        return f"{self.paths}x{self.depth} paths" if self.paths > 1 else f"chain {self.depth}"


# ---------------------------------------------------------------- one generation


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
                f"constraint must be a localspec.config.Constraint (or None), got {type(self.constraint).__name__}")
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
    def from_options(cls, base: "GenerationConfig | None" = None, **options: Any) -> "GenerationConfig":
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

    def target_alone(self) -> "GenerationConfig":
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


# ---------------------------------------------------------------- loading a model


@dataclass(frozen=True)
class ModelOptions:
    """How to load a model and size its context (keyword names of ``localspec.load_model``)."""

    __pydantic_config__ = {"extra": "forbid"}  # a resident service validates requests with pydantic

    ctx_size: int = 4096  # context length in tokens (KV cells, shared by all sequences)
    batch_size: int = 512  # most tokens one decode may take
    threads: int | None = None  # CPU threads (default: all cores)
    n_gpu_layers: int = 0  # layers offloaded to the GPU (-1: all)
    flash_attn: str = "auto"
    cache_type: str = "f16"  # KV cache type
    n_seq_max: int = 16  # sequences (tree branches) in flight
    load_mode: str = "read"  # read: copy the weights into memory (no mapped duplicate); mmap; auto
    rpc: tuple[str, ...] = ()  # RPC servers ("host:port") that take the model's layers
    cpu_kernels: str = "auto"  # which llama.cpp weight buffer types (AMX, CPU_REPACK) to use: see localspec.llama.kernels

    def __post_init__(self) -> None:
        for name in ("ctx_size", "batch_size", "threads", "n_gpu_layers", "n_seq_max"):
            object.__setattr__(self, name, as_int(getattr(self, name)))
        object.__setattr__(self, "rpc", parse_endpoints(self.rpc))
        require(is_int(self.ctx_size) and self.ctx_size >= 16, "ctx_size",
                f"ctx_size must be at least 16 tokens, got {show(self.ctx_size)}")
        require(self.ctx_size <= INT32_MAX, "ctx_size", f"ctx_size must be at most {INT32_MAX}, got {show(self.ctx_size)}")
        require(is_int(self.batch_size) and self.batch_size >= 1, "batch_size",
                f"batch_size must be a positive integer, got {show(self.batch_size)}")
        require(self.batch_size <= INT32_MAX, "batch_size", f"batch_size must be at most {INT32_MAX}")
        require(self.threads is None or (is_int(self.threads) and 1 <= self.threads <= MAX_THREADS), "threads",
                f"threads must be an integer in [1, {MAX_THREADS}], got {show(self.threads)}")
        require(is_int(self.n_gpu_layers) and -1 <= self.n_gpu_layers <= INT32_MAX, "n_gpu_layers",
                f"n_gpu_layers must be an integer in [-1, {INT32_MAX}] (-1: all), got {show(self.n_gpu_layers)}")
        choice(self.flash_attn, "flash_attn", FLASH_ATTN)
        choice(self.cache_type, "cache_type", CACHE_TYPES)
        choice(self.load_mode, "load_mode", LOAD_MODES)
        choice(self.cpu_kernels, "cpu_kernels", CPU_KERNELS)
        require(not (self.cache_type == "q8_0" and self.flash_attn == "off"), "cache_type",
                "cache_type q8_0 (a quantized KV cache) needs flash attention: use flash_attn 'auto' or 'on', "
                "or cache_type f16")
        require(is_int(self.n_seq_max) and 1 <= self.n_seq_max <= 256, "n_seq_max",
                f"n_seq_max must lie in [1, 256], got {show(self.n_seq_max)}")
        # llama.cpp reserves an output row per sequence in one decode and aborts the process when a
        # batch (n_batch, capped at ctx_size) is smaller than n_seq_max: refused here instead
        for name in ("batch_size", "ctx_size"):
            require(getattr(self, name) >= self.n_seq_max, name,
                    f"{name} must be at least n_seq_max = {self.n_seq_max} (one decode holds a row for every "
                    f"sequence), got {getattr(self, name)}: raise {name} or lower n_seq_max")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "ModelOptions":
        """Options from keywords; unknown names are a ConfigError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        require(not unknown, unknown[0] if unknown else "", unknown_names(unknown, sorted(known), "model option(s)"))
        return cls(**{k: v for k, v in options.items() if v is not None or k == "threads"})


MODEL_DEFAULTS = ModelOptions()
LOAD_FLAGS: tuple[str, ...] = ("ctx_size", "n_gpu_layers", "draft_n_gpu_layers", "threads", "cache_type", "load_mode",
                               "cpu_kernels", "rpc", "draft_rpc")  # the CLI's flags that say how a pair loads


@dataclass(frozen=True)
class PairOptions:
    """How a target and its draft load: one ModelOptions each. The draft's are the target's, on
    this machine unless ``draft_rpc`` names servers for it, with its own GPU layers when
    ``draft_n_gpu_layers`` is given (:meth:`from_flags`)."""

    __pydantic_config__ = {"extra": "forbid"}

    target: ModelOptions = MODEL_DEFAULTS
    draft: ModelOptions = MODEL_DEFAULTS

    def __post_init__(self) -> None:
        require(isinstance(self.target, ModelOptions) and isinstance(self.draft, ModelOptions), "options",
                "a pair's options are two ModelOptions (the target's and the draft's)")

    @classmethod
    def from_flags(cls, options: Mapping[str, Any]) -> "PairOptions":
        """The options of the load keywords (LOAD_FLAGS and ModelOptions' names; None: the
        default): ConfigError naming a bad one."""
        own = {k: v for k, v in options.items() if k not in ("draft_n_gpu_layers", "draft_rpc")}
        target = ModelOptions.from_options(own)
        draft = replace(target, rpc=parse_endpoints(options.get("draft_rpc")))
        if options.get("draft_n_gpu_layers") is not None:
            draft = replace(draft, n_gpu_layers=options["draft_n_gpu_layers"])
        return cls(target, draft)

    @property
    def remote(self) -> bool:
        """Whether either model puts layers on RPC servers."""
        return bool(self.target.rpc or self.draft.rpc)

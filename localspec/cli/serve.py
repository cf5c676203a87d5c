"""``localspec serve``: an OpenAI-compatible HTTP server with speculative decoding."""

from __future__ import annotations

import logging
from typing import Any

import click

from localspec.cli import resolve
from localspec.cli.options import (
    EnvOption,
    Flags,
    compile_constraint_now,
    generation_config,
    model_options,
    prompt_cache_option,
    sampling_options,
    spec_options,
    user_errors,
)
from localspec.core.residency import PROMPT_MEMORY
from localspec.core.status import display_name
from localspec.loading import draft_loading, is_none
from localspec.server import ServerLimits
from localspec.settings.generation import describe_speculation

log = logging.getLogger(__name__)
LIMITS = ("max_body_bytes", "max_messages", "max_nesting", "max_queue", "header_timeout", "body_timeout")


def check_loaded_pair(loaded: Any) -> None:
    """ModelError when the draft (loaded, or lazily: its vocabulary alone) cannot draft for the target."""
    from localspec.decoding.pairing import check_lazy_pair, check_pair
    from localspec.llama.lazy import LazyModel

    if isinstance(loaded.draft, LazyModel):
        check_lazy_pair(loaded.target, loaded.draft)
    elif loaded.draft is not None:
        check_pair(loaded.target, loaded.draft)


@click.command()
@model_options
@spec_options
@sampling_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. The default takes connections from this machine only; 0.0.0.0 "
                   "takes them from every network (use --api-key then).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Port to listen on (0: any free port).")
@click.option("--api-key", cls=EnvOption, envvar="LOCALSPEC_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every request (env LOCALSPEC_API_KEY). "
                   "Without it there is no authentication.")
@click.option("--max-body-bytes", type=click.IntRange(1), default=ServerLimits.max_body_bytes,
              show_default=True, help="Largest request body; larger ones get 413.")
@click.option("--max-messages", type=click.IntRange(1), default=ServerLimits.max_messages,
              show_default=True, help="Most chat messages in one request.")
@click.option("--max-nesting", type=click.IntRange(1), default=ServerLimits.max_nesting,
              show_default=True, help="Deepest JSON nesting of a request body.")
@click.option("--max-queue", type=click.IntRange(1), default=ServerLimits.max_queue,
              show_default=True, help="Requests that may wait for the model; more get 503.")
@click.option("--header-timeout", type=click.FloatRange(0, min_open=True),
              default=ServerLimits.header_timeout, show_default=True,
              help="Seconds a connection may take to send a request head (idle connections are closed).")
@click.option("--body-timeout", type=click.FloatRange(0, min_open=True), default=ServerLimits.body_timeout,
              show_default=True, help="Seconds a request may take to send its body (408 after that).")
@prompt_cache_option
@click.option("--prompt-cache-memory", type=click.IntRange(0), default=PROMPT_MEMORY >> 20, show_default=True, metavar="MB",
              help="Prompt states also kept in memory, so that conversations served in turn restore theirs "
                   "without reading the disk (0: disk only).")
@user_errors
def serve(model: str | None, draft: str | None, host: str, port: int, api_key: str | None,
          prompt_cache_memory: int, **_: Any) -> None:
    """Serve the model pair over an OpenAI-compatible HTTP API.

    Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions
    (stream: true for Server-Sent Events). The pair is loaded once; up to
    --parallel requests generate at once (each a slot of one step loop that
    puts every request's step into one decode), more wait in a queue
    (--max-queue, then 503). The speculative and sampling options are the
    defaults of every request; a request overrides them with its own fields
    (temperature, top_p, max_tokens, seed, stop, and the extensions top_k, min_p,
    verifier, num_draft_tokens, paths, tree, drafter, plan). Every response has a
    "speculative" object with the settings used and the acceptance statistics.
    Structured output (response_format) and OpenAI's tool calling (tools,
    tool_choice, parallel_tool_calls, tool messages) work as with OpenAI.

    Limits: request bodies, messages, JSON nesting, the queue and the time a
    client may take to send its request are bounded (the options below);
    there is no authentication unless --api-key is given.

    \b
    localspec serve                                   # default pair on 127.0.0.1:8080
    localspec serve -m target.gguf -d draft.gguf --verifier traversal --tree 3x2x1
    localspec serve -d none --drafter ngram --port 9000
    localspec serve --host 0.0.0.0 --api-key "$(openssl rand -hex 16)"
    curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}'

    \b
    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="none")
    r = client.chat.completions.create(model="local", max_tokens=64,
        messages=[{"role": "user", "content": "Write a haiku"}],
        extra_body={"verifier": "traversal", "tree": [3, 2, 1]})
    print(r.choices[0].message.content, r.model_extra["speculative"])
    """
    from localspec import server

    server.require_server_deps()
    from localspec.core.residency import Residency
    from localspec.server.jobs import Pair
    from localspec.server.run import base_url, bind_socket, serve as run_server

    flags = Flags.current()
    directory, limit = resolve.prompt_cache(flags["prompt_cache"])
    defaults = generation_config(flags)
    compile_constraint_now(defaults)  # a bad schema: a usage error before the pair is fetched or loaded
    limits = ServerLimits(api_key=api_key or None, **{k: flags[k] for k in LIMITS})
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"localspec: warning: listening on {host} without --api-key: anyone who can reach this "
                   "port can use the model", err=True)
    # a request may ask for another drafter than the default: a draft named with -d is kept
    need, lazy = draft_loading(defaults.drafter, draft_named=draft is not None and not is_none(draft))
    loading = flags.load()
    sock = bind_socket(host, port)
    residency = Residency(prompt_memory=prompt_cache_memory << 20)
    try:
        spec = resolve.resolve_pair(model, draft, loading, need_draft=need)
        loaded = residency.pin(spec, need_draft=need, lazy_draft=lazy)
        check_loaded_pair(loaded)  # a draft that cannot draft for the target: refused now, as generate does
    except BaseException:
        sock.close()
        residency.close()
        raise
    # one key's prompts are not another's
    pair = Pair(residency, spec, limits.max_queue, residency.prompt_cache(directory, limit, namespace=api_key or None))
    stopped = True  # False: a generation may still use the models
    try:
        model_id = display_name(loaded.target_name)
        speculation = describe_speculation(defaults, loaded.draft.name if loaded.draft is not None else None)
        click.echo(f"localspec: serving {model_id} on {base_url(sock)}", err=True)
        click.echo(f"localspec: {speculation}; Ctrl-C stops", err=True)
        stopped = run_server(pair, model_id=model_id, sock=sock, defaults=defaults, limits=limits,
                             verbose=logging.getLogger().getEffectiveLevel() <= logging.INFO)
    finally:
        sock.close()
        if not stopped:
            log.warning("a generation was still running when the server stopped")
    click.echo("localspec: server stopped", err=True)

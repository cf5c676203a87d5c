"""``localspec serve``: an OpenAI-compatible HTTP server with speculative decoding."""

from __future__ import annotations

import logging

import click

from localspec.cli import load_pair, model_options, sampling_options, spec_kwargs, spec_options, user_errors

log = logging.getLogger(__name__)


@click.command()
@model_options
@spec_options
@sampling_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; there is no authentication).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Port to listen on (0: any free port).")
@user_errors
def serve(model: str | None, draft: str | None, ctx_size: int, n_gpu_layers: int,
          draft_n_gpu_layers: int | None, threads: int | None, cache_type: str, load_mode: str,
          verifier: str, num_draft_tokens: int,
          paths: int, tree: str | None, drafter: str, plan: str, temperature: float, top_k: int,
          top_p: float, min_p: float, seed: int | None, max_tokens: int, host: str, port: int) -> None:
    """Serve the model pair over an OpenAI-compatible HTTP API.

    Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions
    (stream: true for Server-Sent Events). The pair is loaded once; requests are
    queued and run one at a time. The speculative and sampling options are the
    defaults of every request; a request overrides them with its own fields
    (temperature, top_p, max_tokens, seed, stop, and the extensions top_k, min_p,
    verifier, num_draft_tokens, paths, tree, drafter, plan). Every response has a
    "speculative" object with the settings used and the acceptance statistics.

    \b
    localspec serve                                   # default pair on 127.0.0.1:8080
    localspec serve -m target.gguf -d draft.gguf --verifier traversal --tree 3x2x1
    localspec serve -d none --drafter ngram --port 9000
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
    from localspec.engine import SpecConfig

    server.require_server_deps()
    spec = spec_kwargs(verifier, num_draft_tokens, paths, tree, drafter, plan)
    defaults = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                    max_tokens=max_tokens, **spec)
    config = SpecConfig(verifier=verifier, num_draft_tokens=num_draft_tokens, paths=paths, tree=spec["tree"],
                        plan=plan)
    config.validate(drafter, n_batch=2**31)  # before loading; the real n_batch below
    sock = server.bind_socket(host, port)
    try:
        loaded = load_pair(model, draft, ctx_size=ctx_size, n_gpu_layers=n_gpu_layers,
                           draft_n_gpu_layers=draft_n_gpu_layers, threads=threads, cache_type=cache_type,
                           load_mode=load_mode,
                           need_draft=drafter != "ngram" or draft is not None)
    except BaseException:
        sock.close()
        raise
    target, dm = loaded.target, loaded.draft
    stopped = True  # False: a generation may still use the models
    try:
        config.validate(drafter, target.n_batch)
        model_id = server.model_id_of(loaded.target_name)
        speculation = ("target alone" if dm is None and drafter == "model"
                       else f"{drafter} drafts, {verifier} verifier")
        click.echo(f"localspec: serving {model_id} on {server.base_url(sock)}", err=True)
        click.echo(f"localspec: {speculation}; Ctrl-C stops", err=True)
        stopped = server.serve(target, dm, model_id=model_id, defaults=defaults, sock=sock,
                               verbose=logging.getLogger().getEffectiveLevel() <= logging.INFO)
    finally:
        sock.close()
        if stopped:
            target.close()
            if dm is not None:
                dm.close()
    click.echo("localspec: server stopped", err=True)


COMMANDS = (serve,)

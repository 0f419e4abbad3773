"""`deepinfer-serve`: a thin layer over `runtime.server.serve` (load the bundle once, then serve)."""

from __future__ import annotations

from pathlib import Path

import click

from deepinfer.cli_common import trust_option, trusted_key, user_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="Port to listen on (0: a free one; the URL printed at start names it).",
)
@click.option(
    "--max-queue",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Requests that may wait for a place in the running batch, beyond those its free rows take "
    "at the next step; more: HTTP 429 with Retry-After.",
)
@click.option("--model-name", default=None, help="The model's id in the API (default: the bundle directory's name).")
@click.option(
    "--num-kv-blocks",
    type=click.IntRange(min=2),
    default=None,
    help="Size of the KV block pool, block 0 being scratch (default: the bundle's num_blocks).",
)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Host threads for the executables.")
@click.option("--no-verify", is_flag=True, help="Skip the digest check of the bundle's files at load.")
@click.option(
    "--speculative",
    type=click.Choice(["dspark"]),
    default=None,
    help="Greedy requests (temperature 0) decode speculatively with the draft compiled into the bundle "
    "([speculative] draft in its model.toml): the same tokens as without. Sampled requests "
    "decode plainly. Single-rank bundles.",
)
@trust_option
@user_errors
def main(bundle, host, port, max_queue, model_name, num_kv_blocks, threads, no_verify, speculative, trust):
    """Serve BUNDLE over the OpenAI HTTP API with continuous batching.

    POST /v1/completions and /v1/chat/completions (stream: true for server-sent
    events), GET /v1/models, /health and /metrics (Prometheus). Requests join the
    running batch at step boundaries up to the largest batch bucket; the others wait
    in a queue of --max-queue. A multi-rank bundle starts one process per rank here
    (gloo), or runs under torchrun; this process (rank 0) serves.

    \b
    Example:
      deepinfer-serve build/tiny --port 8000
      curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 8}'
    """
    import torch

    from deepinfer.regions.tokenizer import for_bundle
    from deepinfer.runtime import open_bundle, ranks
    from deepinfer.runtime.server import serve
    from deepinfer.runtime.session import require_draft

    if threads:
        torch.set_num_threads(threads)
    opened = open_bundle(bundle, verify=not no_verify, trust=trusted_key(trust))
    if speculative:
        require_draft(opened)
    tokenizer = for_bundle(opened)
    world, launched = opened.manifest.topology.world_size, ranks.torchrun_rank()
    finish = lambda: None  # noqa: E731 (what ends the followers' loop)
    if world > 1 and launched is None:  # start the followers here: one process each
        leader = ranks.Leader(
            opened.path,
            world,
            num_kv_blocks=num_kv_blocks,
            verify=not no_verify,
            threads=threads,
            trust=str(trust) if trust else None,
        )
        session, finish = leader.session, leader.close
    else:
        session, comm = ranks.load_here(opened, launched, num_kv_blocks)
        if comm is not None and not comm.leader:
            return
        if comm is not None:
            finish = lambda: comm.step(None)  # noqa: E731

    def ready(url: str) -> None:
        click.echo(
            f"deepinfer-serve: {opened.path} as model {name!r} on {url} (batch up to {session.max_batch}, "
            f"queue {max_queue})"
        )

    name = model_name or opened.path.name
    try:
        serve(
            session,
            tokenizer,
            model=name,
            host=host,
            port=port,
            max_queue=max_queue,
            on_ready=ready,
            drafter=session.dspark() if speculative else None,
        )
    finally:
        finish()


if __name__ == "__main__":
    main()

"""`deepinfer-serve`: parse arguments, then `deepinfer.runtime.serve` (load the bundle once, then serve)."""

from __future__ import annotations

from pathlib import Path

import click

from deepinfer.cli_common import bundle_options, load_settings, user_errors
from deepinfer.runtime.cli import STEP_TOKENS_HELP

HTTP_LIMITS = ("max_body_bytes", "max_connections", "header_timeout_s", "body_timeout_s", "grace_s", "watchdog_s")
METRICS_INTERVAL_S = 10.0  # Ray Serve's: how often a handle reports its requests in flight (the window's least)
# --ray-serve's settings (RayServeOptions' fields)
RAY_SERVE_SETTINGS = (
    "replicas",
    "replica_cpus",
    "min_replicas",
    "max_replicas",
    "upscale_delay_s",
    "downscale_delay_s",
    "scaling_window_s",
)


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
    "--no-prefix-cache",
    is_flag=True,
    help="Do not share the KV blocks of prompt prefixes between requests (prefix caching is on otherwise, "
    "at every rank layout).",
)
@click.option(
    "--prefix-state-mib",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Slot state (window rings, partial groups) the prefix cache keeps per cached block on each rank, "
    "amortized: a state is kept with every k-th block, k the slot state over this; a hit then prefills "
    "at most k - 1 blocks again. `deepinfer plan` prints the slot state and k.",
)
@click.option(
    "--prefix-states-mib",
    type=click.FloatRange(min=0, min_open=True),
    default=1024.0,
    show_default=True,
    help="The most memory the prefix cache's kept slot states take on each rank (device memory beside "
    "the bundle's pools): past it the least recently kept or used state is dropped, its blocks staying "
    "cached (a hit then reaches an earlier kept state).",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(min=1),
    default=16 << 20,
    show_default=True,
    help="Largest request body; a larger one gets HTTP 413 (judged from Content-Length, or after reading "
    "no more than this).",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Open connections at most; one more gets HTTP 503 and is closed (a few past the cap may still GET /health).",
)
@click.option(
    "--header-timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds a connection has to send a request's headers (from its start or its last response); then it is cut.",
)
@click.option(
    "--body-timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    help="Seconds a request's body has to arrive whole; then HTTP 408 and the connection closes.",
)
@click.option(
    "--grace-s",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="At SIGTERM or SIGINT: seconds requests in flight get to finish (new ones get 503); any still "
    "open then end with a final chunk (finish_reason cancelled) and the server exits 0.",
)
@click.option(
    "--watchdog-s",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    help="/health answers 503 while the engine has work but has finished no step for this long (0: off).",
)
@click.option("--max-step-tokens", type=click.IntRange(min=1), default=None, metavar="N", help=STEP_TOKENS_HELP)
@click.option(
    "--ray-serve",
    metavar="ADDRESS",
    default=None,
    help="Serve --replicas replicas of the engine behind one endpoint (--host/--port) on Ray Serve, routed by "
    "prompt-prefix affinity: the cluster at ADDRESS (auto, HOST:PORT, or local: start one here). Each replica "
    "runs this command's other options on its node; the bundle's path must be the same on every node.",
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="With --ray-serve: replicas of the engine, each loading the bundle once (a multi-rank bundle's ranks "
    "stay one replica).",
)
@click.option(
    "--replica-cpus",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="With --ray-serve: CPUs a replica reserves.",
)
@click.option(
    "--min-replicas",
    type=click.IntRange(min=0),
    default=None,
    help="With --ray-serve: autoscale, Ray Serve adding replicas under load and removing idle ones down to this.",
)
@click.option(
    "--max-replicas", type=click.IntRange(min=1), default=None, help="With --ray-serve: autoscale up to this."
)
@click.option(
    "--upscale-delay-s",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="With --min/--max-replicas: how long the load must ask for more replicas before Ray Serve adds one.",
)
@click.option(
    "--downscale-delay-s",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="With --min/--max-replicas: how long the load must ask for fewer replicas before Ray Serve removes one.",
)
@click.option(
    "--scaling-window-s",
    type=click.FloatRange(min=METRICS_INTERVAL_S, min_open=True),
    default=30.0,
    show_default=True,
    help="With --min/--max-replicas: the requests in flight are averaged over this last window (longer than "
    "the 10 s at which the ingress reports them).",
)
@bundle_options
@user_errors
def main(
    bundle,
    host,
    port,
    max_queue,
    model_name,
    no_prefix_cache,
    prefix_state_mib,
    prefix_states_mib,
    max_step_tokens,
    ray_serve,
    **load,
):
    """Serve BUNDLE over the OpenAI HTTP API with continuous batching.

    POST /v1/completions and /v1/chat/completions (stream: true for server-sent
    events), GET /v1/models, /health and /metrics (Prometheus). Requests join the
    running batch at step boundaries up to the largest batch bucket; the others wait
    in a queue of --max-queue. A multi-rank bundle starts one process per rank here
    (gloo), or runs under torchrun; this process (rank 0) serves. With --speculative,
    sampled requests (temperature > 0) decode plainly. The address is bound first: a port
    in use or a bad host is refused in one line (exit status 2) before the bundle loads.

    \b
    Example:
      deepinfer-serve build/tiny --port 8000
      curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 8}'
      deepinfer-serve build/tiny --ray-serve local --replicas 2 --port 8000
    """
    settings = {k: load.pop(k) for k in RAY_SERVE_SETTINGS}  # --ray-serve's
    if ray_serve is not None:
        import sys

        from deepinfer.runtime.serving.ray_serve import RayServeOptions, replica_args, run

        valued = {o for p in main.params if not getattr(p, "is_flag", False) for o in p.opts if o.startswith("-")}
        scaling = RayServeOptions(ray_serve, **settings)
        return run(bundle, replica_args(sys.argv[1:], valued), scaling, host, port, click.echo)
    from deepinfer.runtime import ServeOptions, serve

    http = {k: load.pop(k) for k in HTTP_LIMITS}
    options = ServeOptions(
        **http,
        **load_settings(**load),
        host=host,
        port=port,
        max_queue=max_queue,
        model_name=model_name,
        prefix_cache=not no_prefix_cache,
        prefix_state_mib=prefix_state_mib,
        prefix_states_mib=prefix_states_mib,
        max_step_tokens=max_step_tokens,
        on_loading=lambda line: click.echo(line, err=True),
        on_ready=click.echo,
    )
    serve(bundle, options)


if __name__ == "__main__":
    main()

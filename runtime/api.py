"""Running a bundle: `generate` (a batch of prompts to completion) and `serve` (the OpenAI HTTP API).

Both hide where the ranks are: one rank loads in this process; a multi-rank bundle either starts
its ranks here, one process each (gloo), or, under torchrun, loads the rank torchrun made this
process (a follower runs the leader's steps until it ends). `deepinfer-run` and `deepinfer-serve`
parse their arguments into `RunOptions` / `ServeOptions` and call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from deepinfer.bundles.signing import trusted
from deepinfer.runtime.budget import check_budget
from deepinfer.runtime.bundle import Bundle, open_bundle, require_draft, tokenizer
from deepinfer.runtime.executor import Executor
from deepinfer.runtime.generation import generate_loaded
from deepinfer.runtime.options import LoadOptions, RunOptions, ServeOptions
from deepinfer.runtime.requests import Completions


def opened(bundle: Bundle | str | Path, options: LoadOptions) -> Bundle:
    """`bundle` opened as `options` say (an opened one as it is); a draft it lacks is refused here."""
    if not isinstance(bundle, Bundle):
        bundle = open_bundle(bundle, verify=options.verify, trust=trusted(options.trust))
    if options.speculative:
        require_draft(bundle)
    return bundle


def generate(bundle: Bundle | Executor | str | Path, prompts: Sequence[list[int]], options: RunOptions) -> Completions:
    """Greedy generation of token-id `prompts` on `bundle` (a path, an opened `Bundle`, or a loaded
    `Executor` to reuse) -> one `Completion` per prompt, in order, with the run's `stats`. A request
    that cannot get blocks fails alone (its `error` is set). Under torchrun, a follower rank returns
    an empty list once the leader has finished."""
    if isinstance(bundle, Executor):
        return generate_loaded(bundle, prompts, options)
    from deepinfer.runtime import ranks  # torch.distributed: only where a bundle is loaded

    _threads(options)
    b = opened(bundle, options)
    launched = ranks.torchrun_rank()
    if b.manifest.topology.world_size > 1 and launched is None:
        return ranks.generate_ranks(b, list(prompts), options)
    executor = ranks.load_here(b, launched, options)
    if executor is None:  # a follower: the leader has finished
        return Completions()
    try:
        return generate_loaded(executor, prompts, options)
    finally:
        executor.close()


def serve(bundle: Bundle | str | Path, options: ServeOptions) -> None:
    """Serve `bundle` over the OpenAI HTTP API on options.host:options.port until SIGINT or SIGTERM
    (see `runtime.serving.server.serve`); with several ranks this process leads them.

    The address is bound first, before anything of the bundle is read (a taken port or a bad host:
    `AddressError`, at once), and held through the load; `options.on_loading` gets a line naming what
    is loaded, `options.on_ready` the URL once it serves. A follower under torchrun binds nothing."""
    from deepinfer.runtime import ranks
    from deepinfer.runtime.serving.server import bind_address, listen_url
    from deepinfer.runtime.serving.server import serve as serve_http

    launched = ranks.torchrun_rank()
    sock = bind_address(options.host, options.port) if launched is None or launched[0] == 0 else None
    try:
        _threads(options)
        b = opened(bundle, options)
        check_budget(options.max_step_tokens, b.config.text.dspark_block_size if options.speculative else None)
        tok = tokenizer(b)
        if sock is not None and options.on_loading is not None:
            world = b.manifest.topology.world_size
            options.on_loading(
                f"deepinfer-serve: loading bundle {b.path} ({len(b.manifest.regions)} executables, "
                f"{world} rank{'s' if world > 1 else ''}) to serve on {listen_url(options.host, sock)} ..."
            )
        leader = None
        if b.manifest.topology.world_size > 1 and launched is None:  # start the followers here: one process each
            leader = ranks.Leader(b.path, b.manifest.topology.world_size, options)
            executor = leader.executor
        else:
            loaded = ranks.load_here(b, launched, options)
            if loaded is None:  # a follower: the leader has stopped serving
                return
            executor = loaded
        try:
            serve_http(executor, tok, options, sock)
        finally:
            if leader is not None:
                leader.close()
            elif executor.comm is not None:
                executor.comm.step(None)
    finally:
        if sock is not None:
            sock.close()


def _threads(options: LoadOptions) -> None:
    if options.threads:
        import torch

        torch.set_num_threads(options.threads)

"""`deepinfer-serve`'s HTTP side: the OpenAI API over an `Engine`, as a Starlette app under uvicorn.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as server-sent
events), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text), `POST /tokenize`,
`POST /detokenize`, `GET /tokenizer_info` and `GET /openapi.json` (`runtime/serving/openapi.py`). Bodies are
read within the limits of `runtime/serving/limits.py` (size, time, connections; 413, 408, 503) and checked
before they reach the engine (`runtime/serving/params.py`): a malformed body, an unknown model, a bad field
or a request that can never fit is a 400 (the model's with `code: model_not_found`) with OpenAI's
error body `{"error": {"message", "type", "param", "code"}}`; a full queue is a 429 with Retry-After.
A client that disconnects cancels its sequence. /health answers 503 while the server stops, after
its engine has stopped, or while the engine has work but makes no progress (`--watchdog-s`).

Chat messages render through the bundle tokenizer's chat template, within a time and size limit
(`regions/chat_template.py`). The tiny byte-level tokenizer has none; for it the server uses
`plain_chat`: each message as `<|role|>\\n` + its content + `\\n`, then `<|assistant|>\\n`, after bos.

`response_format` (JSON) and forced tool calls hold the output to a grammar (`runtime/serving/grammars.py`,
masks applied by the scheduler); `tools` reach the chat template, and calls are parsed out of the
output (`runtime/serving/tool_calls.py`) into `tool_calls`, streamed one delta per call. How the text leaves:
`runtime/serving/responses.py`; the routes, one function per group: `runtime/serving/routes.py`.
"""

from __future__ import annotations

import errno
import json

from deepinfer.errors import DeepinferError
from deepinfer.regions.prefix import StatePolicy, state_every
from deepinfer.runtime.executor import Executor, Stats
from deepinfer.runtime.options import ServeOptions
from deepinfer.runtime.serving.engine import Engine, EngineStopped
from deepinfer.runtime.serving.limits import FLUSH_S, Gate, Limits, Stopping, guarded_protocol
from deepinfer.runtime.serving.metrics import Metrics
from deepinfer.runtime.serving.params import error_body
from deepinfer.runtime.serving.routes import Served, generation_routes, service_routes, tokenizer_routes
from deepinfer.runtime.slot_store import slot_bytes
from deepinfer.units import human

__all__ = ["AddressError", "Served", "bind_address", "create_app", "serve"]

MIB = 1 << 20


def create_app(served: Served, gate: Gate | None = None):
    """The Starlette application of `served` (its /health asks `gate`: by default the engine's own)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse

    gate = gate or Gate(served.engine)

    async def failed(request, exc: Exception):
        # a bug, not a refusal: still one line in OpenAI's error body (the traceback goes to the log)
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}".splitlines()[0], "server_error"), 500)

    return Starlette(
        exception_handlers={Exception: failed},
        routes=[*generation_routes(served), *service_routes(served, gate), *tokenizer_routes(served)],
    )


def serve(executor: Executor, tokenizer, options: ServeOptions, sock=None) -> None:
    """Serve `executor` (a loaded bundle: the leader of its ranks) on options.host:options.port until
    SIGINT or SIGTERM; with options.speculative, greedy requests decode with the bundle's draft.

    Listens on `sock` (from `bind_address`, bound before the load; None: binds here; port 0: a free
    port; `options.on_ready` gets a line naming the bound URL), then runs the engine on its own thread
    and uvicorn on this one, within the limits of `runtime/serving/limits.py`.
    A stop signal is graceful (`limits.Stopping`: open requests get `options.grace_s`, then end with a
    final chunk); the engine stops after. If the engine's thread stops on an error, so does the server:
    EngineStopped (the CLI's one line and exit status 2)."""
    import signal
    import threading

    model = options.model_name or executor.path.name
    engine, max_batch, prefix = _engine(executor, options, model)
    gate = Gate(engine, options.watchdog_s)
    app = create_app(Served(engine, tokenizer, model, executor.config.text.vocab_size), gate)
    sock = sock or bind_address(options.host, options.port)
    sock.listen(BACKLOG)
    thread = threading.Thread(target=engine.run, name="deepinfer-engine", daemon=True)
    thread.start()
    server = _server(app, gate, options)

    def stopped(signum, frame):
        raise _Stopped(signum)

    # a second stop signal makes uvicorn stop at once, then raise the signal again under the handlers
    # it found: these make that a clean return (the engine, and a multi-rank bundle's followers, are
    # stopped by the callers' cleanup), not a death by signal that skips it
    previous = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if options.on_ready is not None:
            options.on_ready(
                f"deepinfer-serve: {executor.path} as model {model!r} on {listen_url(options.host, sock)} "
                f"(batch up to {max_batch}, queue {options.max_queue}, prefix cache {prefix})"
            )
        server.run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.close()
        thread.join(timeout=JOIN_S)
        sock.close()
    if engine.dead is not None:
        raise EngineStopped(f"deepinfer-serve: the engine stopped: {engine.dead}")


def _engine(executor: Executor, options: ServeOptions, model: str) -> tuple[Engine, int, str]:
    """The engine over `executor`'s steps (and its draft, with options.speculative), its metrics
    labelled with the served `model` -> (it, the largest batch a step takes, its prefix cache in words)."""
    stats = Stats()
    steps = executor.steps(stats)
    drafter = executor.dspark(stats) if options.speculative else None
    state = slot_bytes(executor)
    policy = StatePolicy(  # a state kept every k-th block, and as many as the states' bound holds
        state_every(state, int(options.prefix_state_mib * MIB)),
        max(1, int(options.prefix_states_mib * MIB) // max(1, state)),
    )
    engine = Engine(
        steps,
        eos=executor.config.eos_token_id,
        max_queue=options.max_queue,
        drafter=drafter,
        prefix_cache=options.prefix_cache,
        prefix_states=policy,
        max_step_tokens=options.max_step_tokens,
        metrics=Metrics.new(model),
    )
    kept = (
        f"on, a slot state of {human(state)} kept every {policy.every} block(s), {policy.max_states} at most"
        if options.prefix_cache
        else "off"
    )
    return engine, steps.max_batch, kept


class AddressError(DeepinferError):
    """--host/--port name no address this process can listen on (taken, unresolvable, not local)."""


def bind_address(host: str, port: int):
    """A socket bound to host:port, not yet listening (port 0: a free port, read back from the socket):
    bound before the bundle loads, so that a taken port or a bad host is refused at once, and held, so
    that nothing takes the address meanwhile (a client connecting during the load is refused, not
    queued). A bad address: AddressError, one line."""
    import socket

    where = f"--host {json.dumps(host)} --port {port}"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except socket.gaierror as e:
        sock.close()
        raise AddressError(f"{where}: the host does not resolve to an address ({e.strerror})") from None
    except (ValueError, TypeError, OSError) as e:  # a host idna cannot encode, or holding NUL
        sock.close()
        reason = str(e).splitlines()[0] if e.args else type(e).__name__
        if isinstance(e, OSError):
            reason = _LISTEN_ERRORS.get(e.errno or 0) or e.strerror or reason
        raise AddressError(f"{where}: cannot listen there: {reason}") from None
    return sock


_LISTEN_ERRORS: dict[int, str] = {
    errno.EADDRINUSE: "the address is in use (another process listens there; pick another --port, or --port 0 "
    "for a free one)",
    errno.EADDRNOTAVAIL: "the host is not an address of this machine",
    errno.EACCES: "this user may not listen on that port",
}


def listen_url(host: str, sock) -> str:
    """The URL of `sock`, bound on `host` (the port it got, for port 0)."""
    bound = sock.getsockname()[1]
    return f"http://{host}:{bound}" if ":" not in host else f"http://[{host}]:{bound}"


def _server(app, gate: Gate, options: ServeOptions) -> Stopping:
    """uvicorn over `app`, within the HTTP limits of `options` (body, headers, connections, grace)."""
    import uvicorn

    config = uvicorn.Config(
        Limits(app, gate, options.max_body_bytes, options.body_timeout_s),
        http=guarded_protocol(options.max_connections, options.header_timeout_s),
        loop="asyncio",  # the loop the limits are written and tested on, whether or not uvloop is installed
        log_level="warning",
        timeout_graceful_shutdown=FLUSH_S,
        lifespan="off",
    )
    return Stopping(config, gate, options.grace_s)


class _Stopped(Exception):
    """A second stop signal, after uvicorn's shutdown."""


BACKLOG = 128  # connections the kernel queues before uvicorn accepts them
JOIN_S = 10  # seconds the engine's thread gets to end its step at shutdown

"""`deepinfer-serve`'s HTTP side: the OpenAI API over an `Engine`, as a Starlette app under uvicorn.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as server-sent
events), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text), `POST /tokenize`,
`POST /detokenize`, `GET /tokenizer_info` and `GET /openapi.json` (`runtime/openapi.py`). Bodies are
read within the limits of `runtime/limits.py` (size, time, connections; 413, 408, 503) and checked
before they reach the engine (`runtime/bodies.py`): a malformed body, an unknown model, a bad field
or a request that can never fit is a 400 (the model's with `code: model_not_found`) with OpenAI's
error body `{"error": {"message", "type", "param", "code"}}`; a full queue is a 429 with Retry-After.
A client that disconnects cancels its sequence. /health answers 503 while the server stops, after
its engine has stopped, or while the engine has work but makes no progress (`--watchdog-s`).

Chat messages render through the bundle tokenizer's chat template, within a time and size limit
(`regions/chat_template.py`). The tiny byte-level tokenizer has none; for it the server uses
`plain_chat`: each message as `<|role|>\\n` + its content + `\\n`, then `<|assistant|>\\n`, after bos.

`response_format` (JSON) and forced tool calls hold the output to a grammar (`runtime/structured.py`,
masks applied by the scheduler); `tools` reach the chat template, and calls are parsed out of the
output (`runtime/tools.py`) into `tool_calls`, streamed one delta per call. How the text leaves:
`runtime/output.py`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from deepinfer.runtime.bodies import BadRequest, Bodies, Params, body_field, error_body, parse_body
from deepinfer.runtime.engine import Engine, EngineStopped, QueueFull
from deepinfer.runtime.executor import Executor, Stats
from deepinfer.runtime.limits import FLUSH_S, Gate, Limits, Stopping, guarded_protocol
from deepinfer.runtime.logprobs import Entry, chat_format, legacy_format
from deepinfer.runtime.openapi import document
from deepinfer.runtime.options import ServeOptions
from deepinfer.runtime.output import Choice, TextStream, collect, sse
from deepinfer.runtime.process import ServerProcess
from deepinfer.runtime.requests import Completion, Request
from deepinfer.runtime.tools import parse_output

__all__ = ["BadRequest", "Served", "ServerProcess", "TextStream", "create_app", "serve"]

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class Served(Bodies):
    """What the routes share: `Bodies` (the engine, the tokenizer, the model's name and limits) and
    how a request's choices start."""

    def start(self, p: Params) -> tuple[list[Request], list[Completion], asyncio.Queue]:
        """Submit a request's n choices, one sequence each -> (them, their outputs as they grow, the
        queue of their events: `Choice`'s). None is left queued when one is refused (QueueFull)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue[tuple]()

        def put(item):
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the event loop closed under a shutdown
                pass

        echo: tuple[str, list[int]] = ("", [])
        if p.echo:  # the prompt as the tokenizer decodes it, and where each token's text begins
            prompt = TextStream(self.tokenizer.decode, [])
            for token in p.prompt:
                prompt.push(token)
            prompt.take(final=True)
            echo = (prompt.text, prompt.offsets)
        jobs, outs = [], []
        try:
            for i in range(p.n):
                c = Choice(i, p, self.tokenizer, put, echo)
                on_logits = c.recorder.on_logits if c.recorder is not None else None
                constraint = self.grammars.constraint(p.grammar) if p.grammar is not None else None
                job = Request(
                    p.prompt,
                    p.max_tokens,
                    c.on_token,
                    c.on_finish,
                    p.sampling_of(i),
                    on_logits=on_logits,
                    constraint=constraint,
                )
                outs.append(self.engine.submit(job))
                jobs.append(job)
        except QueueFull:
            for job in jobs:
                self.engine.cancel(job)
            raise
        return jobs, outs, events


def create_app(served: Served, gate: Gate | None = None):
    """The Starlette application of `served` (its /health asks `gate`: by default the engine's own)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    gate = gate or Gate(served.engine)

    def refuse(e: BadRequest | QueueFull) -> JSONResponse:
        if isinstance(e, QueueFull):
            served.engine.metrics.requests.labels("queue_full").inc()
            return JSONResponse(
                error_body(str(e), "rate_limit_exceeded", code="queue_full"),
                status_code=429,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        served.engine.metrics.requests.labels("bad_request").inc()
        return JSONResponse(error_body(str(e), "invalid_request_error", e.param, e.code), status_code=400)

    async def body_of(request: HttpRequest) -> dict:
        # read whole already (runtime/limits.py: capped, timed); parsed off the event loop, bounded
        return await run_in_threadpool(parse_body, await request.body())

    async def generate(request: HttpRequest, chat: bool):
        try:
            body = await body_of(request)
            # off the event loop: a chat template renders, a schema compiles to a grammar (up to ~0.1 s for
            # a large one; the first one builds the grammar engine's tokenizer), while other streams flow
            p = await run_in_threadpool(served.request_params, body, chat)
            jobs, outs, events = served.start(p)
        except (BadRequest, QueueFull) as e:
            return refuse(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": served.model,
        }

        def usage() -> dict:
            n = sum(len(out.generated) for out in outs)
            return {
                "prompt_tokens": len(p.prompt),
                "completion_tokens": n,
                "total_tokens": len(p.prompt) + n,
                "prompt_tokens_details": {"cached_tokens": outs[0].cached_tokens},
            }

        def logprobs(items: list[Entry]) -> dict | None:
            if p.logprobs is None:
                return None
            return (chat_format if chat else legacy_format)(items, served.tokenizer.token_bytes)

        if p.stream:
            return StreamingResponse(
                sse(served.engine, jobs, events, head, chat, p.include_usage, usage, logprobs, p.call_names),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        collected = await collect(served.engine, request, jobs, events)
        if collected is None:  # the client left; it reads nothing
            return Response(status_code=499)
        choices = []
        for i, (text, items, finish, error) in enumerate(collected):
            if finish == "error":
                return JSONResponse(error_body(error, "server_error"), status_code=500)
            reason = finish
            if not chat:
                choices.append({"index": i, "text": text})
            elif p.call_names is None:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}})
            else:
                content, calls = parse_output(text, p.call_names)
                message: dict[str, Any] = {"role": "assistant", "content": content or None}
                if calls:
                    message["tool_calls"] = [c.message() for c in calls]
                    reason = "tool_calls" if reason == "stop" else reason
                choices.append({"index": i, "message": message})
            choices[-1].update(logprobs=logprobs(items), finish_reason=reason)
        return JSONResponse({**head, "choices": choices, "usage": usage()})

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    async def models(request):
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": served.model,
                        "object": "model",
                        "created": served.created,
                        "owned_by": "deepinfer",
                        "max_model_len": served.engine.max_context,
                    }
                ],
            }
        )

    async def health(request):
        why = gate.health()
        if why is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", **error_body(why, "service_unavailable")}, status_code=503)

    async def openapi(request):
        return JSONResponse(document(served.model))

    async def tokenize(request):
        try:
            body = await body_of(request)
            text = body.get("prompt")
            if not isinstance(text, str):
                raise BadRequest("prompt: expected a string", "prompt")
            bos = body_field(body, "add_special_tokens", bool, True)
            served.text_fits(text, "prompt")
        except BadRequest as e:
            return refuse(e)
        ids = await run_in_threadpool(served.tokenizer.encode, text, bos)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": served.engine.max_context})

    async def detokenize(request):
        try:
            body = await body_of(request)
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise BadRequest("tokens: expected a list of token ids", "tokens")
            bad = [i for i in ids if not 0 <= i < served.vocab]
            if bad:
                raise BadRequest(f"token ids {bad[:8]} are outside the vocabulary [0, {served.vocab})", "tokens")
        except BadRequest as e:
            return refuse(e)
        return JSONResponse({"prompt": served.tokenizer.decode(ids)})

    async def tokenizer_info(request):
        # special tokens have no text here (decode leaves them out): a client takes its stops elsewhere
        return JSONResponse(
            {
                "tokenizer_class": served.tokenizer.kind,
                "bos_token": None,
                "eos_token": None,
                "pad_token": None,
                "chat_template": None,
                "model_max_length": served.engine.max_context,
            }
        )

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(served.engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def failed(request, exc: Exception):
        # a bug, not a refusal: still one line in OpenAI's error body (the traceback goes to the log)
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}".splitlines()[0], "server_error"), 500)

    return Starlette(
        exception_handlers={Exception: failed},
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
    )


def serve(executor: Executor, tokenizer, options: ServeOptions) -> None:
    """Serve `executor` (a loaded bundle: the leader of its ranks) on options.host:options.port until
    SIGINT or SIGTERM; with options.speculative, greedy requests decode with the bundle's draft.

    Binds first (port 0: a free port; `options.on_ready` gets a line naming the bound URL), then runs
    the engine on its own thread and uvicorn on this one, within the limits of `runtime/limits.py`. A
    stop signal is graceful (`limits.Stopping`: open requests get `options.grace_s`, then end with a
    final chunk); the engine stops after. If the engine's thread stops on an error, so does the server:
    EngineStopped (the CLI's one line and exit status 2)."""
    import signal
    import socket
    import threading

    import uvicorn

    stats = Stats()
    steps = executor.steps(stats)
    drafter = executor.dspark(stats) if options.speculative else None
    prefix_cache = options.prefix_cache and executor.comm is None  # a slot's state is saved on one rank
    engine = Engine(
        steps, eos=executor.config.eos_token_id, max_queue=options.max_queue, drafter=drafter, prefix_cache=prefix_cache
    )
    model = options.model_name or executor.path.name
    gate = Gate(engine, options.watchdog_s)
    app = create_app(Served(engine, tokenizer, model, executor.config.text.vocab_size), gate)
    host, port = options.host, options.port
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    thread = threading.Thread(target=engine.run, name="deepinfer-engine", daemon=True)
    thread.start()
    bound = sock.getsockname()[1]
    config = uvicorn.Config(
        Limits(app, gate, options.max_body_bytes, options.body_timeout_s),
        http=guarded_protocol(options.max_connections, options.header_timeout_s),
        log_level="warning",
        timeout_graceful_shutdown=FLUSH_S,
        lifespan="off",
    )
    server = Stopping(config, gate, options.grace_s)

    def stopped(signum, frame):
        raise _Stopped(signum)

    # a second stop signal makes uvicorn stop at once, then raise the signal again under the handlers
    # it found: these make that a clean return (the engine, and a multi-rank bundle's followers, are
    # stopped by the callers' cleanup), not a death by signal that skips it
    previous = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = f"http://{host}:{bound}" if ":" not in host else f"http://[{host}]:{bound}"
        if options.on_ready is not None:
            options.on_ready(
                f"deepinfer-serve: {executor.path} as model {model!r} on {url} (batch up to {steps.max_batch}, "
                f"queue {options.max_queue}, prefix cache {'on' if prefix_cache else 'off'})"
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


class _Stopped(Exception):
    """A second stop signal, after uvicorn's shutdown."""


BACKLOG = 128  # connections the kernel queues before uvicorn accepts them
JOIN_S = 10  # seconds the engine's thread gets to end its step at shutdown

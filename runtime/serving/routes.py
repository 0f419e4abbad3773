"""`deepinfer-serve`'s routes over a `Served`, one function per group, each returning its Starlette routes:

- `generation_routes`: `POST /v1/completions` and `POST /v1/chat/completions` (whole, or streamed as
  server-sent events with `stream: true`);
- `service_routes`: `GET /v1/models`, `GET /health` (asks the `Gate`), `GET /metrics`, `GET /openapi.json`;
- `tokenizer_routes`: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

A refusal is OpenAI's error body: 400 for a bad request (`BadRequest`), 429 with Retry-After for a
full queue. `runtime/serving/server.py` puts the groups in one app.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deepinfer.runtime.requests import Completion, Request
from deepinfer.runtime.serving.engine import QueueFull
from deepinfer.runtime.serving.limits import Gate
from deepinfer.runtime.serving.logprobs import Entry, chat_format, legacy_format
from deepinfer.runtime.serving.openapi import document
from deepinfer.runtime.serving.params import BadRequest, Bodies, Params, body_field, error_body, parse_body
from deepinfer.runtime.serving.responses import Choice, TextStream, collect, sse
from deepinfer.runtime.serving.tool_calls import parse_output
from deepinfer.runtime.serving.values import shown

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


def refuse(served: Served, e: BadRequest | QueueFull) -> JSONResponse:
    """A refused request's answer: 429 for a full queue, 400 for a bad request (counted either way)."""
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
    # read whole already (runtime/serving/limits.py: capped, timed); parsed off the event loop, bounded
    return await run_in_threadpool(parse_body, await request.body())


# -- generation ---------------------------------------------------------------------------------


def generation_routes(served: Served) -> list[Route]:
    """`POST /v1/completions` and `POST /v1/chat/completions`."""

    async def completions(request):
        return await generate(served, request, chat=False)

    async def chat_completions(request):
        return await generate(served, request, chat=True)

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


async def generate(served: Served, request: HttpRequest, chat: bool) -> Response:
    """One generation request: checked, started, then answered whole or streamed."""
    try:
        body = await body_of(request)
        # off the event loop: a chat template renders, a schema compiles to a grammar (up to ~0.1 s for
        # a large one; the first one builds the grammar engine's tokenizer), while other streams flow
        p = await run_in_threadpool(served.request_params, body, chat)
        jobs, outs, events = served.start(p)
    except (BadRequest, QueueFull) as e:
        return refuse(served, e)
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
        choice, reason = whole_choice(i, text, finish, chat, p.call_names)
        choices.append({**choice, "logprobs": logprobs(items), "finish_reason": reason})
    return JSONResponse({**head, "choices": choices, "usage": usage()})


def whole_choice(i: int, text: str, finish: str, chat: bool, call_names: set[str] | None) -> tuple[dict, str]:
    """Choice i of a generation answered whole -> (it, its finish_reason): a completion's text, or a chat
    message, its tool calls parsed out when the request has tools (then `tool_calls` is why it stopped)."""
    if not chat:
        return {"index": i, "text": text}, finish
    if call_names is None:
        return {"index": i, "message": {"role": "assistant", "content": text}}, finish
    content, calls = parse_output(text, call_names)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [c.message() for c in calls]
        finish = "tool_calls" if finish == "stop" else finish
    return {"index": i, "message": message}, finish


# -- the service --------------------------------------------------------------------------------


def service_routes(served: Served, gate: Gate) -> list[Route]:
    """`GET /v1/models`, `GET /health` (what `gate` says), `GET /metrics` and `GET /openapi.json`."""

    async def models(request):
        model = {
            "id": served.model,
            "object": "model",
            "created": served.created,
            "owned_by": "deepinfer",
            "max_model_len": served.engine.max_context,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def health(request):
        why = gate.health()
        if why is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", **error_body(why, "service_unavailable")}, status_code=503)

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(served.engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def openapi(request):
        return JSONResponse(document(served.model))

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]


# -- the tokenizer ------------------------------------------------------------------------------


def tokenizer_routes(served: Served) -> list[Route]:
    """`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`."""

    async def tokenize(request):
        try:
            body = await body_of(request)
            text = body.get("prompt")
            if not isinstance(text, str):
                raise BadRequest("prompt: expected a string", "prompt")
            bos = body_field(body, "add_special_tokens", bool, True)
            served.text_fits(text, "prompt")
        except BadRequest as e:
            return refuse(served, e)
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
                raise BadRequest(f"token ids {shown(bad[:8])} are outside the vocabulary [0, {served.vocab})", "tokens")
        except BadRequest as e:
            return refuse(served, e)
        return JSONResponse({"prompt": served.tokenizer.decode(ids)})

    async def tokenizer_info(request):
        # special tokens have no text here (decode leaves them out): a client takes its stops elsewhere
        info = {
            "tokenizer_class": served.tokenizer.kind,
            "bos_token": None,
            "eos_token": None,
            "pad_token": None,
            "chat_template": None,
            "model_max_length": served.engine.max_context,
        }
        return JSONResponse(info)

    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ]

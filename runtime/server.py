"""`deepinfer-serve`'s HTTP side: the OpenAI API over an `Engine`, as a Starlette app under uvicorn.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream: true` as server-sent events), `GET /v1/models`, `GET /health` and
`GET /metrics` (Prometheus text). Requests are checked before they reach the
engine: a malformed body, an unknown model, a bad field or a request that can
never fit is a 400 (the model's with `code: model_not_found`) with OpenAI's error
body `{"error": {"message", "type", "param", "code"}}`; a full queue is a 429
with Retry-After. A client that disconnects cancels its sequence.

Chat messages render through the bundle tokenizer's chat template. The tiny
byte-level tokenizer has none; for it the server uses `plain_chat`: each
message as `<|role|>\\n` + its content + `\\n`, then `<|assistant|>\\n`, after bos.

Text leaves as it is decoded (`TextStream`): stop strings are found in the text,
which is cut before the first one, and a streamed delta holds back the text
that could still begin a stop string or a multi-byte character.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepinfer.runtime.engine import Engine, QueueFull, RequestError
from deepinfer.runtime.executor import Executor, Stats
from deepinfer.runtime.options import ServeOptions
from deepinfer.runtime.schedule import Completion, Request, Sampling

RETRY_AFTER_S = 1  # what a 429 tells the client to wait
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_STOPS = 4  # OpenAI's limit on stop strings


def plain_chat(messages: list[dict]) -> str:
    """The chat format of the byte-level tokenizer, which ships no template (see the module's docstring)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class BadRequest(Exception):
    """A request the server refuses before it reaches the engine."""

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class TextStream:
    """Generated token ids -> text, cut at the first stop string, in deltas safe to send.

    Decoding runs over a window of recent ids (the text of ids[prefix:] less that of
    ids[prefix:read]), so each token costs a few ids' decode, not the whole sequence's; a
    window whose text ends in U+FFFD (a character still incomplete) waits for the next token."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, token: int) -> bool:
        """Add a token; True when the text now holds a stop string (the text ends before it)."""
        if self.stopped:
            return True
        self.ids.append(token)
        new = self.decode(self.ids[self.prefix :])
        old = self.decode(self.ids[self.prefix : self.read])
        if len(new) > len(old) and not new.endswith("\ufffd"):
            self._append(new[len(old) :])
            self.prefix, self.read = self.read, len(self.ids)
        return self.stopped

    def _append(self, delta: str) -> None:
        start = len(self.text)
        self.text += delta
        cut = None
        for s in self.stops:
            at = self.text.find(s, max(0, start - len(s) + 1))
            if at >= 0 and (cut is None or at < cut):
                cut = at
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True

    def take(self, final: bool = False) -> str:
        """The text not sent yet that is safe to send; `final` (the sequence ended) sends the rest."""
        if final and not self.stopped:
            tail = self.decode(self.ids[self.prefix :])[len(self.decode(self.ids[self.prefix : self.read])) :]
            if tail:
                self._append(tail)
                self.prefix = self.read = len(self.ids)
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._held()
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the text's longest suffix that begins a stop string."""
        for n in range(min(len(self.text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stops):
                return n
        return 0


@dataclass(frozen=True)
class Params:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stops: list[str]
    stream: bool
    include_usage: bool


class Served:
    """What the routes share: the engine, the tokenizer and the model's name and limits."""

    def __init__(self, engine: Engine, tokenizer, model: str, vocab: int):
        self.engine, self.tokenizer, self.model, self.vocab = engine, tokenizer, model, vocab
        self.created = int(time.time())

    # -- request bodies -----------------------------------------------------------------------

    def params(self, body: dict, prompt: list[int], default_max: int) -> Params:
        if body.get("model") != self.model:
            raise BadRequest(
                f"The model {body.get('model')!r} does not exist; this server serves {self.model!r}",
                "model",
                code="model_not_found",
            )
        n = _field(body, "n", int, 1)
        if n != 1:
            raise BadRequest(f"n is {n}; this server returns one choice per request (n = 1)", "n")
        for name, harmless in (
            ("logprobs", (None, False)),
            ("top_logprobs", (None, 0)),
            ("best_of", (None, 1)),
            ("suffix", (None, "")),
        ):
            if body.get(name) not in harmless:
                raise BadRequest(f"{name} is not supported by this server", name)
        bad = [i for i in prompt if not 0 <= i < self.vocab]
        if bad:
            raise BadRequest(f"token ids {bad[:8]} are outside the vocabulary [0, {self.vocab})", "prompt")
        max_tokens = _field(body, "max_tokens", int, None)
        if max_tokens is None:
            max_tokens = _field(body, "max_completion_tokens", int, default_max)
        temperature = _field(body, "temperature", float, 0.0)
        top_p = _field(body, "top_p", float, 1.0)
        top_k = _field(body, "top_k", int, 0)
        if not 0 <= temperature <= 2:
            raise BadRequest(f"temperature is {temperature}; expected a number in [0, 2]", "temperature")
        if not 0 < top_p <= 1:
            raise BadRequest(f"top_p is {top_p}; expected a number in (0, 1]", "top_p")
        if top_k < -1:
            raise BadRequest(f"top_k is {top_k}; expected -1 or 0 (every token) or a positive count", "top_k")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
            raise BadRequest(f"stop is {stop!r}; expected a non-empty string or a list of at most {MAX_STOPS}", "stop")
        stream = _field(body, "stream", bool, False)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("stream_options: expected an object", "stream_options")
        try:
            self.engine.check(len(prompt), max_tokens)
        except RequestError as e:
            raise BadRequest(str(e), e.param, code=e.code) from None
        return Params(
            prompt,
            max_tokens,
            Sampling(temperature, top_p, max(top_k, 0), _field(body, "seed", int, None)),
            stops,
            stream,
            bool(options.get("include_usage")),
        )

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            return prompt
        raise BadRequest("prompt: expected a string or a list of token ids (one prompt per request)", "prompt")

    def chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: expected a non-empty list of {role, content}", "messages")
        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}]: expected an object with a string role", f"messages[{i}]")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
                ):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", f"messages[{i}]")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content: expected a string or a list of text parts", f"messages[{i}]")
            plain.append({"role": m["role"], "content": content})
        if self.tokenizer.kind == "byte":
            return self.tokenizer.encode(plain_chat(plain))
        from deepinfer.errors import DeepinferError

        try:
            return self.tokenizer.chat(plain)
        except DeepinferError as e:  # the template's own raise_exception, or no template
            raise BadRequest(str(e), "messages") from None

    # -- generation ---------------------------------------------------------------------------

    def start(self, p: Params) -> tuple[Request, Completion, asyncio.Queue]:
        """Submit a request -> (it, its output as it grows, its events' queue): ("text", delta) ... then
        ("done", reason, error)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue[tuple]()
        text = TextStream(self.tokenizer.decode, p.stops)

        def put(item):
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the event loop closed under a shutdown
                pass

        def on_token(token: int) -> bool:
            stop = text.push(token)
            if p.stream:
                delta = text.take()
                if delta:
                    put(("text", delta))
            return stop

        def on_finish(reason: str, error: str | None) -> None:
            put(("text", text.take(final=True)))
            put(("done", reason, error))

        request = Request(p.prompt, p.max_tokens, on_token, on_finish, p.sampling)
        return request, self.engine.submit(request), events


def _field(body: dict, name: str, kind: type, default):
    """body[name] as `kind` (int accepts no bool or float; float accepts an int), or `default` when absent/null."""
    value = body.get(name)
    if value is None:
        return default
    accepted = {bool: (bool,), int: (int,), float: (int, float)}[kind]
    if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
        expected = {bool: "a boolean", int: "an integer", float: "a number"}[kind]
        raise BadRequest(f"{name} is {value!r}; expected {expected}", name)
    if kind is float:
        assert isinstance(value, (int, float))  # accepted above
        return float(value)
    return value


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def create_app(served: Served):
    """The Starlette application of `served`."""
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

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
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    async def generate(request: HttpRequest, chat: bool):
        try:
            body = await body_of(request)
            prompt = served.chat_prompt(body) if chat else served.completion_prompt(body)
            p = served.params(
                body, prompt, served.engine.max_context - len(prompt) + 1 if chat else DEFAULT_COMPLETION_TOKENS
            )
            job, out, events = served.start(p)
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
            n = len(out.generated)
            return {
                "prompt_tokens": len(p.prompt),
                "completion_tokens": n,
                "total_tokens": len(p.prompt) + n,
                "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
            }

        if p.stream:
            return StreamingResponse(
                _sse(served, job, events, head, chat, p.include_usage, usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        text, done = await _collect(served, request, job, events)
        if done is None:  # the client left; it reads nothing
            return Response(status_code=499)
        _, reason, error = done
        if reason == "error":
            return JSONResponse(error_body(error, "server_error"), status_code=500)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            if chat
            else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        )
        return JSONResponse({**head, "choices": [choice], "usage": usage()})

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
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(served.engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )


async def _collect(served: Served, request, job: Request, events: asyncio.Queue):
    """A whole generation's text and its ("done", reason, error), or (text, None) when the client
    disconnected first (the sequence is then cancelled)."""

    async def gather():
        parts = []
        while (item := await events.get())[0] == "text":
            parts.append(item[1])
        return "".join(parts), item

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({result, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if result.done():
        return result.result()
    result.cancel()
    served.engine.cancel(job)
    return "", None


async def _sse(
    served: Served,
    job: Request,
    events: asyncio.Queue,
    head: dict,
    chat: bool,
    include_usage: bool,
    usage: Callable[[], dict],
):
    """Server-sent events of one streamed generation; leaving early (the client disconnected) cancels it."""
    kind = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    def event(data: Any) -> str:
        return f"data: {json.dumps(data)}\n\n"

    def chunk(text: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return event({**kind, "choices": [choice], **({"usage": None} if include_usage else {})})

    finished = False
    try:
        if chat:
            yield chunk(None, None, first=True)
        while True:
            item = await events.get()
            if item[0] == "text":
                if item[1]:
                    yield chunk(item[1], None)
                continue
            finished = True
            _, reason, error = item
            if reason == "error":
                yield event(error_body(error, "server_error"))
            else:
                yield chunk(None, reason)
                if include_usage:
                    yield event({**kind, "choices": [], "usage": usage()})
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:
            served.engine.cancel(job)


def serve(executor: Executor, tokenizer, options: ServeOptions) -> None:
    """Serve `executor` (a loaded bundle: the leader of its ranks) on options.host:options.port until
    SIGINT or SIGTERM; with options.speculative, greedy requests decode with the bundle's draft.

    Binds first (port 0: a free port; `options.on_ready` gets a line naming the bound URL), then runs
    the engine on its own thread and uvicorn on this one. At shutdown uvicorn lets open requests end
    (at most `GRACE_S`), then the engine stops, cancelling what is left."""
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
    app = create_app(Served(engine, tokenizer, model, executor.config.text.vocab_size))
    host, port = options.host, options.port
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    thread = threading.Thread(target=engine.run, name="deepinfer-engine", daemon=True)
    thread.start()
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACE_S, lifespan="off"))

    def stopped(signum, frame):
        raise _Stopped(signum)

    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again under the handlers
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
        thread.join(timeout=GRACE_S)
        sock.close()


class _Stopped(Exception):
    """A stop signal, after uvicorn's graceful shutdown."""


BACKLOG = 128  # connections the kernel queues before uvicorn accepts them
GRACE_S = 10  # seconds open requests get to end at shutdown


class ServerProcess:
    """`deepinfer-serve BUNDLE --port 0 ARGS` in a subprocess on 127.0.0.1, for tests and benchmarks:
    `url` is read from its first line (the port it bound; no race for a free port); every wait is
    bounded; `stop` sends SIGTERM, then kills after `timeout_s`."""

    def __init__(self, bundle, *args: str, start_timeout_s: float = 300.0, env: dict | None = None):
        import os
        import queue
        import re
        import subprocess
        import sys
        import threading

        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deepinfer.runtime.serve_cli",
                str(bundle),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        lines: queue.Queue = queue.Queue()
        stdout = self.proc.stdout
        assert stdout is not None  # stdout=PIPE

        def read() -> None:
            for line in stdout:
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        try:
            first = lines.get(timeout=start_timeout_s)
        except queue.Empty:
            self.stop()
            raise TimeoutError(f"deepinfer-serve printed nothing in {start_timeout_s:.0f} s") from None
        found = re.search(r" on (http://127\.0\.0\.1:\d+) ", first)
        if not found:
            self.stop()
            raise RuntimeError(f"deepinfer-serve: {first!r} {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.url = found.group(1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 30.0) -> int:
        """Stop the server; its exit status."""
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        return self.proc.returncode

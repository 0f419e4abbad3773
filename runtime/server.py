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

`response_format` (JSON) and forced tool calls hold the output to a grammar (`runtime/structured.py`,
masks applied by the scheduler); `tools` reach the chat template, and calls are parsed out of the
output (`runtime/tools.py`) into `tool_calls`, streamed one delta per call.

Text leaves as it is decoded (`TextStream`): stop strings are found in the text,
which is cut before the first one, and a streamed delta holds back the text
that could still begin a stop string or a multi-byte character.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from deepinfer.runtime.engine import Engine, QueueFull, RequestError
from deepinfer.runtime.executor import Executor, Stats
from deepinfer.runtime.logprobs import MAX_TOP_CHAT, MAX_TOP_LEGACY, Entry, Recorder, chat_format, legacy_format
from deepinfer.runtime.options import ServeOptions
from deepinfer.runtime.schedule import Completion, Request, Sampling
from deepinfer.runtime.structured import ANY_OBJECT, Compiled, GrammarError, Grammars, json_grammar, lark_grammar
from deepinfer.runtime.tools import (
    CallParser,
    ToolError,
    Tools,
    call_lark,
    call_text,
    fallback_message,
    parse_output,
    parse_tools,
)

RETRY_AFTER_S = 1  # what a 429 tells the client to wait
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_STOPS = 4  # OpenAI's limit on stop strings
# choices of one request: each is a sequence of its own (a batch row, its KV blocks), so n is held to
# a share of the default --max-queue (64) that leaves room for others: one request cannot fill it
MAX_N = 16
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's names (a response_format's json_schema)


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
        self.offsets: list[int] = []  # where each pushed token's text begins

    def push(self, token: int) -> bool:
        """Add a token; True when the text now holds a stop string (the text ends before it)."""
        if self.stopped:
            return True
        self.ids.append(token)
        self.offsets.append(len(self.text))  # a character still incomplete begins at the text's end
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
    sampling: Sampling  # choice 0's; choice i draws from seed + i
    stops: list[str]
    stream: bool
    include_usage: bool
    n: int = 1
    logprobs: int | None = None  # top entries per token (None: no logprobs)
    echo: bool = False
    grammar: Compiled | None = None  # what the output must follow, compiled once for its choices, or None
    tools: Tools | None = None  # a chat request's tools (calls are parsed from its output unless mode none)

    @property
    def call_names(self) -> set[str] | None:
        """The functions whose calls the output is parsed for, or None (no tools, or tool_choice none)."""
        if self.tools is None or self.tools.mode == "none":
            return None
        return {f.name for f in (self.tools.forced or self.tools.functions)}

    def sampling_of(self, index: int) -> Sampling:
        seed = self.sampling.seed
        return replace(self.sampling, seed=None if seed is None else seed + index)


class Choice:
    """One choice of a request as its sequence runs (on the engine's thread): its text, cut at stop
    strings (`TextStream`), its logprobs (`Recorder`), sent as ("text", index, delta, entries) events
    (each entry with the delta whose text holds its token's start; with `echo`, the prompt's text and
    entries lead the first), then ("done", index, reason, error)."""

    def __init__(self, index: int, p: Params, tokenizer, put: Callable[[tuple], None], echo: tuple[str, list[int]]):
        self.index, self.p, self.put = index, p, put
        self.text = TextStream(tokenizer.decode, p.stops)
        self.recorder = Recorder(p.prompt, p.logprobs, p.echo) if p.logprobs is not None else None
        self.echo_text, self.echo_offsets = echo  # ("", []) without echo
        self.entries: list[Entry] = []
        self.attached = 0  # entries sent
        self.started = False

    def on_token(self, token: int) -> bool:
        if self.text.stopped:
            return True
        stop = self.text.push(token)
        if self.recorder is not None:
            self.entries.append(self.recorder.token(token, len(self.echo_text) + self.text.offsets[-1]))
        if self.p.stream:
            self.send(self.text.take())
        return stop

    def on_finish(self, reason: str, error: str | None) -> None:
        self.send(self.text.take(final=True), final=True)
        self.put(("done", self.index, reason, error))

    def send(self, delta: str, final: bool = False) -> None:
        """Send `delta` with the entries of the tokens whose text begins in what has been sent."""
        if final and not self.text.stopped:
            end = len(self.entries)
        else:
            sent = len(self.echo_text) + self.text.sent
            end = self.attached
            while end < len(self.entries) and self.entries[end].offset < sent:
                end += 1
        items, self.attached = self.entries[self.attached : end], end
        if not self.started:
            self.started = True
            delta = self.echo_text + delta
            if self.recorder is not None and self.p.echo:
                items = self.recorder.prompt_part(self.echo_offsets) + items
        if delta or items:
            self.put(("text", self.index, delta, items))


class Served:
    """What the routes share: the engine, the tokenizer and the model's name and limits."""

    def __init__(self, engine: Engine, tokenizer, model: str, vocab: int):
        self.engine, self.tokenizer, self.model, self.vocab = engine, tokenizer, model, vocab
        self.grammars = Grammars(tokenizer, vocab, engine.scheduler.eos)
        self.created = int(time.time())

    # -- request bodies -----------------------------------------------------------------------

    def params(self, body: dict, prompt: list[int], default_max: int, chat: bool, tools: Tools | None = None) -> Params:
        if body.get("model") != self.model:
            raise BadRequest(
                f"The model {body.get('model')!r} does not exist; this server serves {self.model!r}",
                "model",
                code="model_not_found",
            )
        n = _field(body, "n", int, 1)
        if not 1 <= n <= MAX_N:
            raise BadRequest(f"n is {n}; expected 1 to {MAX_N} choices", "n")
        for name, harmless in (("best_of", (None, 1)), ("suffix", (None, ""))):
            if body.get(name) not in harmless:
                raise BadRequest(f"{name} is not supported by this server", name)
        logprobs, echo = _logprobs(body, chat)
        bad = [i for i in prompt if not 0 <= i < self.vocab]
        if bad:
            raise BadRequest(f"token ids {bad[:8]} are outside the vocabulary [0, {self.vocab})", "prompt")
        max_tokens = _field(body, "max_tokens", int, None)
        if max_tokens is None:
            max_tokens = _field(body, "max_completion_tokens", int, default_max)
        if chat and max_tokens == 0:
            raise BadRequest("max_tokens is 0; a chat completion generates at least 1 token", "max_tokens")
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
        penalties = {}
        for name in ("presence_penalty", "frequency_penalty"):
            penalties[name] = _field(body, name, float, 0.0)
            if not -2 <= penalties[name] <= 2:
                raise BadRequest(f"{name} is {penalties[name]}; expected a number in [-2, 2]", name)
        seed = _field(body, "seed", int, None)
        if seed is not None and not -(2**63) <= seed <= 2**63 - MAX_N:
            raise BadRequest(f"seed is {seed}; expected a signed 64-bit integer", "seed")
        stream = _field(body, "stream", bool, False)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("stream_options: expected an object", "stream_options")
        try:
            self.engine.check(len(prompt), max_tokens)
        except RequestError as e:
            raise BadRequest(str(e), e.param, code=e.code) from None
        sampling = Sampling(temperature, top_p, max(top_k, 0), seed, logit_bias=self.logit_bias(body), **penalties)
        grammar = self.response_format(body)
        if tools is not None and tools.mode == "forced":
            if grammar is not None:
                raise BadRequest("response_format cannot apply when tool_choice forces a tool call", "response_format")
            grammar = self.call_grammar(tools)
        return Params(
            prompt,
            max_tokens,
            sampling,
            stops,
            stream,
            bool(options.get("include_usage")),
            n,
            logprobs,
            echo,
            grammar,
            tools,
        )

    def request_params(self, body: dict, chat: bool) -> Params:
        """A generation request's prompt and fields, checked (BadRequest)."""
        tools = self.tools(body) if chat else None
        prompt = self.chat_prompt(body, tools) if chat else self.completion_prompt(body)
        default_max = self.engine.max_context - len(prompt) + 1 if chat else DEFAULT_COMPLETION_TOKENS
        return self.params(body, prompt, default_max, chat, tools)

    def response_format(self, body: dict) -> Compiled | None:
        """body's response_format as the grammar of its output: None for text (or none given)."""
        fmt = body.get("response_format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return self.checked(json_grammar(ANY_OBJECT), "response_format")
        if kind != "json_schema":
            raise BadRequest(
                f'response_format is {fmt!r}; expected {{"type": "text"}}, {{"type": "json_object"}} or '
                '{"type": "json_schema", "json_schema": {"name", "schema"}}',
                "response_format",
            )
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequest(
                "response_format.json_schema: expected an object {name, schema, strict}", "response_format"
            )
        name = spec.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise BadRequest(
                f"response_format.json_schema.name is {name!r}; expected 1 to 64 of a-z, A-Z, 0-9, _ and -",
                "response_format",
            )
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise BadRequest("response_format.json_schema.strict: expected a boolean", "response_format")
        schema = spec.get("schema", ANY_OBJECT)  # OpenAI: absent means any JSON object
        if not isinstance(schema, dict):
            raise BadRequest(
                "response_format.json_schema.schema: expected a JSON schema (an object)", "response_format"
            )
        try:
            return self.checked(json_grammar(schema), "response_format")
        except BadRequest as e:
            raise BadRequest(f"response_format.json_schema.schema: {e}", "response_format") from None

    def call_grammar(self, tools: Tools) -> Compiled:
        """The grammar of a forced output: calls of `tools.forced`, each function's parameters checked alone
        first (so that the error names it)."""
        for i, f in enumerate(tools.functions):
            if f in tools.forced:
                try:
                    self.checked(json_grammar(f.parameters), "tools")
                except BadRequest as e:
                    raise BadRequest(f"tools[{i}].function.parameters: {e}", "tools") from None
        return self.checked(lark_grammar(call_lark(tools.forced, tools.parallel)), "tools")

    def checked(self, grammar: str, param: str) -> Compiled:
        try:
            return self.grammars.compile(grammar)
        except GrammarError as e:
            raise BadRequest(str(e), param) from None

    def tools(self, body: dict) -> Tools | None:
        try:
            return parse_tools(body)
        except ToolError as e:
            raise BadRequest(str(e), e.param) from None

    def logit_bias(self, body: dict) -> tuple[tuple[int, float], ...]:
        """body's logit_bias ({"token id": bias}) as (id, bias) pairs."""
        bias = body.get("logit_bias")
        if bias is None:
            return ()
        if not isinstance(bias, dict):
            raise BadRequest(f"logit_bias is {bias!r}; expected an object of token id -> bias", "logit_bias")
        out = []
        for key, value in bias.items():
            token = int(key) if key.strip().lstrip("-").isdigit() else None
            if token is None or not 0 <= token < self.vocab:
                raise BadRequest(
                    f"logit_bias key {key!r} is not a token id in the vocabulary [0, {self.vocab})", "logit_bias"
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise BadRequest(f"logit_bias[{key!r}] is {value!r}; expected a number in [-100, 100]", "logit_bias")
            out.append((token, float(value)))
        return tuple(out)

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            return prompt
        raise BadRequest("prompt: expected a string or a list of token ids (one prompt per request)", "prompt")

    def chat_prompt(self, body: dict, tools: Tools | None = None) -> list[int]:
        """The prompt of a chat request: its messages (and tools) through the chat template, or the
        plain format of the byte-level tokenizer. Tools reach a template that reads `tools` as that
        variable, an assistant message's `tool_calls` as that key; otherwise (the plain format too)
        the tools come as a system message first (`tools.fallback_message`) and calls as their text."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: expected a non-empty list of {role, content}", "messages")
        native = tools is not None and self.tokenizer.takes_tools()
        plain = [fallback_message(tools.functions)] if tools is not None and not native else []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}]: expected an object with a string role", f"messages[{i}]")
            calls = _tool_calls(m, i)
            content = m.get("content")
            if content is None and calls:
                content = ""
            if isinstance(content, list):  # content parts: text only
                if not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
                ):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", f"messages[{i}]")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content: expected a string or a list of text parts", f"messages[{i}]")
            message = {"role": m["role"], "content": content}
            if calls and native:
                message["tool_calls"] = calls
            elif calls:
                message["content"] += "".join(
                    call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls
                )
            if isinstance(m.get("tool_call_id"), str):
                message["tool_call_id"] = m["tool_call_id"]
            plain.append(message)
        if self.tokenizer.kind == "byte":
            return self.tokenizer.encode(plain_chat(plain))
        from deepinfer.errors import DeepinferError

        try:
            return self.tokenizer.chat(plain, tools=[f.spec() for f in tools.functions] if native and tools else None)
        except DeepinferError as e:  # the template's own raise_exception, or no template
            raise BadRequest(str(e), "messages") from None

    # -- generation ---------------------------------------------------------------------------

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


def _tool_calls(m: dict, i: int) -> list[dict]:
    """An assistant message's `tool_calls` (checked: each `{id, type, function: {name, arguments}}`)."""
    calls = m.get("tool_calls")
    if calls is None:
        return []
    ok = isinstance(calls, list) and all(
        isinstance(c, dict)
        and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), str)
        for c in calls
    )
    if not ok:
        raise BadRequest(
            f"messages[{i}].tool_calls: expected a list of {{id, type, function: {{name, arguments}}}}",
            f"messages[{i}]",
        )
    return calls


def _logprobs(body: dict, chat: bool) -> tuple[int | None, bool]:
    """(top entries per token, or None for no logprobs; echo): chat's `logprobs` (bool) and
    `top_logprobs` (0 .. 20), or completions' `logprobs` (0 .. 5) and `echo`."""
    if chat:
        top = _field(body, "top_logprobs", int, None)
        if top is not None and not 0 <= top <= MAX_TOP_CHAT:
            raise BadRequest(f"top_logprobs is {top}; expected an integer in [0, {MAX_TOP_CHAT}]", "top_logprobs")
        if not _field(body, "logprobs", bool, False):
            if top:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            return None, False
        return top or 0, False
    if body.get("top_logprobs") is not None:
        raise BadRequest("top_logprobs is a chat completions field; completions take logprobs: N", "top_logprobs")
    top = None if body.get("logprobs") is False else _field(body, "logprobs", int, None)
    if top is not None and not 0 <= top <= MAX_TOP_LEGACY:
        raise BadRequest(f"logprobs is {top}; expected an integer in [0, {MAX_TOP_LEGACY}]", "logprobs")
    return top, _field(body, "echo", bool, False)


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
    from starlette.concurrency import run_in_threadpool
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
                _sse(served, jobs, events, head, chat, p.include_usage, usage, logprobs, p.call_names),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        collected = await _collect(served, request, jobs, events)
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
        return JSONResponse({"status": "ok"})

    async def tokenize(request):
        try:
            body = await body_of(request)
            text = body.get("prompt")
            if not isinstance(text, str):
                raise BadRequest("prompt: expected a string", "prompt")
            bos = _field(body, "add_special_tokens", bool, True)
        except BadRequest as e:
            return refuse(e)
        ids = served.tokenizer.encode(text, bos=bos)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": served.engine.max_context})

    async def detokenize(request):
        try:
            body = await body_of(request)
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise BadRequest("tokens: expected a list of token ids", "tokens")
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

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )


async def _collect(served: Served, request, jobs: list[Request], events: asyncio.Queue):
    """Each choice's (text, logprob entries, finish reason, error) once all have finished, or None when
    the client disconnected first (the sequences are then cancelled)."""

    async def gather():
        texts: list[list[str]] = [[] for _ in jobs]
        items: list[list[Entry]] = [[] for _ in jobs]
        done: dict[int, tuple[str, str | None]] = {}
        while len(done) < len(jobs):
            item = await events.get()
            if item[0] == "text":
                texts[item[1]].append(item[2])
                items[item[1]].extend(item[3])
            else:
                done[item[1]] = item[2], item[3]
        return [("".join(texts[i]), items[i], *done[i]) for i in range(len(jobs))]

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
    for job in jobs:
        served.engine.cancel(job)
    return None


async def _sse(
    served: Served,
    jobs: list[Request],
    events: asyncio.Queue,
    head: dict,
    chat: bool,
    include_usage: bool,
    usage: Callable[[], dict],
    logprobs: Callable[[list[Entry]], dict | None],
    call_names: set[str] | None = None,
):
    """Server-sent events of one streamed generation, a chunk per choice's delta (its `index`);
    leaving early (the client disconnected, a choice failed) cancels the choices still running.
    With `call_names` (a chat request's tools), each choice's text goes through a `CallParser`: its
    content as it comes (text that may begin a call held back), a call's `tool_calls` delta (index,
    id, type, name) once its opening is whole, then its arguments as they are written."""
    kind = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    parsers = [CallParser(call_names) for _ in jobs] if call_names is not None else None

    def event(data: Any) -> str:
        return f"data: {json.dumps(data)}\n\n"

    def chunk(
        i: int, text: str | None, reason: str | None, items: list[Entry], first: bool = False, calls: list | None = None
    ) -> str:
        if chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            )
            if calls:
                delta = {"tool_calls": calls}  # OpenAI's: one call's delta
            choice = {"index": i, "delta": delta, "logprobs": logprobs(items) if items else None}
        else:
            choice = {"index": i, "text": text or "", "logprobs": logprobs(items) if items else None}
        choice["finish_reason"] = reason
        return event({**kind, "choices": [choice], **({"usage": None} if include_usage else {})})

    finished = 0
    try:
        if chat:
            for i in range(len(jobs)):
                yield chunk(i, None, None, [], first=True)
        while finished < len(jobs):
            item = await events.get()
            if item[0] == "text" and parsers is None:
                yield chunk(item[1], item[2], None, item[3])
                continue
            if item[0] == "text":
                assert parsers is not None  # the branch above took the rest
                for piece in _call_chunks(item[1], parsers[item[1]].feed(item[2]), item[3], chunk):
                    yield piece
                continue
            finished += 1
            _, i, reason, error = item
            if reason == "error":
                yield event(error_body(error, "server_error"))
                yield "data: [DONE]\n\n"
                return
            if parsers is not None:
                for piece in _call_chunks(i, parsers[i].end(), [], chunk):
                    yield piece
                if parsers[i].calls and reason == "stop":
                    reason = "tool_calls"
            yield chunk(i, None, reason, [])
        if include_usage:
            yield event({**kind, "choices": [], "usage": usage()})
        yield "data: [DONE]\n\n"
    finally:
        if finished < len(jobs):
            for job in jobs:
                served.engine.cancel(job)


def _call_chunks(i: int, events: list[tuple], items: list[Entry], chunk: Callable) -> list[str]:
    """The chunks of choice i's `CallParser` events (`items`, its logprob entries, ride the first)."""
    out = []
    for e in events:
        if e[0] == "content":
            out.append(chunk(i, e[1], None, items))
        elif e[0] == "call":
            call = e[2].message()
            call["function"]["arguments"] = ""
            out.append(chunk(i, None, None, items, calls=[{"index": e[1], **call}]))
        else:
            out.append(chunk(i, None, None, items, calls=[{"index": e[1], "function": {"arguments": e[2]}}]))
        items = []
    if items:  # text held back: the entries go now, with no text
        out.append(chunk(i, "", None, items))
    return out


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

"""`deepinfer-serve`'s request bodies: bytes -> a JSON object (`parse_body`, bounded by
`deepinfer.reader.parse_json`: nesting depth, integer length, no NaN, no duplicate keys) -> `Params`
(`Bodies.request_params`), every field checked; anything refused is a `BadRequest` naming the field
(HTTP 400 with OpenAI's error body).

A prompt's text is held to what could fit the model's context before it reaches the tokenizer
(`Bodies.text_fits`): at most max_context * `Tokenizer.longest_token_bytes` * `TEXT_SLACK` bytes of
UTF-8, a bound no text that fits can exceed (a token covers at most its own bytes of text, times the
slack for a normalizer that shrinks text); a huge text otherwise reaches the Rust tokenizer.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace

from deepinfer.errors import DeepinferError
from deepinfer.reader import parse_json
from deepinfer.runtime.sampling import Sampling
from deepinfer.runtime.serving.engine import Engine, RequestError
from deepinfer.runtime.serving.grammars import ANY_OBJECT, Compiled, GrammarError, Grammars, json_grammar, lark_grammar
from deepinfer.runtime.serving.logprobs import MAX_TOP_CHAT, MAX_TOP_LEGACY
from deepinfer.runtime.serving.tool_calls import ToolError, Tools, call_lark, call_text, fallback_message, parse_tools
from deepinfer.runtime.serving.values import lone_surrogate, shown

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_STOPS = 4  # OpenAI's limit on stop strings
# choices of one request: each is a sequence of its own (a batch row, its KV blocks), so n is held to
# a share of the default --max-queue (64) that leaves room for others: one request cannot fill it
MAX_N = 16
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's names (a response_format's json_schema)
TEXT_SLACK = 4  # see the module's docstring
TOKEN_ID = re.compile(r"-?[0-9]{1,20}")  # a logit_bias key


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object (BadRequest naming what is wrong with it)."""
    body = parse_json(raw, "the request body", error=BadRequest)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    found = lone_surrogate(raw, body)
    if found is not None:
        field, message = found
        raise BadRequest(f"{message}; every string of a request must be Unicode text", field)
    return body


def plain_chat(messages: list[dict]) -> str:
    """The chat format of the byte-level tokenizer, which ships no template (see the module's docstring)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class BadRequest(Exception):
    """A request the server refuses before it reaches the engine."""

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Params:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling  # choice 0's; choice i draws from seed + i, wrapped to a signed 64-bit integer
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
        """Choice `index`'s sampling: seed + index, wrapped as a signed 64-bit integer adds (2**63 - 1 + 1
        is -2**63), so that every seed in the range the request may give has its n choices."""
        seed = self.sampling.seed
        return replace(self.sampling, seed=None if seed is None else (seed + index + 2**63) % 2**64 - 2**63)


class Bodies:
    """A request body -> `Params` (BadRequest naming the field): what a body may hold, checked against
    the engine, the tokenizer and the model's name and limits. `runtime.serving.server.Served` adds the rest."""

    def __init__(self, engine: Engine, tokenizer, model: str, vocab: int):
        self.engine, self.tokenizer, self.model, self.vocab = engine, tokenizer, model, vocab
        self.grammars = Grammars(tokenizer, vocab, engine.scheduler.eos)
        self.created = int(time.time())

    # -- request bodies -----------------------------------------------------------------------

    def params(self, body: dict, prompt: list[int], default_max: int, chat: bool, tools: Tools | None = None) -> Params:
        if body.get("model") != self.model:
            raise BadRequest(
                f"The model {shown(body.get('model'))} does not exist; this server serves {shown(self.model)}",
                "model",
                code="model_not_found",
            )
        n = _choices(body)
        logprobs, echo = _logprobs(body, chat)
        bad = [i for i in prompt if not 0 <= i < self.vocab]
        if bad:
            raise BadRequest(f"token ids {shown(bad[:8])} are outside the vocabulary [0, {self.vocab})", "prompt")
        max_tokens = _max_tokens(body, default_max, chat)
        temperature, top_p, top_k = _temperature_top_p_top_k(body)
        stops = _stops(body)
        penalties = _penalties(body)
        seed = body_field(body, "seed", int, None)
        if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
            raise BadRequest(f"seed is {shown(seed)}; expected a signed 64-bit integer", "seed")
        stream = body_field(body, "stream", bool, False)
        options = body.get("stream_options")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise BadRequest(f"stream_options is {shown(options)}; expected an object", "stream_options")
        include_usage = body_field(options, "include_usage", bool, False, parent="stream_options")
        try:
            self.engine.check(len(prompt), max_tokens)
        except RequestError as e:
            raise BadRequest(str(e), e.param, code=e.code) from None
        sampling = Sampling(temperature, top_p, max(top_k, 0), seed, logit_bias=self.logit_bias(body), **penalties)
        grammar = self.grammar(body, tools)
        return Params(
            prompt,
            max_tokens,
            sampling,
            stops,
            stream,
            include_usage,
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

    def grammar(self, body: dict, tools: Tools | None) -> Compiled | None:
        """The grammar a request's output follows: its response_format's, or its forced tool call's."""
        grammar = self.response_format(body)
        if tools is not None and tools.mode == "forced":
            if grammar is not None:
                raise BadRequest("response_format cannot apply when tool_choice forces a tool call", "response_format")
            grammar = self.call_grammar(tools)
        return grammar

    def response_format(self, body: dict) -> Compiled | None:
        """body's response_format as the grammar of its output: None for text (or none given)."""
        fmt = body.get("response_format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return self.schema_checked(ANY_OBJECT, "response_format")
        if kind != "json_schema":
            raise BadRequest(
                f'response_format is {shown(fmt)}; expected {{"type": "text"}}, {{"type": "json_object"}} or '
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
                f"response_format.json_schema.name is {shown(name)}; expected 1 to 64 of a-z, A-Z, 0-9, _ and -",
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
            return self.schema_checked(schema, "response_format")
        except BadRequest as e:
            raise BadRequest(f"response_format.json_schema.schema: {e}", "response_format") from None

    def call_grammar(self, tools: Tools) -> Compiled:
        """The grammar of a forced output: calls of `tools.forced`, each function's parameters checked alone
        first (so that the error names it)."""
        for i, f in enumerate(tools.functions):
            if f in tools.forced:
                try:
                    self.schema_checked(f.parameters, "tools")
                except BadRequest as e:
                    raise BadRequest(f"tools[{i}].function.parameters: {e}", "tools") from None
        return self.checked(lark_grammar(call_lark(tools.forced, tools.parallel)), "tools")

    def checked(self, grammar: str, param: str) -> Compiled:
        try:
            return self.grammars.compile(grammar)
        except GrammarError as e:
            raise BadRequest(str(e), param) from None

    def schema_checked(self, schema: dict, param: str) -> Compiled:
        """The grammar of JSON matching `schema`, compiled: a schema the grammar engine cannot even read
        (an integer past 64 bits) is a BadRequest too, as one it cannot enforce is."""
        try:
            grammar = json_grammar(schema)
        except GrammarError as e:
            raise BadRequest(str(e), param) from None
        return self.checked(grammar, param)

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
            raise BadRequest(f"logit_bias is {shown(bias)}; expected an object of token id -> bias", "logit_bias")
        out = []
        for key, value in bias.items():
            token = int(key) if TOKEN_ID.fullmatch(key) else None
            if token is None or not 0 <= token < self.vocab:
                raise BadRequest(
                    f"logit_bias key {shown(key)} is not a token id in the vocabulary [0, {self.vocab})", "logit_bias"
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise BadRequest(
                    f"logit_bias[{shown(key)}] is {shown(value)}; expected a number in [-100, 100]", "logit_bias"
                )
            out.append((token, float(value)))
        return tuple(out)

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer.encode(self.text_fits(prompt, "prompt"))
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
            return self.tokenizer.encode(self.text_fits(plain_chat(plain), "messages"))
        try:  # a template's every error (its own raise_exception, a time or size limit) is one line
            text = self.tokenizer.render_chat(
                plain, tools=[f.spec() for f in tools.functions] if native and tools else None
            )
        except DeepinferError as e:
            raise BadRequest(str(e), "messages") from None
        return self.tokenizer.encode(self.text_fits(text, "messages"), bos=False)

    def text_fits(self, text: str, param: str) -> str:
        """`text` if its UTF-8 could fit the context (see the module's docstring), else BadRequest."""
        limit = self.engine.max_context * self.tokenizer.longest_token_bytes * TEXT_SLACK
        if len(text) > limit:  # each character is at least a byte: no need to encode it
            raise BadRequest(
                f"{param}: the text has {len(text)} characters; no text over {limit} bytes fits this model's "
                f"context of {self.engine.max_context} tokens",
                param,
                code="context_length_exceeded",
            )
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise BadRequest(f"{param}: the text holds a lone surrogate at character {e.start}", param) from None
        if size > limit:
            raise BadRequest(
                f"{param}: the text is {size} bytes; no text over {limit} bytes fits this model's context of "
                f"{self.engine.max_context} tokens",
                param,
                code="context_length_exceeded",
            )
        return text

    # -- generation ---------------------------------------------------------------------------


def _choices(body: dict) -> int:
    """n, the choices of a request (best_of and suffix are refused unless harmless)."""
    n = body_field(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"n is {shown(n)}; expected 1 to {MAX_N} choices", "n")
    if body_field(body, "best_of", int, None) not in (None, 1):
        raise BadRequest("best_of is not supported by this server", "best_of")
    if body.get("suffix") not in (None, ""):
        raise BadRequest("suffix is not supported by this server", "suffix")
    return n


def _max_tokens(body: dict, default_max: int, chat: bool) -> int:
    """max_tokens, or max_completion_tokens, or `default_max` (a chat generates at least 1)."""
    max_tokens = body_field(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = body_field(body, "max_completion_tokens", int, default_max)
    if chat and max_tokens == 0:
        raise BadRequest("max_tokens is 0; a chat completion generates at least 1 token", "max_tokens")
    return max_tokens


def _temperature_top_p_top_k(body: dict) -> tuple[float, float, int]:
    temperature = body_field(body, "temperature", float, 0.0)
    top_p = body_field(body, "top_p", float, 1.0)
    top_k = body_field(body, "top_k", int, 0)
    if not 0 <= temperature <= 2:
        raise BadRequest(f"temperature is {shown(temperature)}; expected a number in [0, 2]", "temperature")
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p is {shown(top_p)}; expected a number in (0, 1]", "top_p")
    if top_k < -1:
        raise BadRequest(f"top_k is {shown(top_k)}; expected -1 or 0 (every token) or a positive count", "top_k")
    return temperature, top_p, top_k


def _stops(body: dict) -> list[str]:
    """`stop`: one string or a list of at most MAX_STOPS, none empty."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise BadRequest(f"stop is {shown(stop)}; expected a non-empty string or a list of at most {MAX_STOPS}", "stop")
    return stops


def _penalties(body: dict) -> dict[str, float]:
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        penalties[name] = body_field(body, name, float, 0.0)
        if not -2 <= penalties[name] <= 2:
            raise BadRequest(f"{name} is {shown(penalties[name])}; expected a number in [-2, 2]", name)
    return penalties


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
        top = body_field(body, "top_logprobs", int, None)
        if top is not None and not 0 <= top <= MAX_TOP_CHAT:
            raise BadRequest(
                f"top_logprobs is {shown(top)}; expected an integer in [0, {MAX_TOP_CHAT}]", "top_logprobs"
            )
        if not body_field(body, "logprobs", bool, False):
            if top:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            return None, False
        return top or 0, False
    if body.get("top_logprobs") is not None:
        raise BadRequest("top_logprobs is a chat completions field; completions take logprobs: N", "top_logprobs")
    top = None if body.get("logprobs") is False else body_field(body, "logprobs", int, None)
    if top is not None and not 0 <= top <= MAX_TOP_LEGACY:
        raise BadRequest(f"logprobs is {shown(top)}; expected an integer in [0, {MAX_TOP_LEGACY}]", "logprobs")
    return top, body_field(body, "echo", bool, False)


def body_field(body: dict, name: str, kind: type, default, *, parent: str | None = None):
    """body[name] as `kind` (bool accepts only true and false; int accepts no bool or float; float accepts
    an int), or `default` when absent/null. `parent`: the field `body` is the object of (the param named)."""
    value = body.get(name)
    if value is None:
        return default
    accepted = {bool: (bool,), int: (int,), float: (int, float)}[kind]
    if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
        expected = {bool: "a boolean", int: "an integer", float: "a number"}[kind]
        where = name if parent is None else f"{parent}.{name}"
        raise BadRequest(f"{where} is {shown(value)}; expected {expected}", parent or name)
    if kind is float:
        assert isinstance(value, (int, float))  # accepted above
        return float(value)
    return value


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

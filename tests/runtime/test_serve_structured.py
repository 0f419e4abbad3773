"""deepinfer-serve's structured output and tool calls with the `openai` client, against a real server
on the tiny model (random weights: whatever it writes, the grammar holds it to the schema). Every
output is parsed and checked against its schema by tests/runtime/schemas.py, independently of the
grammar engine."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from .schemas import errors
from .test_serve import MODEL, REQUEST_TIMEOUT_S, Server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", 3]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "inner": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
            "required": ["n", "ok"],
        },
    },
    "required": ["name", "kind", "tags", "inner"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 4}, "days": {"enum": [1, 2]}},
            "required": ["city", "days"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Hi"}]
NEW = 80
CALL_NEW = 120  # a call of weather: up to 4 characters of up to 4 bytes in its city


@pytest.fixture(scope="module")
def server(structured_bundle):
    s = Server(structured_bundle, "--max-queue", "16")
    yield s
    assert s.stop() == 0, s.proc.stderr.read()


def valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    assert errors(value, schema) == [], (text, errors(value, schema))
    return value


def test_json_schema_in_chat_and_completions_streamed_or_not(server):
    client = server.client()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=NEW, response_format=FORMAT)
    assert chat.choices[0].finish_reason == "stop"
    valid(chat.choices[0].message.content, SCHEMA)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=NEW, response_format=FORMAT, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"

    completion = client.completions.create(
        model=MODEL, prompt="A pet:", max_tokens=NEW, extra_body={"response_format": FORMAT}
    )
    assert completion.choices[0].finish_reason == "stop"
    valid(completion.choices[0].text, SCHEMA)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="A pet:", max_tokens=NEW, stream=True, extra_body={"response_format": FORMAT}
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == completion.choices[0].text
    # sampled, several choices: each its own matcher
    sampled = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=NEW, response_format=FORMAT, temperature=1.2, seed=3, n=3
    )
    for choice in sampled.choices:
        assert choice.finish_reason == "stop"
        valid(choice.message.content, SCHEMA)


def test_json_object_and_max_tokens_running_out(server):
    client = server.client()
    closing = {str(ord("}") + 3): 100}  # the byte tokenizer's id of "}": picked wherever the grammar allows it
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=NEW, response_format={"type": "json_object"}, logit_bias=closing
    )
    assert out.choices[0].message.content == "{}" and out.choices[0].finish_reason == "stop"
    free = client.completions.create(
        model=MODEL, prompt="x", max_tokens=NEW, extra_body={"response_format": {"type": "json_object"}}
    )
    text = free.choices[0].text
    assert text.startswith("{")
    if free.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    # max_tokens before the JSON completes: length, the text cut where it stopped (as OpenAI)
    cut = client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"response_format": FORMAT})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].text == '{"nam'
    assert cut.usage.completion_tokens == 5


@pytest.mark.parametrize(
    "fmt, message",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "strin"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "nowhere"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name is null"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "expected a JSON schema"),
        ({"type": "yaml"}, "expected"),
        ("json", "expected"),
    ],
)
def test_invalid_schemas_are_400_and_the_server_keeps_serving(server, fmt, message):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match=message) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, response_format=fmt)
    assert e.value.body["param"] == "response_format" and e.value.body["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason in (
        "stop",
        "length",
    )


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytest.mark.parametrize(
    "choice, names",
    [("required", {"weather", "time"}), ({"type": "function", "function": {"name": "weather"}}, {"weather"})],
)
def test_forced_tool_calls_follow_the_parameters_streamed_or_not(server, choice, names):
    client = server.client()
    kw = dict(
        model=MODEL, messages=MESSAGES, max_tokens=CALL_NEW, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False
    )
    with ThreadPoolExecutor(2) as pool:  # streamed and not in one batch (greedy: the same tokens)
        whole = pool.submit(client.chat.completions.create, **kw)
        streamed = pool.submit(lambda: list(client.chat.completions.create(**kw, stream=True)))
        out, chunks = whole.result(timeout=REQUEST_TIMEOUT_S), streamed.result(timeout=REQUEST_TIMEOUT_S)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        valid(call.function.arguments, PARAMETERS[call.function.name])
    parts: dict[int, dict] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            p = parts.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            p["id"] = p["id"] or d.id
            p["name"] += d.function.name or ""
            p["arguments"] += d.function.arguments or ""
    assert [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())] == calls_of(c.message)
    assert all(p["id"] for p in parts.values())
    pieces = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or [] if d.function.arguments]
    assert len(pieces) > 1  # the arguments stream as they are written
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(ch.choices[0].delta.content for ch in chunks)


def test_tools_reach_the_prompt_and_none_and_auto_answer_text(server):
    """The byte tokenizer's plain format takes the tools as the documented system message first."""
    client = server.client()
    tools = [TIME]
    with ThreadPoolExecutor(2) as pool:  # in one batch: the same prompt, free text
        none, auto = pool.map(
            lambda choice: client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=8, tools=tools, tool_choice=choice
            ),
            ["none", "auto"],
        )
    out = none
    rendered = (
        '<|system|>\nTools (<tool_call>{"name":...,"arguments":{...}}</tool_call> calls one): '
        '[{"name":"time","parameters":{"type":"object","properties":{}}}]\n<|user|>\nHi\n<|assistant|>\n'
    )
    assert out.usage.prompt_tokens == len(rendered.encode()) + 1  # and bos
    direct = client.completions.create(model=MODEL, prompt=rendered, max_tokens=8)
    assert out.choices[0].message.content == direct.choices[0].text and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == direct.choices[0].finish_reason
    # auto: the model wrote no call (its text has no <tool_call>), so the same text comes back
    assert "<tool_call>" not in direct.choices[0].text
    assert auto.choices[0].message.content == direct.choices[0].text and auto.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": 1}}}],
                "tool_choice": "required",
                "parallel_tool_calls": False,
            },
            None,
        ),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_invalid_tools_are_400_naming_the_param(server, kw, param):
    client = server.client()
    if param is None:  # an unknown keyword is ignored (JSON Schema's rule): the call goes through
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=CALL_NEW, **kw)
        assert out.choices[0].finish_reason == "tool_calls"
        return
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kw)
    assert e.value.body["param"] == param


@pytest.mark.parametrize(
    "choice, names",
    [
        ({"type": "function", "function": "weather"}, "tool_choice.function is"),
        ({"type": "function", "function": ["weather"]}, "tool_choice.function is"),
        ({"type": "function", "function": None}, "tool_choice.function is"),
        ({"type": "function"}, "tool_choice.function is"),
        ({"type": "function", "function": {"name": 5}}, "tool_choice.function.name is"),
        ({"type": "function", "function": {}}, "tool_choice.function.name is"),
    ],
)
def test_a_malformed_named_tool_choice_is_400_naming_it(server, choice, names):
    """A named choice whose `function` is not an object with a string name (the first of these was a
    500, AttributeError, with a traceback in the server's log)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, "tool_choice": choice}
    status, answer = server.post("/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == "tool_choice" and answer["error"]["message"].startswith(names), answer


def _schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _forced(parameters: dict, choice: str = "required") -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}], "tool_choice": choice}


@pytest.mark.parametrize(
    "extra, param, where",
    [
        (_schema_format({"enum": ["a", "\ud800"]}), "response_format", "response_format.json_schema.schema.enum[1]"),
        (_schema_format({"const": "\ud800"}), "response_format", "response_format.json_schema.schema.const"),
        (
            _schema_format({"type": "string", "pattern": "x\udc00"}),
            "response_format",
            "response_format.json_schema.schema.pattern",
        ),
        (
            _forced({"type": "object", "properties": {"a": {"enum": ["\ud800"]}}}),
            "tools",
            "tools[0].function.parameters.properties.a.enum[0]",
        ),
        (
            _forced({"type": "object", "properties": {"a": {"const": "\ud800"}}}, "auto"),
            "tools",
            "tools[0].function.parameters.properties.a.const",
        ),
        (_schema_format({"enum": [10**30]}), "response_format", "response_format.json_schema.schema: "),
        (
            _forced({"type": "object", "properties": {"a": {"const": 10**30}}}),
            "tools",
            "tools[0].function.parameters: ",
        ),
    ],
    ids=["enum", "const", "pattern", "tool-enum", "tool-auto-const", "huge-int-enum", "huge-int-tool-const"],
)
def test_schema_values_no_grammar_engine_can_read_are_400_naming_them(server, extra, param, where):
    """A lone surrogate (JSON can escape one; no UTF-8 encoder takes it) or an integer past 64 bits in a
    schema: 500s with a traceback in the server's log before, now a 400 naming the field (a tool's
    through the plain prompt format was a 400 naming `messages`)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
    status, answer = server.post("/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["message"].startswith(where), answer
    assert server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2})[0] == 200


def test_a_bad_parameters_schema_names_its_function(server):
    bad = {
        "type": "function",
        "function": {"name": "g", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}},
    }
    with pytest.raises(openai.BadRequestError, match=r"tools\[1\]\.function\.parameters: .*nope") as e:
        server.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, tools=[TIME, bad], tool_choice="required"
        )
    assert e.value.body["param"] == "tools"


def test_constrained_requests_leave_the_others_tokens_alone(server):
    """Greedy plain requests batched with constrained ones get the tokens they get without them."""
    client = server.client()
    prompts = ["Hello, world", "The quick brown fox"]

    def plain(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=24).choices[0].text

    def constrained(p):
        out = client.completions.create(model=MODEL, prompt=p, max_tokens=NEW, extra_body={"response_format": FORMAT})
        return out.choices[0].text

    with ThreadPoolExecutor(2) as pool:
        alone = list(pool.map(plain, prompts))
    with ThreadPoolExecutor(4) as pool:
        mixed = [pool.submit(constrained, "a"), pool.submit(plain, prompts[0])]
        mixed += [pool.submit(constrained, "b"), pool.submit(plain, prompts[1])]
        results = [f.result(timeout=300) for f in mixed]
    assert [results[1], results[3]] == alone
    valid(results[0], SCHEMA)
    valid(results[2], SCHEMA)

"""Structured output and tool calls without a bundle: grammars over the byte-level and a tokenizer.json
tokenizer, the scheduler's masks over a model of random logits, the tool-call parser."""

from __future__ import annotations

import json
import re
import zlib

import pytest
import torch

from deepinfer.regions.stepper import Allocator
from deepinfer.regions.tokenizer import ByteTokenizer
from deepinfer.runtime.requests import Request
from deepinfer.runtime.sampling import Sampling
from deepinfer.runtime.schedule import Scheduler
from deepinfer.runtime.serving.grammars import GrammarError, Grammars, json_grammar, json_schema, lark_grammar
from deepinfer.runtime.serving.tool_calls import CallParser, ToolError, call_lark, parse_output, parse_tools

from .schemas import errors

V, EOS = 288, 1  # the tiny model's vocabulary and eos
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", 3]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "inner": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 40}},
            "required": ["n"],
        },
    },
    "required": ["name", "kind", "inner"],
}


class Noise:
    """A Stepper whose logits are random but a function of each sequence's tokens so far (so a
    sequence's tokens do not depend on what else is in its batch); one sequence per row, one token a step."""

    groups, max_batch, chunk, slack = 1, 4, 1, 0

    def allocator(self) -> Allocator:
        return Allocator(8, 64, 16, 16)

    def run(self, rows_by_group, allocs, histories, images, capture=None, last_only=False, greedy=False):
        (rows,) = rows_by_group
        logits = torch.zeros(len(rows), 1, V)
        for b, (seq, ids, start) in enumerate(rows):
            key = zlib.crc32(bytes(str(histories[seq][: start + len(ids)]), "ascii"))
            logits[b, 0] = torch.randn(V, generator=torch.Generator().manual_seed(key)) * 3
        return [logits]


def run(requests: list[Request], limit: int = 2000) -> None:
    s = Scheduler(Noise(), eos=EOS)
    for r in requests:
        s.add(r)
    for _ in range(limit):
        if not s.busy:
            return
        s.step()
    raise AssertionError("the scheduler did not finish")


def generate(prompt: str, max_tokens: int, grammars: Grammars | None, grammar: str | None, sampling=Sampling()):
    """A request of `prompt` -> (it, its log: {"tokens", "finish"})."""
    log: dict = {"tokens": []}
    tok = ByteTokenizer()
    r = Request(
        tok.encode(prompt),
        max_tokens,
        lambda t: log["tokens"].append(t) or False,
        lambda reason, error: log.__setitem__("finish", (reason, error)),
        sampling,
        constraint=grammars.constraint(grammar) if grammar is not None else None,
    )
    return r, log


@pytest.fixture(scope="module")
def grammars():
    return Grammars(ByteTokenizer(), V, EOS)


def test_json_schema_outputs_parse_and_validate_whatever_the_logits(grammars):
    grammar = json_grammar(SCHEMA)
    grammars.compile(grammar)
    runs = [
        generate(f"prompt {i}", 200, grammars, grammar, Sampling(temperature=t, seed=i))
        for i, t in enumerate([0.0, 0.7, 1.0, 1.5, 2.0, 1.0])
    ]
    run([r for r, _ in runs])
    for _, log in runs:
        assert log["finish"] == ("stop", None)  # the grammar ended it: every string, number and array is bounded
        text = ByteTokenizer().decode(log["tokens"])
        assert errors(json.loads(text), SCHEMA) == [], text
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text  # compact: no whitespace
        assert log["tokens"][-1] != EOS  # a complete grammar ends the request without an eos


def test_json_object_and_max_tokens_running_out(grammars):
    grammar = json_grammar({"type": "object"})
    r, log = generate("x", 6, grammars, grammar)
    run([r])
    text = ByteTokenizer().decode(log["tokens"])
    assert log["finish"][0] == "length" and len(log["tokens"]) == 6 and text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(text)  # cut off: a prefix of what the grammar admits, as OpenAI's length


def test_unconstrained_rows_are_untouched_by_constrained_ones(grammars):
    grammar = json_grammar(SCHEMA)
    plain = [generate(f"plain {i}", 24, None, None) for i in range(2)]
    run([r for r, _ in plain])
    alone = [log["tokens"] for _, log in plain]
    mixed_plain = [generate(f"plain {i}", 24, None, None) for i in range(2)]
    mixed_json = [generate(f"json {i}", 60, grammars, grammar) for i in range(2)]
    run([mixed_json[0][0], mixed_plain[0][0], mixed_json[1][0], mixed_plain[1][0]])
    assert [log["tokens"] for _, log in mixed_plain] == alone
    assert all(json.loads(ByteTokenizer().decode(log["tokens"])) for _, log in mixed_json)


def test_a_bias_and_the_mask_compose(grammars):
    """The bias applies before the mask: a +100 bias on "}" picks it wherever the grammar allows it."""
    close = ByteTokenizer().encode("}", bos=False)[0]
    r, log = generate("x", 40, grammars, json_grammar({"type": "object"}), Sampling(logit_bias=((close, 100.0),)))
    run([r])
    assert ByteTokenizer().decode(log["tokens"]) == "{}" and log["finish"] == ("stop", None)


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "strin"}, "strin"),
        ({"type": "string", "format": "bogus"}, "bogus"),
        ({"$ref": "#/definitions/missing"}, "missing"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "Unsatisfiable"),
        ({"type": "string", "pattern": "(("}, "unclosed group"),
    ],
)
def test_bad_schemas_are_refused_naming_the_problem(grammars, schema, message):
    with pytest.raises(GrammarError, match=message):
        grammars.compile(json_grammar(schema))


def test_closing_objects_leaves_the_schema_alone():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}
    closed = json_schema(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "x-guidance" not in schema
    assert json_schema({"type": "object", "additionalProperties": True})["additionalProperties"] is True


def test_a_tokenizer_json_vocabulary(tmp_path):
    """The synthetic tokenizer.json (merged tokens, added special tokens, partial UTF-8 bytes): a forced
    walk over random logits decodes, through the tokenizer itself, to JSON matching the schema."""
    from pathlib import Path

    from deepinfer.regions.hf_tokenizer import TokenizersTokenizer

    tok = TokenizersTokenizer.from_dir(Path(__file__).resolve().parents[1] / "golden" / "synthetic_tokenizer")
    grammars = Grammars(tok, V, tok.eos)
    schema = {"type": "object", "properties": {"café": {"enum": ["He", "he", "你"]}, "n": {"type": "integer"}}}
    c = grammars.constraint(json_grammar(schema))
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(200):
        mask = grammars.masks([c])[0]
        assert not mask[tok.bos] and not mask[259]  # bos and the image token never
        logits = torch.randn(V, generator=g).masked_fill(~mask, float("-inf"))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        if token == tok.eos:
            break
        out.append(token)
        if c.accept(token):
            break
    value = json.loads(tok.decode(out))
    assert errors(value, schema) == [] and set(value) <= set(schema["properties"]), value


# --- tools ---------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "days": {"type": "integer", "maximum": 7}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}


def test_tool_choice_forms():
    assert parse_tools({}) is None
    assert parse_tools({"tools": [WEATHER]}).mode == "auto"
    t = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert t.mode == "forced" and [f.name for f in t.forced] == ["weather", "time"]
    t = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "time"}}})
    assert [f.name for f in t.forced] == ["time"]
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}).mode == "none"


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"tool_choice": "required"}, "tool_choice", "no tools"),
        ({"tools": []}, "tools", "non-empty list"),
        ({"tools": [{"type": "function"}]}, "tools", "tools\\[0\\]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", '"a b"'),
        ({"tools": [TIME, TIME]}, "tools", "defined twice"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", '"always"'),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice", '"x"'),
        ({"tools": [WEATHER], "parallel_tool_calls": 1}, "parallel_tool_calls", "boolean"),
    ],
)
def test_bad_tools_name_the_param(body, param, message):
    with pytest.raises(ToolError, match=message) as e:
        parse_tools(body)
    assert e.value.param == param


def test_forced_calls_follow_the_parameters(grammars):
    tools = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    grammar = lark_grammar(call_lark(tools.forced, tools.parallel))
    grammars.compile(grammar)
    runs = [generate(f"call {i}", 120, grammars, grammar, Sampling(temperature=1.0, seed=i)) for i in range(4)]
    run([r for r, _ in runs])
    schemas = {f.name: f.parameters for f in tools.functions}
    for _, log in runs:
        assert log["finish"] == ("stop", None)
        content, calls = parse_output(ByteTokenizer().decode(log["tokens"]), set(schemas))
        assert content == "" and len(calls) == 1
        assert errors(json.loads(calls[0].arguments), schemas[calls[0].name]) == []


# pydantic's shape: the parameters' own $defs, named by local $refs (one recursive)
PLACE = {
    "type": "object",
    "properties": {"at": {"$ref": "#/$defs/Place"}, "stops": {"type": "array", "items": {"$ref": "#/$defs/Place"}}},
    "required": ["at", "stops"],
    "$defs": {
        "Place": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "near": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]},
            },
            "required": ["city", "near"],
        }
    },
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "route"}}])
def test_forced_calls_follow_parameters_with_local_refs(grammars, choice):
    """A forced call whose parameters use `$defs` (issue 44): the grammar compiles, and what it lets the
    model write validates against the parameters as given."""
    route = {"type": "function", "function": {"name": "route", "parameters": PLACE}}
    tools = parse_tools({"tools": [route, TIME], "tool_choice": choice, "parallel_tool_calls": False})
    grammar = lark_grammar(call_lark(tools.forced, tools.parallel))
    grammars.compile(grammar)
    runs = [generate(f"go {i}", 160, grammars, grammar, Sampling(temperature=1.0, seed=i)) for i in range(4)]
    run([r for r, _ in runs])
    schemas = {f.name: f.parameters for f in tools.functions}
    ended = [log for _, log in runs if log["finish"] == ("stop", None)]  # the others ran out of tokens
    assert ended
    for log in ended:
        content, calls = parse_output(ByteTokenizer().decode(log["tokens"]), set(schemas))
        assert content == "" and len(calls) == 1
        assert errors(json.loads(calls[0].arguments), schemas[calls[0].name]) == []


def test_the_call_parser_finds_calls_in_free_text_as_it_streams():
    text = 'Let me see.<tool_call>{"name": "weather", "arguments": {"city": "O}s\\"lo", "n": [1, {}]}}</tool_call> '
    text += '<tool_call>bad</tool_call><tool_call>{"name":"nope","arguments":{}}</tool_call><tool_call>{"name":"time",'
    names = {"weather", "time"}
    content, calls = parse_output(text, names)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": 'O}s"lo', "n": [1, {}]})]
    assert calls[0].arguments == '{"city": "O}s\\"lo", "n": [1, {}]}'  # as written
    assert content == (
        'Let me see. <tool_call>bad</tool_call><tool_call>{"name":"nope","arguments":{}}</tool_call>'
        '<tool_call>{"name":"time",'
    )  # a malformed call, an unknown function and an unfinished opening stay text
    p = CallParser(names)
    events = [p.feed(ch) for ch in text]
    flat = [e for es in events for e in es] + p.end()
    assert "".join(e[1] for e in flat if e[0] == "content") == content
    assert "".join(e[2] for e in flat if e[0] == "arguments") == calls[0].arguments
    opened = next(i for i, es in enumerate(events) if any(e[0] == "call" for e in es))
    assert text[: opened + 1].endswith('"arguments": {')  # the call's delta as soon as its opening is whole
    assert events[11] == [] and events[10] == [("content", ".")]  # "<" might begin a call: held back
    assert parse_output("a < b", names) == ("a < b", [])
    # an unfinished call (max_tokens ran out) stays a call, its arguments as far as they got
    content, calls = parse_output('<tool_call>{"name":"time","arguments":{"a":[1,', names)
    assert content == "" and calls[0].arguments == '{"a":[1,'


def test_a_template_that_reads_tools_gets_them(tmp_path):
    import shutil
    from pathlib import Path

    from deepinfer.regions.hf_tokenizer import TokenizersTokenizer

    synthetic = Path(__file__).resolve().parents[1] / "golden" / "synthetic_tokenizer"
    for f in synthetic.iterdir():
        shutil.copy(f, tmp_path / f.name)
    assert not TokenizersTokenizer.from_dir(tmp_path).takes_tools()  # the synthetic template ignores tools
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
        "{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}({{ c.function.name }}){% endfor %}"
        "{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = TokenizersTokenizer.from_dir(tmp_path)
    assert tok.takes_tools()
    tools = parse_tools({"tools": [WEATHER, TIME]})
    calls = [{"id": "c", "type": "function", "function": {"name": "time", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    assert tok.render_chat(messages, tools=[f.spec() for f in tools.functions]) == "[weather;time;]Hi(time)"


def test_constrained_sequences_are_never_drafted(grammars):
    """Speculative decoding verifies drafts against the raw argmax: a constrained sequence decodes plainly."""
    from deepinfer.runtime.requests import Completion
    from deepinfer.runtime.schedule import Running, draft_for

    class Drafter:
        block, capture = 3, None

        def __init__(self):
            self.asked: list[int] = []

        def draft(self, requests):
            self.asked += [r.seq for r in requests]
            return {r.seq: [5] * r.n for r in requests}

    alloc = Allocator(4, 16, 16, 4)
    running = []
    for seq, constraint in enumerate([None, grammars.constraint(json_grammar({"type": "object"}))]):
        alloc.admit(seq)
        r = Request([0, 10], 8, constraint=constraint)
        running.append(Running(r, Completion([0, 10, 11], 2), None, seq=seq, consumed=2))
    d = Drafter()
    assert list(draft_for(d, running, 8, [alloc])) == [0] and d.asked == [0]

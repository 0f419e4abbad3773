"""Tool calls for `deepinfer-serve`'s chat completions: `tools`, `tool_choice`, and the calls in the output.

A model calls a function by writing `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`
(Hermes' format, which many chat templates that take `tools` teach; one or more in a row). With
`tool_choice: "auto"` the output is free and `CallParser` finds such calls in it; with `"required"`
or a named function the output is constrained (`call_grammar`, a grammar of llguidance) to calls of
those functions whose arguments match each function's JSON `parameters` schema (compact JSON, objects
closed as `runtime/serving/grammars.py` closes them); `"none"` leaves the output text. Calls come back as
OpenAI's `tool_calls` (`id`, `type: "function"`, `function: {name, arguments}`, the arguments a JSON
string), streamed as a call's opening delta then its arguments as they are written, and the finish
reason is `tool_calls`.

Tools reach the chat template as its `tools` variable (HF's convention: a list of
`{"type": "function", "function": {...}}`). A template that never reads `tools` (and the byte-level
tokenizer's plain format) gets `fallback_message` first: a system message holding the call format
and the functions as compact JSON.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from deepinfer.errors import DeepinferError
from deepinfer.runtime.serving.values import shown

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
NO_PARAMETERS: dict = {"type": "object", "properties": {}}


class ToolError(DeepinferError):
    """A `tools` or `tool_choice` the server refuses (400); `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict  # a JSON schema of the arguments object

    def spec(self) -> dict:
        """As OpenAI writes it (and chat templates read it)."""
        inner: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            inner["description"] = self.description
        inner["parameters"] = self.parameters
        return {"type": "function", "function": inner}


@dataclass(frozen=True)
class Tools:
    """A chat request's tools and choice: `mode` none, auto or forced (required or a named function),
    `forced` the functions a forced output may call, `parallel` whether it may call several."""

    functions: tuple[Function, ...]
    mode: str
    forced: tuple[Function, ...] = ()
    parallel: bool = True


def parse_tools(body: dict) -> Tools | None:
    """body's `tools`, `tool_choice` and `parallel_tool_calls` (None: no tools and no choice)."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None:
        if choice not in (None, "none"):
            raise ToolError(f"tool_choice is {shown(choice)} but the request has no tools", "tool_choice")
        return None
    if not isinstance(raw, list) or not raw:
        raise ToolError("tools: expected a non-empty list of {type: function, function: {name, parameters}}", "tools")
    functions: list[Function] = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(f'{where}: expected {{"type": "function", "function": {{...}}}}', "tools")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolError(
                f"{where}.function.name is {shown(name)}; expected 1 to 64 of a-z, A-Z, 0-9, _ and -", "tools"
            )
        if any(g.name == name for g in functions):
            raise ToolError(f"{where}: the function {shown(name)} is defined twice", "tools")
        description = f.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{where}.function.description: expected a string", "tools")
        parameters = f.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ToolError(f"{where}.function.parameters: expected a JSON schema of an object", "tools")
        functions.append(Function(name, description, parameters))
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls is {shown(parallel)}; expected a boolean", "parallel_tool_calls")
    if choice is None or choice in ("auto", "none"):
        return Tools(tuple(functions), choice or "auto", parallel=parallel)
    if choice == "required":
        return Tools(tuple(functions), "forced", tuple(functions), parallel)
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise ToolError(
            f'tool_choice is {shown(choice)}; expected "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    named_function = choice.get("function")
    if not isinstance(named_function, dict):
        raise ToolError(f'tool_choice.function is {shown(named_function)}; expected {{"name": ...}}', "tool_choice")
    name = named_function.get("name")
    if not isinstance(name, str):
        raise ToolError(f"tool_choice.function.name is {shown(name)}; expected the name of one of tools", "tool_choice")
    named = [f for f in functions if f.name == name]
    if not named:
        raise ToolError(f"tool_choice names the function {shown(name)}, which is not in tools", "tool_choice")
    return Tools(tuple(functions), "forced", tuple(named), parallel)


def call_schema(functions: tuple[Function, ...]) -> dict:
    """The JSON schema of one call's object: {"name": one of them, "arguments": its parameters}.

    Each function's parameters move to the root's `$defs` (as `f<i>`, their own `$defs` and
    `definitions` beside them as `f<i>.<name>`) and their local `$ref`s are rewritten to match: a
    parameters schema's `#/$defs/...` (what pydantic emits) names its own root, not this wrapper's."""
    defs: dict = {}
    choices = []
    for i, f in enumerate(functions):
        prefix = f"f{i}"
        params = dict(f.parameters)
        for key in ("$defs", "definitions"):
            for name, sub in (params.pop(key, None) or {}).items():
                defs[f"{prefix}.{name}"] = _local_refs(sub, prefix)
        defs[prefix] = _local_refs(params, prefix)
        choices.append(
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": {"$ref": f"#/$defs/{prefix}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return {"$defs": defs, "anyOf": choices}


def _local_refs(schema, prefix: str):
    """`schema` with its local `$ref`s pointed at where `call_schema` moved its root: `#` at
    `#/$defs/<prefix>`, `#/$defs/X` and `#/definitions/X` at `#/$defs/<prefix>.X`, other pointers into
    the moved root."""
    if isinstance(schema, list):
        return [_local_refs(s, prefix) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _local_refs(v, prefix) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        parts = ref[2:].split("/", 2) if ref != "#" else []
        if len(parts) >= 2 and parts[0] in ("$defs", "definitions"):
            out["$ref"] = "/".join([f"#/$defs/{prefix}.{parts[1]}", *parts[2:]])
        else:
            out["$ref"] = f"#/$defs/{prefix}" + (ref[1:] if ref != "#" else "")
    return out


def call_lark(functions: tuple[Function, ...], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) of a forced output: one call, or with `parallel` one or
    more in a row, of `functions`."""
    from deepinfer.runtime.serving.grammars import json_schema

    schema = json.dumps(json_schema(call_schema(functions)))
    return f"start: call{'+' if parallel else ''}\ncall: {json.dumps(OPEN)} %json {schema} {json.dumps(CLOSE)}\n"


def fallback_message(functions: tuple[Function, ...]) -> dict:
    """The system message that tells a model the tools when its chat template does not take them."""
    listed = json.dumps([f.spec()["function"] for f in functions], separators=(",", ":"), ensure_ascii=False)
    return {
        "role": "system",
        "content": f'Tools ({OPEN}{{"name":...,"arguments":{{...}}}}{CLOSE} calls one): {listed}',
    }


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (an assistant message's `tool_calls` in a fallback prompt)."""
    return f'{OPEN}{{"name":{json.dumps(name)},"arguments":{arguments}}}{CLOSE}'


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # the JSON object as the model wrote it (grown as it streams)

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


WS, STRING = object(), object()  # steps of `_match`: any whitespace, a JSON string
HEAD = (OPEN, WS, "{", WS, '"name"', WS, ":", WS, STRING, WS, ",", WS, '"arguments"', WS, ":", WS, "{")
TAIL = (WS, "}", WS, CLOSE)


def _match(text: str, steps: tuple) -> tuple[str, str | None, int]:
    """How `text` begins against `steps`: ("yes", the JSON string's value, where the match ends),
    ("partial", ...) when it ends before they do, or ("no", ...)."""
    i, value = 0, None
    for step in steps:
        if step is WS:
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
        elif step is STRING:
            if i == len(text):
                return "partial", None, i
            if text[i] != '"':
                return "no", None, i
            j, escaped = i + 1, False
            while j < len(text) and (escaped or text[j] != '"'):
                escaped = not escaped and text[j] == "\\"
                j += 1
            if j == len(text):
                return "partial", None, i
            try:
                value = json.loads(text[i : j + 1])
            except ValueError:
                return "no", None, i
            i = j + 1
        else:
            n = min(len(step), len(text) - i)
            if text[i : i + n] != step[:n]:
                return "no", None, i
            if n < len(step):
                return "partial", None, i
            i += n
    return "yes", value, i


class CallParser:
    """One choice's text -> its content and calls, as the text comes. `feed` returns events:
    ("content", text) safe to send (text that may begin a call is held back), ("call", k, Call) once a
    call's `<tool_call>{"name": NAME, "arguments": {` is whole and NAME is one of `names`, then
    ("arguments", k, text) as its arguments object is written, up to its closing brace. Text that turns
    out not to be such a call is content; `end` returns the events of what was held back."""

    def __init__(self, names: set[str]):
        self.names = names
        self.buffer = ""  # text held back: a possible start of a call, or the markup after its arguments
        self.state = "text"  # text, head (a call's opening), arguments, tail (its closing)
        self.calls: list[Call] = []
        self.depth, self.in_string, self.escaped = 0, False, False  # within the arguments object

    def feed(self, text: str) -> list[tuple]:
        self.buffer += text
        events: list[tuple] = []
        while self.buffer:
            if self.state == "text":
                at = self.buffer.find(OPEN)
                cut = at if at >= 0 else len(self.buffer) - _partial_suffix(self.buffer, OPEN)
                if cut:
                    events.append(("content", self.buffer[:cut]))
                self.buffer = self.buffer[cut:]
                if at < 0:
                    break
                self.state = "head"
            elif self.state == "head":
                found, name, end = _match(self.buffer, HEAD)
                if found == "partial":
                    break
                if found == "no" or name not in self.names:  # not a call: its opening tag is text
                    events.append(("content", OPEN))
                    self.buffer, self.state = self.buffer[len(OPEN) :], "text"
                    continue
                assert isinstance(name, str)  # found a call of a known name
                self.calls.append(Call("call_" + uuid.uuid4().hex[:24], name, ""))
                events.append(("call", len(self.calls) - 1, self.calls[-1]))
                self.buffer, self.state = self.buffer[end - 1 :], "arguments"  # from the arguments' "{"
                self.depth, self.in_string, self.escaped = 0, False, False
            elif self.state == "arguments":
                end = self._arguments_end()
                piece, self.buffer = self.buffer[:end], self.buffer[end:]
                self.calls[-1].arguments += piece
                events.append(("arguments", len(self.calls) - 1, piece))
                if self.depth > 0:
                    break
                self.state = "tail"
            else:
                found, _, end = _match(self.buffer, TAIL)
                if found == "partial":
                    break
                self.state = "text"
                if found == "yes":
                    self.buffer = self.buffer[end:]
        return events

    def _arguments_end(self) -> int:
        """Where in the buffer the arguments object closes (past its "}"), or the buffer's end."""
        for i, ch in enumerate(self.buffer):
            if self.in_string:
                self.escaped, self.in_string = (
                    (not self.escaped and ch == "\\"),
                    self.escaped or ch != '"',
                )
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return len(self.buffer)

    def end(self) -> list[tuple]:
        """The events of the held-back text once the output has ended: an unfinished opening is text;
        an unfinished call stays a call (its arguments as far as they got)."""
        rest, self.buffer = self.buffer, ""
        return [("content", rest)] if rest and self.state in ("text", "head") else []


def parse_output(text: str, names: set[str]) -> tuple[str, list[Call]]:
    """A whole output's content (the text outside its calls) and calls."""
    p = CallParser(names)
    events = p.feed(text) + p.end()
    return "".join(e[1] for e in events if e[0] == "content"), p.calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

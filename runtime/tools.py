"""Tool calls for `deepinfer-serve`'s chat completions: `tools`, `tool_choice`, and the calls in the output.

A model calls a function by writing `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`
(Hermes' format, which many chat templates that take `tools` teach; one or more in a row). With
`tool_choice: "auto"` the output is free and `CallParser` finds such calls in it; with `"required"`
or a named function the output is constrained (`call_grammar`, a grammar of llguidance) to calls of
those functions whose arguments match each function's JSON `parameters` schema (compact JSON, objects
closed as `runtime/structured.py` closes them); `"none"` leaves the output text. Calls come back as
OpenAI's `tool_calls` (`id`, `type: "function"`, `function: {name, arguments}`, the arguments a JSON
string), streamed as one delta per whole call, and the finish reason is `tool_calls`.

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
            raise ToolError(f"tool_choice is {choice!r} but the request has no tools", "tool_choice")
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
            raise ToolError(f"{where}.function.name is {name!r}; expected 1 to 64 of a-z, A-Z, 0-9, _ and -", "tools")
        if any(g.name == name for g in functions):
            raise ToolError(f"{where}: the function {name!r} is defined twice", "tools")
        description = f.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{where}.function.description: expected a string", "tools")
        parameters = f.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ToolError(f"{where}.function.parameters: expected a JSON schema of an object", "tools")
        functions.append(Function(name, description, parameters))
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls is {parallel!r}; expected a boolean", "parallel_tool_calls")
    if choice is None or choice in ("auto", "none"):
        return Tools(tuple(functions), choice or "auto", parallel=parallel)
    if choice == "required":
        return Tools(tuple(functions), "forced", tuple(functions), parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError(
            f'tool_choice is {choice!r}; expected "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    named = [f for f in functions if f.name == name]
    if not named:
        raise ToolError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return Tools(tuple(functions), "forced", tuple(named), parallel)


def call_schema(functions: tuple[Function, ...]) -> dict:
    """The JSON schema of one call's object: {"name": one of them, "arguments": its parameters}."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }


def call_lark(functions: tuple[Function, ...], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) of a forced output: one call, or with `parallel` one or
    more in a row, of `functions`."""
    from deepinfer.runtime.structured import json_schema

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


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # a JSON object, compact

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class CallParser:
    """One choice's text -> its content and calls, as the text comes: `feed` returns the content safe
    to send (text that may begin a call is held back) and the calls completed; `end` the rest (a call
    left unfinished, or not a call of one of `names`, is content)."""

    def __init__(self, names: set[str]):
        self.names = names
        self.buffer = ""  # text not yet sent: a possible start of a call, or a call being written
        self.calls: list[Call] = []

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self.buffer += text
        content, calls = [], []
        while self.buffer:
            at = self.buffer.find(OPEN)
            if at < 0:
                keep = _partial_suffix(self.buffer, OPEN)
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            content.append(self.buffer[:at])
            self.buffer = self.buffer[at:]
            end = self.buffer.find(CLOSE)
            if end < 0:
                break  # a call being written
            whole, self.buffer = self.buffer[: end + len(CLOSE)], self.buffer[end + len(CLOSE) :]
            call = self._call(whole[len(OPEN) : -len(CLOSE)])
            if call is None:
                content.append(whole)
            else:
                calls.append(call)
        self.calls.extend(calls)
        return "".join(content), calls

    def end(self) -> str:
        rest, self.buffer = self.buffer, ""
        return rest

    def _call(self, body: str) -> Call | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
            return None
        name, arguments = value["name"], value["arguments"]
        if name not in self.names or not isinstance(arguments, dict):
            return None
        text = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
        return Call("call_" + uuid.uuid4().hex[:24], name, text)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_output(text: str, names: set[str]) -> tuple[str, list[Call]]:
    """A whole output's content (the text outside its calls) and calls."""
    p = CallParser(names)
    content, calls = p.feed(text)
    return content + p.end(), calls

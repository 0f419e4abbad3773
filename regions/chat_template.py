"""Chat templates, rendered within bounds: a template is code from the checkpoint, run on every chat
request, so its time and the size of what it builds are limited, and any error it raises is one line.

The environment is transformers' (`ImmutableSandboxedEnvironment`, `trim_blocks`, `lstrip_blocks`,
loop controls, `raise_exception`, `strftime_now`, `tojson`), bounded:

- time: a trace function on the template's own frames checks a deadline at every line it runs, so a
  loop, however nested and even with an empty body, stops at `TIME_LIMIT_S`; the sandbox's hooks
  (calls, attribute lookups, operators) check it too;
- size: the output is streamed (`Template.generate`) and counted; operators that can build a large
  value from small ones (`*`, `**`, `+`, `%` and `~` concatenation) and calls (filters, methods,
  globals) whose integer arguments or results exceed `MAX_CHARS` are refused before they allocate;
  `str.replace`, `join` and `format` are sized before they run; `lipsum` is gone.

Any exception (`TemplateError`, `ZeroDivisionError`, `RecursionError`, a limit) becomes
`TemplateLimit`'s or the caller's one-line error.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime

TIME_LIMIT_S = 5.0  # one rendering (a real template renders in milliseconds)
MAX_CHARS = 16 << 20  # the output, and any one string, list or number of digits a template builds
TEMPLATE_FILE = "<template>"  # what Jinja names a template compiled from a string: its frames' file
WIDTH = re.compile(r"%[-+ #0]*(\*|[0-9]+)")  # a printf field width in a `%` format


class TemplateLimit(Exception):
    """A template went over a limit (time or size)."""


class Budget:
    """One rendering's deadline and size limit."""

    def __init__(self, seconds: float, max_chars: int):
        self.seconds, self.max_chars = seconds, max_chars
        self.deadline = time.monotonic() + seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"rendering took over {self.seconds:g} s")

    def size(self, n: int, what: str = "a value") -> None:
        if n > self.max_chars:
            raise TemplateLimit(f"{what} of {n} items or characters is over the limit of {self.max_chars}")


def _length(x: object) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple, dict)) else 0


def _check_args(budget: Budget, args: tuple, kwargs: Mapping) -> None:
    """Integer arguments (widths, counts) over the size limit are refused before the call."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and abs(a) > budget.max_chars:
            budget.size(abs(a), "an argument")


def _presize(budget: Budget, fn: object, name: str, args: tuple) -> None:
    """What a growing string operation (a method or a filter of that name) would build, refused before
    it runs: the strings are the bound string, then the string arguments, in order."""
    owner = getattr(fn, "__self__", None)
    strings = [a for a in (owner, *args) if isinstance(a, str)]
    if name == "replace" and len(strings) >= 3:
        s, old, new = strings[:3]
        count = len(s) + 1 if not old else s.count(old)
        budget.size(len(s) + count * max(0, len(new) - len(old)), "replace's result")
    elif name == "join":
        items = next((a for a in args if isinstance(a, (list, tuple))), ())
        sep = strings[0] if strings else ""
        budget.size(len(sep) * len(items) + sum(map(_length, items)), "join's result")
    elif name == "format":
        for a in strings:
            _widths(budget, a)


def _widths(budget: Budget, fmt: str) -> None:
    """A format string's numbers (field widths, precisions) over the size limit are refused."""
    for digits in re.findall(r"[0-9]{8,}", fmt):
        budget.size(10 ** min(len(digits), 30) if len(digits) > 8 else int(digits), "a format width")


def _bounded_call(
    budget: Budget, fn: Callable, name: str, args: tuple, kwargs: Mapping, call: Callable[[], object]
) -> object:
    budget.tick()
    _check_args(budget, args, kwargs)
    _presize(budget, fn, name, args)
    out = call()
    budget.size(_length(out), f"the result of {name}")
    return out


def environment(budget: Budget | None = None):
    """The sandboxed environment chat templates render in, held to `budget` (None: parsing only)."""
    from jinja2.ext import loopcontrols

    limits = budget or Budget(TIME_LIMIT_S, MAX_CHARS)
    env = _sandbox(limits)(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals.pop("lipsum", None)
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(limits, name, f)
    return env


def _sandbox(limits: Budget):
    """Jinja's immutable sandbox with every concatenation, operator, call, format and lookup held to `limits`."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b ~ c` through the size check
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Bounded(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def bounded_concat(self, parts: tuple) -> str:
            limits.tick()
            text = "".join(map(str, parts))
            limits.size(len(text), "a concatenation")
            return text

        def call_binop(self, context, operator, left, right):
            limits.tick()
            _check_binop(limits, operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):
            name = getattr(__obj, "__name__", "")
            return _bounded_call(
                limits,
                __obj,
                name,
                args,
                kwargs,
                lambda: super(Bounded, __self).call(__context, __obj, *args, **kwargs),
            )

        def wrap_str_format(self, value):
            owner = getattr(value, "__self__", None)
            if isinstance(owner, str):
                _widths(limits, owner)
            return super().wrap_str_format(value)

        def getattr(self, obj, attribute):
            limits.tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            limits.tick()
            return super().getitem(obj, argument)

    return Bounded


def _check_binop(limits: Budget, operator: str, left: object, right: object) -> None:
    """What an intercepted operator (`*`, `**`, `+`, `%`) would build, refused before it runs."""
    if operator == "*" and isinstance(right, int) and _length(left):
        limits.size(_length(left) * right, "a repetition")
    if operator == "*" and isinstance(left, int) and _length(right):
        limits.size(_length(right) * left, "a repetition")
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        limits.size(int(right * math.log10(abs(left))), "a power's digits")
    if operator == "+" and _length(left) and _length(right):
        limits.size(_length(left) + _length(right), "a sum")
    if operator == "%" and isinstance(left, str):
        for width in WIDTH.findall(left):
            if width != "*" and len(width) > 7:
                limits.size(int(width), "a % format width")
        items = right if isinstance(right, tuple) else (right,)
        _check_args(limits, items, {})


def raise_exception(message):
    """A template's `raise_exception(message)`: its error, as Jinja raises one."""
    from jinja2 import TemplateError

    raise TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _bounded_filter(budget: Budget, name: str, f: Callable) -> Callable:
    @functools.wraps(f)  # keeps Jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        return _bounded_call(budget, f, name, args, kwargs, lambda: f(*args, **kwargs))

    return bounded


def render(template: str, variables: dict, seconds: float = TIME_LIMIT_S, max_chars: int = MAX_CHARS) -> str:
    """`template` rendered with `variables` within `seconds` and `max_chars` of output (TemplateLimit,
    or whatever the template raises)."""
    budget = Budget(seconds, max_chars)
    compiled = environment(budget).from_string(template)

    def line(frame, event, arg):
        if event == "line":
            budget.tick()
        return line

    def calls(frame, event, arg):
        return line if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        out, size = [], 0
        for piece in compiled.generate(**variables):
            size += len(piece)
            budget.size(size, "the rendered text")
            out.append(piece)
        return "".join(out)
    finally:
        sys.settrace(previous)

"""A request's JSON values as `deepinfer-serve`'s refusals see them: how a message shows one (`shown`),
and where a body holds text that is not Unicode (`lone_surrogate`).

A refusal names the value it refuses as the client wrote it, in JSON (`true`, `null`, `"tiny"`), not
as Python prints it (`True`, `None`, `'tiny'`), cut to `SHOWN_CHARS` characters: a message repeats no
megabyte of a body.

JSON text may carry a lone UTF-16 surrogate as an escape (`"\\ud800"`); Python's json module accepts it
as a str that no UTF-8 encoder takes, so anything that later encodes it (a grammar engine in Rust, a
tokenizer, the answer itself) fails far from the field. A body holding one anywhere is refused as it is
parsed (`runtime/serving/params.py: parse_body`), naming the field: no part of a request is text the
server cannot encode.
"""

from __future__ import annotations

import json
import re

# a \uD800 .. \uDFFF escape in JSON text: the only way a body decoded from UTF-8 can hold a surrogate
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
PLAIN_KEY = re.compile(r"[A-Za-z_$][A-Za-z0-9_$-]*")  # a key written .key in a path; others ["key"]
SHOWN_CHARS = 200  # the most of a value a message shows


def shown(value: object) -> str:
    """`value` as JSON text for an error message (non-ASCII as it is, a lone surrogate escaped), at most
    SHOWN_CHARS characters (then cut, with "...")."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate as its \u escape
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def lone_surrogate(raw: bytes, body: object) -> tuple[str | None, str] | None:
    """Where `body` (parsed from `raw`) holds a lone surrogate: (the top-level field, None when that
    field's own name holds it; what to tell the client), or None. The walk runs only when `raw` has a
    surrogate escape (a pair is fine)."""
    if not SURROGATE_ESCAPE.search(raw):
        return None
    stack: list[tuple[str, str, object]] = [("", "", body)]
    while stack:
        field, path, value = stack.pop()
        if isinstance(value, str):
            at = _surrogate_at(value)
            if at is not None:
                return (
                    field or None,
                    f"{path or 'the body'} holds a lone surrogate ({_escape(value[at])} at character {at})",
                )
        elif isinstance(value, list):
            stack.extend((field, f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            for key, v in reversed(list(value.items())):
                at = _surrogate_at(key)
                if at is not None:
                    where = path or "the body"
                    return field or None, f"{where} has a key holding a lone surrogate: {json.dumps(key)}"
                step = f".{key}" if PLAIN_KEY.fullmatch(key) else f"[{json.dumps(key)}]"
                stack.append((field or key, (path + step).removeprefix("."), v))
    return None


def _surrogate_at(text: str) -> int | None:
    """Where `text` holds a lone surrogate (one UTF-8 cannot encode), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _escape(char: str) -> str:
    return f"\\u{ord(char):04x}"

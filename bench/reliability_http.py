"""bench/reliability.py's HTTP surface: malformed bodies and headers sent to a live deepinfer-serve, and
64 clients mixing valid and malformed requests."""

from __future__ import annotations

import http.client
import json
import random
import select
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

from reliability_files import DEEP, HUGE_INT, Case

MODEL = "tiny"
HTTP_TIMEOUT_S = 60  # past this a request is a hang
VALID = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}


def request(url: str, body: bytes, *, path: str = "/v1/completions", method: str = "POST", headers=None):
    """(status, body bytes) or (None, why) when the connection failed or timed out."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=HTTP_TIMEOUT_S)
    try:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        r = conn.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException) as e:
        return None, f"{type(e).__name__}: {e}".encode()
    finally:
        conn.close()


def raw_request(url: str, data: bytes, read_s: float = HTTP_TIMEOUT_S):
    """Bytes written as they are (headers included); (status or None, what came back)."""
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname, u.port), timeout=read_s) as s:
            # as curl sends a body over 1 MiB: the headers, then up to a second for an early answer (a
            # server that refuses the body from its Content-Length answers and closes; a client still
            # writing would only see the connection reset), then the body in 64 KiB pieces
            end = data.find(b"\r\n\r\n") + 4
            wait = 1.0 if len(data) - end > 1 << 20 else 0.0
            pieces = [data[:end], *(data[at : at + (1 << 16)] for at in range(end, len(data), 1 << 16))]
            for i, piece in enumerate(pieces):
                if select.select([s], [], [], wait if i == 1 else 0)[0]:
                    break
                s.sendall(piece)
            else:
                s.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
    except OSError as e:
        return None, f"{type(e).__name__}: {e}".encode()
    try:
        return int(got.split(b" ", 2)[1]), got
    except (IndexError, ValueError):
        return None, got[:300] or b"connection closed without an answer"


def judge_http(name: str, status, body: bytes) -> Case:
    """Clean: 2xx, or 4xx whose JSON error message is one line. A 5xx, no answer, or else: unclean."""
    text = body.decode("utf-8", "replace")
    if status is None:
        return Case("http", name, False, "no answer", text[:500])
    if status >= 500:
        return Case("http", name, False, f"HTTP {status}", text[:500])
    if status < 400:
        return Case("http", name, True, "accepted")
    payload = text.split("\r\n\r\n", 1)[-1]
    try:
        message = json.loads(payload)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return Case("http", name, False, f"HTTP {status} without a JSON error", text[:500])
    if "\n" in message or "Traceback" in message:
        return Case("http", name, False, "not one line", message[:500])
    return Case("http", name, True, f"HTTP {status}", message[:200])


def _with(**fields) -> bytes:
    return json.dumps({**VALID, **fields}).encode()


def bodies() -> list[tuple[str, bytes, str]]:
    """(name, body, path) of every malformed body."""
    out: list[tuple[str, bytes, str]] = [
        ("empty body", b"", "/v1/completions"),
        ("invalid JSON", b'{"model": "tiny", "prompt": ', "/v1/completions"),
        ("deep nesting", DEEP.encode(), "/v1/completions"),
        ("deep prompt", b'{"model": "tiny", "prompt": ' + DEEP.encode() + b"}", "/v1/completions"),
        ("bad UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 2}', "/v1/completions"),
        ("NaN literal", b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": NaN}', "/v1/completions"),
        (
            "Infinity literal",
            b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "top_p": Infinity}',
            "/v1/completions",
        ),
        ("huge int max_tokens", _with(max_tokens="__H__").replace(b'"__H__"', HUGE_INT.encode()), "/v1/completions"),
        ("huge int prompt id", _with(prompt=["__H__"]).replace(b'"__H__"', HUGE_INT.encode()), "/v1/completions"),
        ("duplicate keys", b'{"model": "tiny", "prompt": "x", "prompt": 5, "max_tokens": 2}', "/v1/completions"),
        ("a list", b"[1, 2]", "/v1/completions"),
        ("a string", b'"hello"', "/v1/completions"),
        ("null", b"null", "/v1/completions"),
    ]
    for field, values in {
        "prompt": [None, 5, {"a": 1}, [[1, 2], "x"], [-1], [1.5], "", [], ["a", 3]],
        "max_tokens": ["4", 4.5, True, -3, 0, 10**9, None, [4]],
        "temperature": ["0", -1, 1e-300, 1e308, 5e-324, 1e300, 2.5, [0]],
        "top_p": [0, 1e-300, 5e-324, 2, -1, "1", None],
        "n": [0, 10**6, "2", -1, 2.5],
        "stream": ["yes", 1, None, {}],
        "stop": [[""] * 1000, 5, ["a" * 100000], [None], {"a": 1}],
        "model": [None, 5, "gpt-4", "", "x" * 100000],
        "seed": ["x", -1, 1.5, 2**70],
        "logprobs": ["x", -1, 10**6, 2.5],
        "stream_options": ["x", {"include_usage": "yes"}, 5],
        "echo": ["x", 5],
        "presence_penalty": ["x", 1e308, -1e308],
        "logit_bias": ["x", {"abc": 1}, {"1": 1e308}, {"999999999": 1}],
        "response_format": ["x", {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": "x"}}],
        "unknown_field": [1],
    }.items():
        for v in values:
            out.append((f"completions {field} = {str(v)[:24]}", _with(**{field: v}), "/v1/completions"))
    chat = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    for label, messages in [
        ("none", None),
        ("empty", []),
        ("a string", "hi"),
        ("role unknown", [{"role": "wizard", "content": "x"}]),
        ("content number", [{"role": "user", "content": 5}]),
        ("content parts bad", [{"role": "user", "content": [{"type": "nope"}]}]),
        ("content parts deep", [{"role": "user", "content": [{"type": "text", "text": [[["x"]]]}]}]),
        ("no role", [{"content": "x"}]),
        ("huge content", [{"role": "user", "content": "x" * 200_000}]),
        ("a thousand messages", [{"role": "user", "content": "x"}] * 1000),
    ]:
        out.append(
            (f"chat messages {label}", json.dumps({**chat, "messages": messages}).encode(), "/v1/chat/completions")
        )
    for field, v in [("temperature", 1e-300), ("top_p", 1e-300), ("tools", "x"), ("tool_choice", 5), ("n", 0)]:
        out.append((f"chat {field} = {v}", json.dumps({**chat, field: v}).encode(), "/v1/chat/completions"))
    out += request_parts(chat)
    return out


def request_parts(chat: dict) -> list[tuple[str, bytes, str]]:
    """(name, body, path) of malformed parts of a request issue 44 found (500s with a traceback, or taken
    as what they are not): a named tool_choice whose function is no object, lone surrogates and integers
    past 64 bits in schemas, booleans written as strings or numbers, the ends of the seed's range."""
    tools = [{"type": "function", "function": {"name": "t"}}]

    def schema(s: dict) -> dict:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}

    def forced(parameters: dict, choice="required") -> dict:
        function = {"name": "t", "parameters": {"type": "object", "properties": {"a": parameters}}}
        return {"tools": [{"type": "function", "function": function}], "tool_choice": choice}

    chats = [
        ("tool_choice function a string", {"tools": tools, "tool_choice": {"type": "function", "function": "t"}}),
        ("tool_choice function a list", {"tools": tools, "tool_choice": {"type": "function", "function": ["t"]}}),
        ("tool_choice function null", {"tools": tools, "tool_choice": {"type": "function", "function": None}}),
        ("tool_choice function name 5", {"tools": tools, "tool_choice": {"type": "function", "function": {"name": 5}}}),
        ("json_schema enum lone surrogate", schema({"enum": ["\ud800"]})),
        ("json_schema const lone surrogate", schema({"const": "\udfff"})),
        ("json_schema pattern lone surrogate", schema({"type": "string", "pattern": "\ud800"})),
        ("json_schema key lone surrogate", schema({"type": "object", "properties": {"\ud800": {}}})),
        ("json_schema enum 2**100", schema({"enum": [2**100]})),
        ("tool parameters enum lone surrogate", forced({"enum": ["\ud800"]})),
        ("tool parameters const 2**100", forced({"const": 2**100})),
        ("tool parameters auto lone surrogate", forced({"pattern": "\ud800"}, "auto")),
        ("stream_options include_usage no", {"stream": True, "stream_options": {"include_usage": "no"}}),
        ("stream_options false", {"stream": True, "stream_options": False}),
        ("logprobs 1", {"logprobs": 1}),
    ]
    out = [(f"chat {name}", json.dumps({**chat, **extra}).encode(), "/v1/chat/completions") for name, extra in chats]
    for name, extra in [
        ("seed 2**63-1 n 2", {"seed": 2**63 - 1, "n": 2, "temperature": 1.0}),
        ("seed -2**63", {"seed": -(2**63), "temperature": 1.0}),
        ("seed 2**63", {"seed": 2**63}),
        ("best_of true", {"best_of": True}),
        ("echo 1", {"echo": 1}),
        ("stop lone surrogate", {"stop": ["\ud800"]}),
        ("a key lone surrogate", {"\ud800": 1}),
    ]:
        out.append((f"completions {name}", _with(**extra), "/v1/completions"))
    return out


def raw_cases(url: str) -> list[tuple[str, bytes, float]]:
    """(name, bytes, read timeout) of requests malformed below the body."""
    u = urlparse(url)
    host = f"Host: {u.hostname}:{u.port}\r\n".encode()
    head = b"POST /v1/completions HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\n"
    big = 20 << 20
    return [
        ("Content-Length larger than the body", head + b"Content-Length: 1000\r\n\r\n{}", HTTP_TIMEOUT_S),
        ("Content-Length negative", head + b"Content-Length: -5\r\n\r\n{}", HTTP_TIMEOUT_S),
        ("Content-Length huge int", head + b"Content-Length: " + HUGE_INT.encode() + b"\r\n\r\n{}", HTTP_TIMEOUT_S),
        ("Content-Length 1e12", head + b"Content-Length: 1000000000000\r\n\r\n{}", HTTP_TIMEOUT_S),
        ("Content-Length twice", head + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", HTTP_TIMEOUT_S),
        ("chunked, bad chunk size", head + b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n", HTTP_TIMEOUT_S),
        ("a 20 MB body", head + b"Content-Length: %d\r\n\r\n" % big + b'{"prompt": "' + b"x" * big, HTTP_TIMEOUT_S),
        ("header line of 1 MB", head + b"X-Big: " + b"a" * (1 << 20) + b"\r\nContent-Length: 2\r\n\r\n{}", 60),
        ("10000 headers", head + b"".join(b"X-%d: 1\r\n" % i for i in range(10000)) + b"\r\n", HTTP_TIMEOUT_S),
        ("bad request line", b"POST\r\n\r\n", HTTP_TIMEOUT_S),
        ("HTTP/9.9", b"GET /health HTTP/9.9\r\n" + host + b"\r\n", HTTP_TIMEOUT_S),
        ("bad UTF-8 in the path", b"GET /v1/\xff\xfe HTTP/1.1\r\n" + host + b"\r\n", HTTP_TIMEOUT_S),
        ("unknown path", b"GET /nope HTTP/1.1\r\n" + host + b"\r\n", HTTP_TIMEOUT_S),
        ("wrong method", b"DELETE /v1/completions HTTP/1.1\r\n" + host + b"\r\n", HTTP_TIMEOUT_S),
        (
            "Content-Type text/plain",
            head.replace(b"application/json", b"text/plain") + b"Content-Length: 2\r\n\r\n{}",
            60,
        ),
    ]


def alive(url: str) -> bool:
    """The server answers a valid request correctly (its engine is still stepping)."""
    status, body = request(url, json.dumps({**VALID, "max_tokens": 1}).encode())
    return status == 200


def http_cases(url: str, restart) -> Iterator[Case]:
    """Every malformed request; after each, a valid one must still complete (else the case killed the
    engine: unclean, and `restart()` gives a fresh server's url for the next case)."""
    for name, body, path in bodies():
        case = judge_http(name, *request(url, body, path=path))
        if not alive(url):
            case = Case("http", name, False, "server or engine dead after it", case.output)
            url = restart()
        yield case
    for name, data, read_s in raw_cases(url):
        status, got = raw_request(url, data, read_s)
        case = judge_http(name, status, got) if status is not None or not _closed_cleanly(got) else None
        if case is None:  # closed with no answer: fine for malformed framing the server refuses to read
            case = Case("http", name, True, "connection closed")
        if not alive(url):
            case = Case("http", name, False, "server or engine dead after it", case.output)
            url = restart()
        yield case


def address_cases(bundle, url: str) -> Iterator[Case]:
    """deepinfer-serve started on an address it cannot listen on (the live server's port, a host that does
    not resolve, one that is not this machine's): refused in one line, exit status 2, before the load."""
    from reliability_files import judge_cli, run_cli

    from deepinfer.runtime.serving.cli import main as serve_main

    u = urlparse(url)
    for name, host, port in [
        ("deepinfer-serve on a port in use", str(u.hostname), str(u.port)),
        ("deepinfer-serve --host that does not resolve", "no.such.host.invalid", "0"),
        ("deepinfer-serve --host that is not a host", "not a host", "0"),
        ("deepinfer-serve --host not of this machine", "192.0.2.1", "0"),
    ]:
        yield judge_cli("http", name, run_cli(serve_main, [str(bundle), "--host", host, "--port", port]), answers=())


def _closed_cleanly(got: bytes) -> bool:
    return got == b"connection closed without an answer"


# --- load --------------------------------------------------------------------------------------


PROMPTS = ["Hello", "abc", "1 + 1 =", "Once upon", "def f(", "GET /", "Dear Sir", "xyz"]


def expected(url: str) -> tuple[dict[str, str], list[float]]:
    """Each prompt's greedy text, unloaded, and the latencies of 3 rounds of them one at a time."""
    texts, seconds = {}, []
    for _ in range(3):
        for p in PROMPTS:
            start = time.perf_counter()
            status, body = request(url, json.dumps({**VALID, "prompt": p}).encode())
            seconds.append(time.perf_counter() - start)
            assert status == 200, body
            texts[p] = json.loads(body)["choices"][0]["text"]
    return texts, seconds


def load(url: str, texts: dict[str, str], clients: int, seconds: float, seed: int) -> dict:
    """`clients` threads for `seconds`: a quarter of requests valid (checked against `texts`), the rest
    malformed (cheap bodies from `bodies`). Returns the valid requests' latencies and losses."""
    malformed = [(n, b, p) for n, b, p in bodies() if len(b) < 10_000]
    latencies: list[float] = []
    lost: list[str] = []
    counts = {"valid": 0, "malformed": 0, "malformed_5xx": 0}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < stop:
            if rng.random() < 0.25:
                p = rng.choice(PROMPTS)
                start = time.perf_counter()
                status, body = request(url, json.dumps({**VALID, "prompt": p}).encode())
                took = time.perf_counter() - start
                ok = status == 200 and json.loads(body)["choices"][0]["text"] == texts[p]
                with lock:
                    counts["valid"] += 1
                    latencies.append(took)
                    if not ok:
                        lost.append(f"{p!r}: HTTP {status} {body[:200]!r}")
            else:
                name, body, path = rng.choice(malformed)
                status, _ = request(url, body, path=path)
                with lock:
                    counts["malformed"] += 1
                    counts["malformed_5xx"] += status is None or status >= 500

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 2 * HTTP_TIMEOUT_S)
    return {"latencies": latencies, "lost": lost, **counts}

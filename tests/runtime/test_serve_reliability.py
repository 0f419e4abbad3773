"""deepinfer-serve against hostile clients and its own faults (issue 33), on real server processes:

- `guarded`: low HTTP limits (1 MiB bodies, 12 connections, 2 s for headers, 3 s for a body, 2 s of
  grace) and the engine's test hook ($DEEPINFER_TEST_FAULT) on two sampling seeds: one makes a step
  raise, one makes each step slow (for the SIGTERM test, which stops this server last);
- `doomed`: the hook's stall (the watchdog) and thread death.

Every wait is bounded; no assertion is on timing (a /health answered "meanwhile" is one answered,
within a generous timeout, while the other client is still connected)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_serve import MODEL, REQUEST_TIMEOUT_S, Server

STEP_SEED, SLOW_SEED, STALL_SEED, DEATH_SEED = 9_100_000_001, 9_100_000_002, 9_100_000_003, 9_100_000_004
HOOK_SEEDS = {STEP_SEED, SLOW_SEED, STALL_SEED, DEATH_SEED}
CAP = 1 << 20
CONNECTIONS = 12
HEALTH_TIMEOUT_S = 10  # "within a second" on a quiet machine; bounded generously for a busy CI one


class Hooked(Server):
    def __init__(self, bundle, *args: str, fault: str):
        from deepinfer.runtime.serving.server_process import ServerProcess

        ServerProcess.__init__(
            self,
            bundle,
            "--model-name",
            MODEL,
            "--threads",
            "1",
            *args,
            start_timeout_s=300.0,
            env={"DEEPINFER_TEST_FAULT": fault},
        )

    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def raw(self) -> socket.socket:
        return socket.create_connection(self.address(), timeout=REQUEST_TIMEOUT_S)

    def health(self) -> int:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=HEALTH_TIMEOUT_S) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def stream(self, body: dict) -> list[str]:
        """The data lines of a streamed completion."""
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps({"model": MODEL, "stream": True, **body}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return [line.decode().strip() for line in r if line.startswith(b"data: ")]


@pytest.fixture(scope="module")
def guarded(aoti_bundle):
    s = Hooked(
        aoti_bundle,
        *("--max-queue", "16", "--max-body-bytes", str(CAP), "--max-connections", str(CONNECTIONS)),
        *("--header-timeout-s", "2", "--body-timeout-s", "3", "--grace-s", "2"),
        fault=f"step={STEP_SEED},slow={SLOW_SEED}",
    )
    yield s
    s.stop()


def complete(s: Server, **body) -> tuple[int, dict]:
    return s.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **body})


def one_line_error(answer: dict, param: str | None = None) -> str:
    message = answer["error"]["message"]
    assert "\n" not in message and message
    if param is not None:
        assert answer["error"]["param"] == param, answer
    return message


def test_tiny_temperature_and_top_p_sample(guarded):
    """1e-300 killed the engine thread (NaN probabilities); now it is greedy / keeps the top token."""
    status, greedy = complete(guarded, max_tokens=6)
    assert status == 200
    for fields in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300}, {"temperature": 5e-324}):
        status, answer = complete(guarded, max_tokens=6, seed=3, **fields)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert guarded.health() == 200


def test_a_failing_step_fails_only_its_request(guarded):
    status, answer = complete(guarded, temperature=1.0, seed=STEP_SEED, max_tokens=8)
    assert status == 500 and "test hook" in one_line_error(answer)
    lines = guarded.stream({"prompt": "Hi", "temperature": 1.0, "seed": STEP_SEED, "max_tokens": 8})
    assert lines[-1] == "data: [DONE]" and "test hook" in json.loads(lines[-2][6:])["error"]["message"]
    assert complete(guarded)[0] == 200 and guarded.health() == 200


@pytest.mark.parametrize(
    "body, param, words",
    [
        (b"[" * 5000 + b"]" * 5000, None, "nested"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None, "digits"),
        (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', None, "NaN"),
        (b'{"model": "tiny", "prompt": "x", "prompt": "y"}', None, "twice"),
        (b'{"model": "tiny", "prompt": "\xff"}', None, "UTF-8"),
        (b'{"model": "tiny", "prompt": "x", "logit_bias": {"' + b"9" * 5000 + b'": 1}}', "logit_bias", "logit_bias"),
        (b'{"model": "tiny", "prompt": "\\ud800"}', "prompt", "surrogate"),
        (b'{"model": "tiny", "prompt": "x", "temperature": 1e400}', "temperature", "temperature"),
    ],
    ids=["nested", "5000-digits", "nan", "duplicate-key", "utf8", "logit-bias-key", "surrogate", "inf"],
)
def test_hostile_json_bodies_are_400(guarded, body, param, words):
    status, answer = guarded.post("/v1/completions", body)
    assert status == 400, answer
    assert words.lower() in one_line_error(answer, param).lower()


def _read_until_closed(conn, limit: int = 1 << 16) -> bytes:
    """What the server sends before it closes (the head and body of an answer may arrive apart)."""
    got = b""
    while len(got) < limit:
        try:
            part = conn.recv(4096)
        except OSError:  # reset after the answer: what came before it stands
            break
        if not part:
            break
        got += part
    return got


def _send_slowly(s: Hooked, head: bytes, chunks, stop: threading.Event) -> bytes:
    """Send `head` then `chunks` until the server answers (or closes); its first bytes."""
    conn = s.raw()
    try:
        conn.sendall(head)
        for chunk in chunks:
            if stop.is_set():
                break
            try:
                conn.sendall(chunk)
            except OSError:  # the server answered and closed
                break
        conn.settimeout(REQUEST_TIMEOUT_S)
        return _read_until_closed(conn)
    finally:
        conn.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_100_mb_body_is_413_and_health_answers_meanwhile(guarded, chunked):
    """Judged from Content-Length at once, or after reading no more than the cap (chunked)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    piece = b"x" * (64 << 10)
    if chunked:
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        chunks = (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(100 * 16))
    else:
        head += b"Content-Length: %d\r\n\r\n" % (100 << 20)
        chunks = (piece for _ in range(100 * 16))
    stop, answer = threading.Event(), []
    sender = threading.Thread(target=lambda: answer.append(_send_slowly(guarded, head, chunks, stop)))
    sender.start()
    try:
        assert guarded.health() == 200
    finally:
        sender.join(timeout=REQUEST_TIMEOUT_S)
        stop.set()
    assert answer and answer[0].startswith(b"HTTP/1.1 413"), answer
    assert b"--max-body-bytes" in answer[0]
    assert guarded.health() == 200


def test_a_client_that_writes_its_whole_body_first_reads_the_413(guarded):
    """http.client sends all 40 MB before it reads: the server drains what it will not read (a
    lingering close) instead of resetting the connection under the answer (issue 44, item 1)."""
    import http.client

    host, port = guarded.address()
    conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body=b"x" * (40 << 20), headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        assert answer.status == 413
        assert b"--max-body-bytes" in answer.read()
    finally:
        conn.close()
    assert guarded.health() == 200


def test_slow_clients_are_capped_and_cut_and_health_answers(guarded):
    """More clients than --max-connections that never finish their headers: those over the cap get
    503 at once, the rest are cut at --header-timeout-s; a body that never finishes gets 408."""
    slow = [guarded.raw() for _ in range(CONNECTIONS + 8)]
    try:
        for c in slow:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        answers = []
        for c in slow:
            try:
                answers.append(c.recv(4096))
            except OSError:
                answers.append(b"")
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        cut = [a for a in answers if a == b""]
        assert len(refused) >= 8 and len(refused) + len(cut) == len(slow), answers
    finally:
        for c in slow:
            c.close()
    conn = guarded.raw()
    try:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        assert conn.recv(4096).startswith(b"HTTP/1.1 408")
    finally:
        conn.close()
    guarded.wait_for(lambda: guarded.health() == 200, timeout_s=30)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST\r\n\r\n",
        b"GET /v1/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n",
    ],
    ids=["request-line", "path-utf8", "content-length", "1mb-header"],
)
def test_malformed_http_is_a_json_400_the_client_can_read(guarded, request_bytes):
    """Requests h11 cannot parse get OpenAI's JSON error body, not uvicorn's plain text, and the
    connection is drained before it closes: a client still sending (a 1 MB header line, cut at h11's
    16 KiB) reads the answer instead of a reset."""
    conn = guarded.raw()
    try:
        conn.sendall(request_bytes)
        conn.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
    finally:
        conn.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, got[:300]
    assert "malformed HTTP request" in one_line_error(json.loads(body))


def test_openapi_document_and_schemathesis(guarded, tmp_path):
    """schemathesis against the live server: no 5xx, every answer as /openapi.json says."""
    status, text = guarded.get("/openapi.json")
    assert status == 200 and json.loads(text)["openapi"].startswith("3.")
    run = subprocess.run(
        [
            *(sys.executable, "-m", "schemathesis.cli", "run", guarded.url + "/openapi.json"),
            *("--checks", "not_a_server_error,status_code_conformance,content_type_conformance"),
            *("--checks", "response_schema_conformance"),
            *("--phases", "fuzzing", "--max-examples", "15", "--seed", "33", "--workers", "1"),
            *("--mode", "all", "--no-color", "--max-time", "30", "--request-timeout", "60"),
            *("--report-dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,  # schemathesis keeps a cache of crashes in its working directory
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert guarded.health() == 200


ids = st.integers(min_value=-(2**70), max_value=2**70) | st.integers(min_value=0, max_value=300)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(ids, max_size=90),
    max_tokens=st.none() | st.integers(min_value=-3, max_value=90) | st.integers(),
    temperature=st.none() | st.floats(allow_nan=False, allow_infinity=False) | st.just(1e-300),
    top_p=st.none() | st.floats(allow_nan=False, allow_infinity=False) | st.just(1e-300),
    top_k=st.none() | st.integers(min_value=-5, max_value=400) | st.integers(),
    n=st.none() | st.integers(min_value=-1, max_value=20),
    seed=st.none() | st.integers().filter(lambda s: s not in HOOK_SEEDS),
    penalty=st.none() | st.floats(allow_nan=False, allow_infinity=False),
)
def test_token_inputs_end_in_200_or_400(guarded, prompt, max_tokens, temperature, top_p, top_k, n, seed, penalty):
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "n": n,
        "seed": seed,
        "presence_penalty": penalty,
    }
    status, answer = guarded.post("/v1/completions", json.dumps(body, allow_nan=False).encode())
    assert status in (200, 400), answer
    if status == 400:
        one_line_error(answer)


def test_sigterm_mid_stream_ends_it_with_a_final_chunk_and_exits_0(guarded):
    """The last test of `guarded`: a stream still open when the grace ends gets finish_reason and
    [DONE]; meanwhile new requests get 503; the process exits 0."""
    lines: list[str] = []
    started = threading.Event()

    def read():
        req = urllib.request.Request(
            guarded.url + "/v1/completions",
            data=json.dumps(
                {
                    "model": MODEL,
                    "prompt": "Hi",
                    "stream": True,
                    "max_tokens": 60,
                    "temperature": 1.0,
                    "seed": SLOW_SEED,
                }
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            for line in r:
                if line.startswith(b"data: "):
                    lines.append(line.decode().strip())
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(REQUEST_TIMEOUT_S)
    guarded.proc.send_signal(15)
    guarded.wait_for(lambda: complete(guarded)[0] == 503, timeout_s=30)
    reader.join(timeout=REQUEST_TIMEOUT_S)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "cancelled"
    assert guarded.proc.wait(timeout=60) == 0, guarded.proc.stderr.read() if guarded.proc.stderr else ""


@pytest.fixture(scope="module")
def doomed(aoti_bundle):
    s = Hooked(aoti_bundle, "--watchdog-s", "1", fault=f"stall={STALL_SEED},thread={DEATH_SEED}")
    yield s
    s.stop()


def test_watchdog_reports_a_stalled_engine(doomed):
    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(complete(doomed, temperature=1.0, seed=STALL_SEED)[0]))
    t.start()
    try:
        doomed.wait_for(lambda: doomed.health() == 503, timeout_s=30)
    finally:
        t.join(timeout=REQUEST_TIMEOUT_S)
    assert done == [200]
    doomed.wait_for(lambda: doomed.health() == 200, timeout_s=30)


def test_engine_thread_death_is_503_then_a_nonzero_exit(doomed):
    status, answer = complete(doomed, temperature=1.0, seed=DEATH_SEED)
    assert status == 500 and "engine stopped" in one_line_error(answer)
    assert doomed.health() == 503
    assert complete(doomed)[0] == 503
    assert doomed.proc.wait(timeout=60) != 0
    err = doomed.proc.stderr.read() if doomed.proc.stderr else ""
    assert err.strip().splitlines()[-1].startswith("error: deepinfer-serve: the engine stopped"), err


def test_a_failing_chat_template_is_400(exported_bundle_12, tmp_path):
    """A bundle whose chat template divides by zero, or recurses without end: each chat request gets a
    one-line 400 naming the template, and the server goes on (a copy of the bundle with its template
    rewritten, loaded with --no-verify: its digests no longer match)."""
    import shutil

    from deepinfer.bundles.layout import TOKENIZER_CONFIG_FILE, TOKENIZER_DIR

    bundle = tmp_path / "bundle"
    shutil.copytree(exported_bundle_12, bundle)
    path = bundle / TOKENIZER_DIR / TOKENIZER_CONFIG_FILE
    config = json.loads(path.read_text())
    template = (
        "{% if messages[0].content == 'zero' %}{{ 1 / 0 }}{% endif %}{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}"
    )
    config["chat_template"] = template + "{% if messages[0].content == 'deep' %}{{ f(0) }}{% endif %}ok"
    path.write_text(json.dumps(config))
    s = Server(bundle, "--no-verify")
    try:
        for content, error in (("zero", "ZeroDivisionError"), ("deep", "RecursionError")):
            status, answer = s.post(
                "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}]}
            )
            assert (
                status == 400
                and error in one_line_error(answer, "messages")
                and "chat template" in answer["error"]["message"]
            )
        status, _ = s.post(
            "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        )
        assert status == 200
    finally:
        assert s.stop() == 0

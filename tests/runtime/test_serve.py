"""deepinfer-serve with the `openai` client: a real server process on 127.0.0.1 (port 0, read back
from its first line), every wait bounded, stopped at the end.

Greedy outputs through the server are held to `deepinfer-run --json` on the same bundle (the fp32
AOTInductor bundle without cache quantization, batch bucket 4): sent one at a time and 8 at once
(4 run, 4 wait and join as rows free up)."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from deepinfer.runtime.serving.server_process import ServerProcess

MODEL = "tiny"
START_TIMEOUT_S = 300  # loading the bundle on a busy 2-core machine
REQUEST_TIMEOUT_S = 120
PROMPTS = ["Hello, world", "The quick brown fox", "abc", "1 + 1 =", "Once upon a time", "x", "def f(a):", "GET /"]
NEW = 12


class Server(ServerProcess):
    """The server of these tests, with what they ask of it."""

    def __init__(self, bundle: Path, *args: str):
        super().__init__(bundle, "--model-name", MODEL, "--threads", "1", *args, start_timeout_s=START_TIMEOUT_S)

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=REQUEST_TIMEOUT_S) as r:
            return r.status, r.read().decode()

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
        """POST `body` (bytes as they are, a dict as JSON) -> (status, the JSON answer)."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def wait_for(self, what, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            assert time.monotonic() < deadline, f"timed out after {timeout_s} s"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def server(aoti_bundle):
    s = Server(aoti_bundle, "--max-queue", "16")
    yield s
    assert s.stop() == 0, s.proc.stderr.read()


@pytest.fixture(scope="module")
def expected(aoti_bundle):
    """deepinfer-run --json on PROMPTS, all at once: {prompt: (text, generated ids)}."""
    from deepinfer.runtime.cli import main

    args = [str(aoti_bundle), "--json", "--max-new-tokens", str(NEW)]
    for p in PROMPTS:
        args += ["--prompt", p]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    outputs = json.loads(r.stdout)["outputs"]
    return {p: (o["text"], o["generated_ids"]) for p, o in zip(PROMPTS, outputs)}


def finish_of(ids: list[int]) -> str:
    return "stop" if ids[-1] == 1 else "length"  # eos is the tiny model's id 1


def check(completion, text: str, ids: list[int], prompt_tokens: int):
    choice = completion.choices[0]
    assert choice.text == text
    assert choice.finish_reason == finish_of(ids)
    assert completion.usage.completion_tokens == len(ids)
    assert completion.usage.prompt_tokens == prompt_tokens
    assert completion.usage.total_tokens == prompt_tokens + len(ids)


def test_greedy_completions_equal_deepinfer_run_one_at_a_time_and_concurrently(server, expected):
    client = server.client()
    for p in PROMPTS:
        check(client.completions.create(model=MODEL, prompt=p, max_tokens=NEW), *expected[p], len(p.encode()) + 1)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        out = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=NEW), PROMPTS))
    for p, completion in zip(PROMPTS, out):
        check(completion, *expected[p], len(p.encode()) + 1)
    # token ids as the prompt: bos + bytes + 3, the byte tokenizer's encoding
    ids = [0] + [b + 3 for b in PROMPTS[0].encode()]
    check(client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW), *expected[PROMPTS[0]], len(ids))


def test_streaming_sends_the_same_text_in_pieces(server, expected):
    client = server.client()
    text, ids = expected[PROMPTS[1]]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=NEW, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish_of(ids)
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_chat_uses_the_plain_template_of_the_byte_tokenizer(server):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"  # the documented format
    direct = client.completions.create(model=MODEL, prompt=rendered, max_tokens=NEW)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == direct.choices[0].text
    assert chat.usage.prompt_tokens == len(rendered.encode()) + 1
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == direct.choices[0].text
    assert chunks[-1].choices[0].finish_reason == direct.choices[0].finish_reason


def test_stop_strings_cut_the_text_streamed_or_not(server, expected):
    client = server.client()
    text, _ = expected[PROMPTS[4]]
    stop = next(text[i : i + 2] for i in range(3, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    want = text[: text.find(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=NEW, stop=[stop, "\x00never"])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=NEW, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want


def test_sampling_with_a_seed_repeats_and_top_k_1_is_greedy(server, expected):
    client = server.client()
    text, _ = expected[PROMPTS[2]]
    greedy = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=NEW, temperature=1.5, extra_body={"top_k": 1}, seed=5
    )
    assert greedy.choices[0].text == text
    a, b = (
        client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=NEW, temperature=1.0, seed=11)
        for _ in range(2)
    )
    assert a.choices[0].text == b.choices[0].text


def test_cancelling_mid_stream_frees_the_sequence(server):
    client = server.client()
    cancelled = server.metric('deepinfer_requests_total{outcome="cancelled"}')
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=70, stream=True)
    pieces = iter(stream)
    next(pieces)
    next(pieces)
    stream.close()
    server.wait_for(lambda: server.metric('deepinfer_requests_total{outcome="cancelled"}') == cancelled + 1)
    server.wait_for(
        lambda: server.metric("deepinfer_running_sequences") == 0 and server.metric("deepinfer_kv_blocks_in_use") == 0
    )


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, expected):
    client = server.client()
    status, body = server.post("/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert e.value.body["param"] == "max_tokens" and "-3" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="y" * 100, max_tokens=4)
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "prompt")
    assert "maximum context length is 80 tokens; the prompt has 101" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="y" * 60, max_tokens=30)
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "max_tokens")
    with pytest.raises(openai.BadRequestError, match="n is 17; expected 1 to 16"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=17)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=[0, 10**6], max_tokens=2)
    check(
        client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=NEW),
        *expected[PROMPTS[3]],
        len(PROMPTS[3].encode()) + 1,
    )


def test_models_health_and_metrics(server):
    assert server.get("/health") == (200, '{"status":"ok"}')
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    _, text = server.get("/metrics")
    for name in (
        "deepinfer_requests_total",
        "deepinfer_queue_depth",
        "deepinfer_running_sequences",
        "deepinfer_prompt_tokens_total",
        "deepinfer_generated_tokens_total",
        "deepinfer_kv_blocks_in_use",
        "deepinfer_step_seconds_bucket",
        "deepinfer_time_to_first_token_seconds_bucket",
        "deepinfer_inter_token_latency_seconds_bucket",
    ):
        assert f"\n{name}" in text, name
    assert server.metric("deepinfer_kv_blocks") == 20  # 21 blocks less the scratch block


def test_a_full_queue_answers_429_with_retry_after(aoti_bundle):
    s = Server(aoti_bundle, "--max-queue", "1")
    try:
        client = s.client()
        running = [client.completions.create(model=MODEL, prompt="Hi", max_tokens=70, stream=True) for _ in range(4)]
        for stream in running:  # each has its first token: the batch of 4 is full
            next(iter(stream))
        waiting = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True)
        s.wait_for(lambda: s.metric("deepinfer_queue_depth") == 1)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        assert e.value.response.headers["Retry-After"] == "1" and e.value.body["code"] == "queue_full"
        for stream in running:
            stream.close()
        # the waiting request runs once rows and blocks free up; then the server takes new ones
        assert [c.choices[0].finish_reason for c in waiting][-1] in ("stop", "length")
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.prompt_tokens == 3
    finally:
        assert s.stop() == 0, s.proc.stderr.read()


# --- the text of a stream (no server) ------------------------------------------------------------


def byte_ids(text: str) -> list[int]:
    from deepinfer.regions.tokenizer import ByteTokenizer

    return ByteTokenizer().encode(text, bos=False)


def streamed(text: str, stops: list[str]) -> tuple[list[str], bool, int]:
    """(pieces taken after each token and at the end, stopped, tokens pushed until the stop)."""
    from deepinfer.regions.tokenizer import ByteTokenizer
    from deepinfer.runtime.serving.responses import TextStream

    s = TextStream(ByteTokenizer().decode, stops)
    pieces, pushed = [], 0
    for token in byte_ids(text):
        pushed += 1
        stop = s.push(token)
        pieces.append(s.take())
        if stop:
            break
    pieces.append(s.take(final=True))
    return pieces, s.stopped, pushed


def test_text_stream_waits_for_whole_characters():
    pieces, stopped, _ = streamed("hé€!", [])
    assert "".join(pieces) == "hé€!" and not stopped
    assert pieces[:7] == ["h", "", "é", "", "", "€", "!"]  # é is 2 bytes, € is 3


def test_text_stream_cuts_at_the_first_stop_and_holds_back_a_possible_start():
    pieces, stopped, pushed = streamed("abcSTOPdefEND", ["END", "STOP"])
    assert "".join(pieces) == "abc" and stopped and pushed == len("abcSTOP")
    assert pieces[3:5] == ["", ""]  # "S", "ST" might begin STOP: held back
    pieces, stopped, _ = streamed("abcSTxyz", ["STOP"])
    assert "".join(pieces) == "abcSTxyz" and not stopped and pieces[5] == "STx"
    pieces, _, _ = streamed("tail S", ["STOP"])  # the end releases what was held
    assert pieces[-1] == "S" and "".join(pieces) == "tail S"


def test_speculative_greedy_equals_plain_decoding(run_exported_bundle):
    """deepinfer-serve --speculative dspark on the bundle with the draft compiled in: greedy completions
    (drafted, verified) equal the same server's plain decoding of the same prompts (temperature 1 with
    top_k 1: sampled requests decode plainly, and top-1 sampling draws the argmax), one at a time and
    four at once; drafts were verified."""
    s = Server(run_exported_bundle, "--speculative", "dspark")
    try:
        client = s.client()
        prompts = PROMPTS[:4]

        def complete(p, **kw):
            return client.completions.create(model=MODEL, prompt=p, max_tokens=NEW, **kw).choices[0].text

        plain = {p: complete(p, temperature=1.0, extra_body={"top_k": 1}) for p in prompts}
        assert s.metric("deepinfer_drafted_tokens_total") == 0
        assert complete(prompts[0]) == plain[prompts[0]]
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == [plain[p] for p in prompts]
        assert s.metric("deepinfer_drafted_tokens_total") > 0
    finally:
        assert s.stop() == 0, s.proc.stderr.read()


def test_speculative_needs_a_compiled_draft(aoti_bundle):
    """A bundle compiled without a draft is refused in one line, non-zero, before the server starts."""
    from deepinfer.runtime.serving.cli import main

    r = CliRunner().invoke(main, [str(aoti_bundle), "--speculative", "dspark"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "compiled without a speculative draft" in r.output

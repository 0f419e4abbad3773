"""deepinfer-serve's logprobs and sampling knobs with the `openai` client, and lm-evaluation-harness
against it: a real server process on 127.0.0.1 (port 0, read back from its first line), every wait
bounded.

The references are the bundle's own logits, run by `deepinfer.runtime.generate(..., keep_logits=True)`
in this process on the same bundle (the fp32 AOTInductor bundle, batch bucket 4, one token a step: the
server's steps compute each row exactly as these do), and the test's own arithmetic on them:
log-softmax in float32, OpenAI's penalty definitions, the byte tokenizer's ids (bos 0, eos 1, byte b
is b + 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from .test_serve import MODEL, Server

LM_EVAL_TIMEOUT_S = 600
TASKS = Path(__file__).parent / "lm_eval_tasks"
TOL = 1e-4  # logprobs: the same rows, log-softmax in float32 here and there
BOS, EOS, OFFSET = 0, 1, 3
NEW = 8


@pytest.fixture(scope="module")
def server(aoti_bundle):
    s = Server(aoti_bundle, "--max-queue", "32")
    yield s
    assert s.stop() == 0, s.proc.stderr.read()


@pytest.fixture(scope="module")
def executor(aoti_bundle):
    from deepinfer.runtime import load

    x = load(aoti_bundle)
    yield x
    x.close()


def ids_of(text: str, bos: bool = True) -> list[int]:
    return ([BOS] if bos else []) + [b + OFFSET for b in text.encode()]


def chat_ids(messages: list[dict]) -> list[int]:
    """The byte tokenizer's chat rendering, as docs/serving.md gives it."""
    return ids_of("".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n")


def token_bytes(token: int) -> bytes:
    return bytes([token - OFFSET]) if OFFSET <= token < OFFSET + 256 else b""


def token_text(token: int) -> str:
    data = token_bytes(token)
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def reference(executor, ids: list[int], new: int = 1) -> tuple[list[int], torch.Tensor]:
    """The bundle's greedy continuation of `ids` (up to `new` tokens) and the log-softmax [n, V] of
    every fed position's logits (row j predicts token j + 1)."""
    from deepinfer.runtime import RunOptions, generate

    (out,) = generate(executor, [ids], RunOptions(max_new_tokens=new, keep_logits=True))
    return out.generated, torch.log_softmax(torch.stack(out.logits).float(), -1)


def check_entry(lsm_row: torch.Tensor, token: int, logprob: float, top: dict | list, k: int) -> None:
    assert logprob == pytest.approx(float(lsm_row[token]), abs=TOL)
    values, ids = torch.topk(lsm_row, k)
    if isinstance(top, dict):  # legacy: {token text: logprob}, the likelier of two tokens with one text
        want: dict[str, float] = {}
        for i, v in zip(ids.tolist(), values.tolist()):
            want.setdefault(token_text(i), v)
        assert top == pytest.approx(want, abs=TOL)
    else:
        assert [t["token"] for t in top] == [token_text(i) for i in ids.tolist()]
        assert [t["bytes"] for t in top] == [list(token_bytes(i)) for i in ids.tolist()]
        assert [t["logprob"] for t in top] == pytest.approx(values.tolist(), abs=TOL)


# --- logprobs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_with_echo_equal_the_bundles_logits(server, executor, stream):
    prompt = "Hello, world"
    ids = ids_of(prompt)
    generated, lsm = reference(executor, ids, NEW)
    client = server.client()
    kw = dict(model=MODEL, prompt=prompt, max_tokens=NEW, logprobs=3, echo=True)
    if stream:
        chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in chunks:
            if c.choices[0].logprobs is not None:
                for key in lp:
                    lp[key] += getattr(c.choices[0].logprobs, key)
        assert len([c for c in chunks if c.choices[0].logprobs is not None]) > 1
    else:
        out = client.completions.create(**kw).choices[0]
        text, lp = out.text, out.logprobs.model_dump()
    full = ids + generated
    assert text.startswith(prompt)
    assert lp["tokens"] == [token_text(t) for t in full]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(full)):
        check_entry(lsm[j - 1], full[j], lp["token_logprobs"][j], lp["top_logprobs"][j], 3)
    # bos has no text; each byte token's text begins one character after the last (ASCII here)
    assert lp["text_offset"][:3] == [0, 0, 1]
    assert all(text[lp["text_offset"][j]] == lp["tokens"][j] for j in range(1, len(prompt) + 1))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs_equal_the_bundles_logits(server, executor, stream):
    messages = [{"role": "user", "content": "Say something"}]
    ids = chat_ids(messages)
    generated, lsm = reference(executor, ids, NEW)
    kw = dict(model=MODEL, messages=messages, max_tokens=NEW, logprobs=True, top_logprobs=5)
    client = server.client()
    if stream:
        content = []
        for c in client.chat.completions.create(**kw, stream=True):
            if c.choices and c.choices[0].logprobs is not None:
                content += [e.model_dump() for e in c.choices[0].logprobs.content]
    else:
        content = [e.model_dump() for e in client.chat.completions.create(**kw).choices[0].logprobs.content]
    assert [e["token"] for e in content] == [token_text(t) for t in generated]
    assert [e["bytes"] for e in content] == [list(token_bytes(t)) for t in generated]
    for k, (t, e) in enumerate(zip(generated, content)):
        check_entry(lsm[len(ids) - 1 + k], t, e["logprob"], e["top_logprobs"], 5)


def test_prompt_scoring_max_tokens_0_with_echo(server, executor):
    """What lm-evaluation-harness sends for loglikelihoods: echo, max_tokens 0, logprobs 1."""
    prompt = "The quick brown fox"
    ids = ids_of(prompt)
    _, lsm = reference(executor, ids, 1)
    status, body = server.post(
        "/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1}
    )
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
        "prompt_tokens_details": {"cached_tokens": 0},  # logprobs need every prompt row: never from the cache
    }
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None
    for j in range(1, len(ids)):
        check_entry(lsm[j - 1], ids[j], lp["token_logprobs"][j], lp["top_logprobs"][j], 1)
        greedy = int(lsm[j - 1].argmax()) == ids[j]
        assert (lp["token_logprobs"][j] == max(lp["top_logprobs"][j].values())) == greedy  # lm_eval's is_greedy
    # without logprobs: the prompt back, nothing generated
    status, body = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0})
    assert status == 200 and body["choices"][0]["text"] == prompt and body["choices"][0]["logprobs"] is None


# --- sampling knobs -------------------------------------------------------------------------------


def adjusted_greedy(executor, ids: list[int], new: int, *, presence=0.0, frequency=0.0, bias=None) -> list[int]:
    """Greedy decoding with OpenAI's penalties and a logit bias, one reference run per token."""
    out: list[int] = []
    from deepinfer.runtime import RunOptions, generate

    for _ in range(new):
        (run,) = generate(executor, [ids + out], RunOptions(max_new_tokens=1, keep_logits=True))
        x = run.logits[-1].float().clone()
        counts = torch.zeros_like(x)
        for t in out:
            counts[t] += 1
        x = x - counts * frequency - (counts > 0).float() * presence
        for t, v in (bias or {}).items():
            x[t] += v
        token = int(x.argmax())
        out.append(token)
        if token == EOS:
            break
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_penalties_and_logit_bias_follow_openais_definitions(server, executor, stream):
    prompt = "abc"
    ids = ids_of(prompt)
    plain, lsm = reference(executor, ids, NEW)
    client = server.client()

    def run(**kw) -> str:
        if stream:
            chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, stream=True, **kw)
            return "".join(c.choices[0].text for c in chunks if c.choices)
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, **kw).choices[0].text

    def text(tokens: list[int]) -> str:
        return b"".join(token_bytes(t) for t in tokens).decode(errors="replace")

    # the greedy first token banned: the next best leads
    first = plain[0]
    banned = adjusted_greedy(executor, ids, 3, bias={first: -100.0})
    assert banned[0] != first and banned[0] == int(lsm[len(ids) - 1].topk(2).indices[1])
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logit_bias={str(first): -100})
    assert got.choices[0].text == text(banned)
    want = adjusted_greedy(executor, ids, NEW, presence=1.5, frequency=2.0)
    assert want != plain  # the penalties change something on this prompt
    assert run(presence_penalty=1.5, frequency_penalty=2.0) == text(want)
    assert run(logit_bias={str(ord("z") + OFFSET): 100}) == "z" * NEW


def test_seed_gives_the_same_tokens_alone_and_batched(server):
    client = server.client()

    def sampled(prompt, seed=None):
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=NEW, temperature=1.0, seed=seed
        ).choices[0]

    alone = sampled("Once upon a time", 1234).text
    assert sampled("Once upon a time", 1234).text == alone
    others = ["x", "def f(a):", "GET /", "1 + 1 =", "abc", "Hello"]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(2):
            futures = [pool.submit(sampled, p) for p in others[:3]]
            mine = pool.submit(sampled, "Once upon a time", 1234)
            futures += [pool.submit(sampled, p) for p in others[3:]]
            assert mine.result().text == alone
            for f in futures:
                f.result()
    assert sampled("Once upon a time", 4321).text != alone or sampled("Once upon a time", 99).text != alone


def test_every_signed_64_bit_seed_is_taken_and_its_choices_wrap(server):
    """2**63 - 1 was refused as not a signed 64-bit integer (the bound left room for seed + i of n
    choices); choice i draws from seed + i wrapped as 64-bit integers add: 2**63 - 1 + 1 is -2**63."""
    client = server.client()
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=NEW, temperature=1.0)
    top, bottom = 2**63 - 1, -(2**63)
    both = [c.text for c in client.completions.create(**kw, seed=top, n=2).choices]
    assert both == [client.completions.create(**kw, seed=s).choices[0].text for s in (top, bottom)]
    for seed in (2**63, bottom - 1):
        status, body = server.post("/v1/completions", {**kw, "seed": seed})
        assert status == 400 and body["error"]["param"] == "seed", body


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_each_their_own_sequence(server, stream):
    client = server.client()
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=NEW, temperature=1.0, seed=7)
    single = [client.completions.create(**{**kw, "seed": 7 + i}).choices[0].text for i in range(3)]
    if stream:
        texts = ["", "", ""]
        reasons: dict[int, str] = {}
        usage = None
        for c in client.completions.create(**kw, n=3, stream=True, stream_options={"include_usage": True}):
            for ch in c.choices:
                texts[ch.index] += ch.text
                if ch.finish_reason:
                    reasons[ch.index] = ch.finish_reason
            usage = c.usage or usage
        assert sorted(reasons) == [0, 1, 2]
    else:
        out = client.completions.create(**kw, n=3)
        assert [c.index for c in out.choices] == [0, 1, 2]
        texts, usage = [c.text for c in out.choices], out.usage
    assert texts == single  # choice i draws from seed + i
    assert len(set(texts)) > 1
    assert usage.completion_tokens <= 3 * NEW and usage.completion_tokens > NEW
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, temperature=0
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_spanning_tokens_are_cut_with_their_logprobs(server, executor, stream):
    # a stop string of 2 characters, each its own token (byte tokenizer), from a greedy continuation
    for prompt in ("Once upon a time", "Hello, world", "The quick brown fox", "abc"):
        generated, _ = reference(executor, ids_of(prompt), 12)
        full = b"".join(token_bytes(t) for t in generated).decode(errors="replace")
        found = [full[i : i + 2] for i in range(2, len(full) - 2) if full[i : i + 2].isascii()]
        if found:
            break
    stop = found[0]
    want = full[: full.find(stop)]
    client = server.client()
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, stop=[stop, "\x00never"], logprobs=0)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
        assert all(stop not in c.text for c in chunks)
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        reason = chunks[-1].finish_reason
    else:
        out = client.completions.create(**kw).choices[0]
        text, tokens, reason = out.text, out.logprobs.tokens, out.finish_reason
    assert text == want and reason == "stop"
    # the tokens whose text begins before the stop string: one byte, one character each while ASCII
    ascii_ = len(want.encode()) == len(want)
    assert "".join(tokens) == want if ascii_ else "".join(tokens).startswith(want[:1])


@pytest.mark.parametrize(
    "path, extra, param, words",
    [
        (
            "/v1/completions",
            {"stream": True, "stream_options": {"include_usage": "no"}},
            "stream_options",
            "include_usage",
        ),
        (
            "/v1/completions",
            {"stream": True, "stream_options": {"include_usage": 1}},
            "stream_options",
            "include_usage",
        ),
        ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": "false"}}, "stream_options", ""),
        ("/v1/completions", {"stream": True, "stream_options": False}, "stream_options", "expected an object"),
        ("/v1/completions", {"stream": True, "stream_options": ""}, "stream_options", "expected an object"),
        ("/v1/completions", {"stream": "true"}, "stream", "boolean"),
        ("/v1/completions", {"stream": 1}, "stream", "boolean"),
        ("/v1/completions", {"echo": 1}, "echo", "boolean"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "boolean"),
        ("/v1/completions", {"best_of": True}, "best_of", "integer"),
    ],
)
def test_a_boolean_is_true_or_false_not_a_string_or_a_number(server, path, extra, param, words):
    """`stream_options.include_usage: "no"` was taken as true (any truthy value was), `stream_options:
    false` as none given, `best_of: true` as 1."""
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    status, body = server.post(path, {**base, **extra})
    assert status == 400, (extra, body)
    assert body["error"]["param"] == param and words in body["error"]["message"], (extra, body)


@pytest.mark.parametrize(
    "path, extra, shown",
    [
        ("/v1/completions", {"logprobs": True}, "logprobs is true; expected an integer"),
        ("/v1/completions", {"model": None}, 'The model null does not exist; this server serves "tiny"'),
        ("/v1/completions", {"model": "gpt-4"}, 'The model "gpt-4" does not exist'),
        ("/v1/completions", {"echo": "yes"}, 'echo is "yes"; expected a boolean'),
        ("/v1/completions", {"stop": [None]}, "stop is [null]; expected"),
        ("/v1/completions", {"logit_bias": {"5": False}}, 'logit_bias["5"] is false; expected'),
        ("/v1/completions", {"stream_options": [True]}, "stream_options is [true]; expected an object"),
        ("/v1/completions", {"response_format": {"type": "yaml", "x": None}}, 'response_format is {"type": "yaml"'),
        ("/v1/chat/completions", {"tool_choice": "required"}, 'tool_choice is "required" but the request has no'),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "a"}}], "parallel_tool_calls": None},
            "parallel_tool_calls is null; expected a boolean",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "a"}}],
                "tool_choice": {"type": "function", "function": {"name": "b"}},
            },
            'names the function "b", which',
        ),
        ("/v1/completions", {"model": "x" * 1000}, 'The model "' + "x" * 196 + "... does not exist"),
    ],
)
def test_refusals_show_the_values_as_json(server, path, extra, shown):
    """Error messages printed Python values (`logprobs is True`, `The model None does not exist`); they
    show JSON (true, null, quoted strings), a long value cut."""
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    status, body = server.post(path, {**base, **extra})
    assert status == 400 and shown in body["error"]["message"], (extra, body)


def test_invalid_fields_get_400_naming_the_param_and_the_server_keeps_serving(server):
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    cases = [
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"n": 17}, "n"),
        ("/v1/completions", {"n": "2"}, "n"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"frequency_penalty": "high"}, "frequency_penalty"),
        ("/v1/completions", {"logit_bias": {"1000000": 5}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"abc": 5}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": [5]}, "logit_bias"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
        ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/completions", {"seed": "1"}, "seed"),
        ("/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ]
    for path, extra, param in cases:
        status, body = server.post(path, {**(chat if "chat" in path else completion), **extra})
        assert status == 400, (extra, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param, (extra, body)
    status, body = server.post("/v1/completions", {**completion, "logit_bias": {"1000000": 5}})
    assert '"1000000"' in body["error"]["message"]
    status, body = server.post("/v1/completions", completion)
    assert status == 200 and body["usage"]["completion_tokens"] == 2


# --- lm-evaluation-harness ------------------------------------------------------------------------


def test_lm_eval_local_completions_runs_offline_and_its_loglikelihoods_are_the_bundles(server, executor, tmp_path):
    """lm_eval's local-completions model against the server (its tokenizer through the server's
    /tokenize: the remote backend, nothing fetched): a generate_until task and a multiple_choice one
    over local JSONL; the loglikelihoods it logs equal the bundle's log-softmax over each continuation."""
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    args = (
        f"model={MODEL},base_url={server.url}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,"
        "max_length=80,num_concurrent=1,max_retries=1,timeout=120"
    )
    start = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            args,
            "--tasks",
            "deepinfer_tiny_gen,deepinfer_tiny_mc",
            "--include_path",
            str(TASKS),
            "--limit",
            "4",
            "--log_samples",
            "--output_path",
            str(tmp_path / "out"),
        ],
        cwd=TASKS,
        env=env,
        capture_output=True,
        text=True,
        timeout=LM_EVAL_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    print(f"lm_eval ran in {time.monotonic() - start:.1f} s")
    samples = {
        task: [json.loads(line) for f in (tmp_path / "out").rglob(f"samples_{task}_*.jsonl") for line in open(f)]
        for task in ("deepinfer_tiny_gen", "deepinfer_tiny_mc")
    }
    assert len(samples["deepinfer_tiny_gen"]) == 4
    for s in samples["deepinfer_tiny_gen"]:
        assert isinstance(s["resps"][0][0], str)
    assert len(samples["deepinfer_tiny_mc"]) == 4
    checked = 0
    for s in samples["deepinfer_tiny_mc"]:
        for arguments, resp in zip(s["arguments"].values(), s["resps"]):
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            assert context == context.rstrip()  # no whitespace moved between them
            ids = ids_of(context + continuation, bos=False)  # /tokenize without special tokens
            _, lsm = reference(executor, ids, 1)
            n = len(ids_of(context, bos=False))
            want = sum(float(lsm[j - 1, ids[j]]) for j in range(n, len(ids)))
            greedy = all(int(lsm[j - 1].argmax()) == ids[j] for j in range(n, len(ids)))
            logprob, is_greedy = resp[0]  # the samples file writes them as strings
            assert float(logprob) == pytest.approx(want, abs=TOL * (len(ids) - n))
            assert str(is_greedy) == str(greedy)
            checked += 1
    assert checked >= 8

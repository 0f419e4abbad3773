"""deepinfer-serve --ray-serve: two replicas of the tiny exported bundle (tests/runtime/conftest.py's
`run_exported_bundle`: batch 4, context 80, blocks of 16) behind one Ray Serve endpoint,
on a real local Ray cluster the test starts (its own head node; every wait bounded).

The `openai` client completes and streams through the endpoint; a conversation's second turn reaches
the replica that holds its prefix (`cached_tokens`); a replica killed mid-run ends each of its
requests with one error naming it while the other replica keeps serving, and Ray Serve brings it
back. An endpoint autoscaled between 1 and 2 replicas (its delays short: the options exist for this)
adds the second replica under a load of slow streams, new streams reach it, every stream finishes, and
it goes back to one replica once the load ends. One endpoint runs at a time (`Endpoints`): Ray Serve's
proxy and the application's name are the cluster's. The pure parts (the affinity ranking, the argument
filter, the prompt's text) run without Ray."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepinfer.runtime.serving import ray_serve
from deepinfer.runtime.serving.server_process import RayServeProcess, free_port

START_TIMEOUT_S = 600  # two replicas loading the bundle on a busy 2-core machine
REQUEST_TIMEOUT_S = 120
MODEL = "tiny"
# Ray Serve's proxy must answer its readiness check in 5 s and its health check in 10 s (3 misses: it is
# replaced), which a machine busy with compiles misses: the cluster the test starts waits a minute
SLOW_SEED = 7  # a stream with this seed makes its replica's steps slow: it is still running when killed
SLOW_MACHINE = ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S")
# the autoscaled endpoint: Ray Serve's delays cut from 30 s up and 600 s down to seconds, and its window
# from 30 s to 12 (more than the 10 s at which the ingress's handle reports its requests in flight)
AUTOSCALED = ("--min-replicas", "1", "--max-replicas", "2", "--upscale-delay-s", "0")
AUTOSCALED += ("--downscale-delay-s", "5", "--scaling-window-s", "12")
LOAD = 12  # slow streams kept in flight: more than one replica's target of ray_serve.TARGET_ONGOING (8)
LOAD_TOKENS = 16  # each stream's tokens: short, so that the load's streams end soon after it stops


# --- without Ray ------------------------------------------------------------------------------------


def replica(name: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


def test_a_prompt_has_one_home_and_keeps_it_while_its_replica_lives():
    replicas = [replica(n) for n in "abcd"]
    idle = {r.replica_id.unique_id: 0 for r in replicas}
    fresh = ray_serve.Affinity()

    def rank(prompt, live, loads, affinity=fresh):
        return ray_serve.rank_replicas(prompt, live, lambda r: loads[r.replica_id.unique_id], affinity, imbalance=2)

    homes = {}
    for i in range(40):
        prompt = f"conversation {i:02d}: the system prompt every turn repeats, then the turns. " * 2
        first, rest = rank(prompt, replicas, idle)
        assert len(first) == 1 and sorted(map(id, first + rest)) == sorted(map(id, replicas))
        homes[prompt] = first[0]
        assert rank(prompt[:64] + " and a later turn", replicas, idle)[0] == first  # its first 64 characters
    assert len({id(h) for h in homes.values()}) == 4  # 40 prompts spread over the 4 replicas
    gone = replicas[1]
    for prompt, home in homes.items():  # a replica goes: only its prompts move
        after = rank(prompt, [r for r in replicas if r is not gone], idle)[0][0]
        assert after is home or home is gone
    prompt = next(iter(homes))
    busy = {**idle, homes[prompt].replica_id.unique_id: 3}
    (ordered,) = rank(prompt, replicas, busy)  # its home 3 beyond the least loaded: by load
    assert ordered[-1] is homes[prompt]
    assert rank(None, replicas, idle) == [replicas]  # no prompt: least loaded first


def test_a_short_conversation_follows_where_its_first_turn_went():
    """Prompts shorter than a key's 64 characters differ in their last turn: the table, not the hash,
    sends the second turn where the first went; the longest shared prefix wins."""
    replicas = [replica(n) for n in "ab"]
    idle = {"a": 0, "b": 0}
    affinity = ray_serve.Affinity()

    def home(prompt):
        return ray_serve.rank_replicas(prompt, replicas, lambda r: idle[r.replica_id.unique_id], affinity, 8)[0][0]

    system = "S" * 64
    affinity.routed(ray_serve.prefix_keys(system + "x" * 64 + "first turn"), "b")
    affinity.routed(ray_serve.prefix_keys(system + "y"), "a")
    assert home(system + "x" * 64 + "second turn").replica_id.unique_id == "b"  # 128 shared characters
    assert home(system + "z").replica_id.unique_id == "a"  # 64 shared: the latest to take them
    small = ray_serve.Affinity(most=3)
    small.routed(ray_serve.prefix_keys("p" * 200), "a")  # 4 keys: the oldest dropped
    assert len(small.table) == 3 and ray_serve.prefix_keys("p" * 200)[0] not in small.table


def test_the_prompt_text_of_completions_and_chats():
    assert ray_serve.prompt_text(b'{"prompt": "Hi", "stream": true}') == ("Hi", True)
    assert ray_serve.prompt_text(b'{"prompt": [5, 6, 7]}') == ("5 6 7", False)
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"text": "Hi"}]}]}
    assert ray_serve.prompt_text(json.dumps(chat).encode()) == ("system: Be brief.\nuser: Hi\n", False)
    assert ray_serve.prompt_text(b"not json") == (None, False)
    assert ray_serve.prompt_text(b"[1, 2]") == (None, False)


def test_a_replica_takes_the_options_but_the_endpoints_and_rays():
    argv = ["build/tiny", "--ray-serve", "auto", "--replicas=3", "--port", "8000", "--host=0.0.0.0"]
    argv += ["--model-name", "tiny", "--max-queue", "8", "--no-prefix-cache", "--replica-cpus", "2"]
    argv += ["--min-replicas", "1", "--upscale-delay-s", "0", "--downscale-delay-s=5", "--scaling-window-s", "12"]
    valued = {"--model-name", "--max-queue"}
    assert ray_serve.replica_args(argv, valued) == ["--model-name", "tiny", "--max-queue", "8", "--no-prefix-cache"]
    assert ray_serve.replica_args(["--model-name", "m", "b"], valued) == ["--model-name", "m"]


def test_the_scaling_window_must_outlast_the_ingress_reporting_interval(tmp_path):
    """Ray Serve averages what the ingress reports every 10 s: a window of 10 s or less is refused, in one line."""
    from click.testing import CliRunner

    from deepinfer.runtime.serving.cli import main

    argv = [str(tmp_path), "--ray-serve", "local", "--min-replicas", "1", "--scaling-window-s", "10"]
    refused = CliRunner().invoke(main, argv)
    assert refused.exit_code == 2 and "'--scaling-window-s': 10.0 is not in the range x>10" in refused.output


def relayed(chunks: list[bytes], fail: Exception | None = None, events: bool = True) -> list[str]:
    """What the ingress forwards of a replica's body that comes in `chunks`, then raises `fail`: its events."""
    import asyncio

    async def replica():
        for chunk in chunks:
            yield chunk
        if fail is not None:
            raise fail

    async def forwarded():
        return b"".join([part async for part in ray_serve.relay(replica(), "r1", events)])

    return asyncio.run(forwarded()).decode().split("\n\n")


def test_the_ingress_forwards_whole_events_and_ends_a_cut_stream_with_one_error():
    one, two, done = 'data: {"n": 1}', 'data: {"n": 2}', "data: [DONE]"
    whole = f"{one}\n\n{two}\n\n".encode()
    assert relayed([whole[:5], whole[5:20], whole[20:], f"{done}\n\n".encode()]) == [one, two, done, ""]
    died = RuntimeError("The actor died unexpectedly")
    for cut in (relayed([whole, b'data: {"n"'], died), relayed([whole[:20], whole[20:], b'data: {"n": 3'])):
        assert cut[:2] == [one, two] and cut[-1] == "" and len(cut) == 4  # the partial third event: dropped
        error = json.loads(cut[2].removeprefix("data: "))["error"]
        assert error["code"] == "replica_failed" and error["message"].startswith("replica r1 died mid-stream: ")
    assert "RuntimeError: The actor died unexpectedly" in relayed([whole], died)[2]
    assert "ended before [DONE]" in relayed([whole])[2]
    assert relayed([b'{"error": ', b"1}"], events=False) == ['{"error": 1}']  # a refusal's body: as it came


# --- on a Ray cluster ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of one head node with 4 logical CPUs (two replicas of one each)."""
    pytest.importorskip("ray.serve")
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as env:  # the cluster's processes read these: a loaded 2-core machine
        for name in SLOW_MACHINE:
            env.setenv(name, "60")
        env.setenv("DEEPINFER_TEST_FAULT", f"slow={SLOW_SEED}")  # the engine's hook: 0.25 s more a step
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
        yield c.address
        c.shutdown()


class Endpoint(RayServeProcess):
    """`replicas` replicas of `bundle` on the cluster at `address` (with `scaling`, the replicas it starts
    with), with what these tests ask of them."""

    def __init__(self, bundle: Path, address: str, replicas: int, *scaling: str):
        # Ray Serve's proxy binds the port it is given: a port taken meanwhile fails the start, in one line
        super().__init__(bundle, address, replicas, free_port(), "--model-name", MODEL, "--threads", "1", *scaling)

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


class Endpoints:
    """The cluster's one endpoint at a time: asking for another stops the one running (Ray Serve's proxy
    and the application's name are the cluster's), so each endpoint starts once whatever the tests' order."""

    def __init__(self, bundle: Path, address: str):
        self.bundle, self.address = bundle, address
        self.running: Endpoint | None = None
        self.settings: tuple = ()

    def get(self, replicas: int, *scaling: str) -> Endpoint:
        if self.running is None or self.settings != (replicas, *scaling):
            self.stop()
            self.running = Endpoint(self.bundle, self.address, replicas, *scaling)
            self.settings = (replicas, *scaling)
        return self.running

    def stop(self) -> None:
        running, self.running = self.running, None
        if running is not None:
            assert running.stop() == 0


@pytest.fixture(scope="module")
def endpoints(run_exported_bundle, cluster):
    e = Endpoints(run_exported_bundle, cluster)
    yield e
    e.stop()


@pytest.fixture
def endpoint(endpoints):
    """Two replicas, fixed."""
    return endpoints.get(2)


def banned_eos(bundle: Path) -> dict[str, int]:
    """A logit_bias banning the bundle's eos: a stream runs to its max_tokens."""
    from deepinfer.runtime.bundle import open_bundle

    return {str(open_bundle(bundle, verify=False).config.eos_token_id): -100}


def slow_stream(url: str, prompt: str, no_eos: dict, max_tokens: int):
    """A stream whose steps the engine's hook slows (SLOW_SEED), opened: the response (headers read)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "seed": SLOW_SEED}
    body = json.dumps({**body, "logit_bias": no_eos})
    req = urllib.request.Request(
        url + "/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S)


def data_events(body: bytes) -> list[str]:
    return [e for e in body.decode().split("\n\n") if e.startswith("data: ")]


@pytest.mark.slow
def test_completions_and_streams_through_the_endpoint(endpoint):
    client = endpoint.client()
    done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text  # greedy: the same tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.choices[0].message.role == "assistant"
    assert endpoint.health() == {"status": "ok", "replicas_ready": 2, "replicas": 2}


@pytest.mark.slow
def test_a_conversations_second_turn_reaches_the_replica_holding_its_prefix(endpoint):
    client = endpoint.client()
    # 70 characters the turns share after the conversation's number: past the router's first 64-character
    # key, and 4 of the bundle's blocks of 16 tokens (a prompt of 76 tokens of its context of 80)
    system = "A system prompt that every turn repeats, long enough for four blocks. "
    for i in range(4):  # different conversations, most likely on both replicas
        first = client.completions.with_raw_response.create(model=MODEL, prompt=f"{i} {system}One", max_tokens=2)
        second = client.completions.with_raw_response.create(model=MODEL, prompt=f"{i} {system}Two", max_tokens=2)
        assert first.headers[ray_serve.REPLICA_HEADER] == second.headers[ray_serve.REPLICA_HEADER]
        assert second.parse().usage.prompt_tokens_details.cached_tokens >= 48


@pytest.mark.slow
def test_a_killed_replica_ends_its_requests_with_an_error_and_comes_back(endpoint, cluster, run_exported_bundle):
    import ray

    # eos banned: each stream runs to its max_tokens (64 slow steps' worth), still running when its replica is killed
    no_eos = banned_eos(run_exported_bundle)
    streams, served = [], []
    for i in range(16):  # until each replica holds two streams, one event read from each
        r = slow_stream(endpoint.url, f"stream {i} ", no_eos, 64)
        name = r.headers[ray_serve.REPLICA_HEADER]
        if served.count(name) == 2:  # a third on one replica: not needed
            r.close()
            continue
        first = r.readline()  # "data: {...}\n" of the stream's first event (its blank line still to read)
        assert first.startswith(b"data: "), first
        streams.append((r, first))
        served.append(name)
        if len(served) == 4:
            break
    assert len(set(served)) == 2 and len(served) == 4, served  # both replicas hold two streams
    victim = list(dict.fromkeys(served))[-1]  # the replica whose first stream started last
    ray.init(address=cluster, log_to_driver=False)
    try:
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{ray_serve.APP}#{ray_serve.REPLICA}#{victim}", namespace="serve"))
        for (r, first), name in zip(streams, served):
            events = data_events(first + r.read())
            errors = [e for e in events if '"error"' in e]
            if name == victim:  # cut short: one error event naming the replica, last, and no [DONE]
                assert len(errors) == 1 and events[-1] == errors[0] and "data: [DONE]" not in events, events[-2:]
                assert f"replica {victim} died mid-stream" in errors[0], errors
            else:
                assert not errors and events[-1] == "data: [DONE]", events[-2:]
        client = endpoint.client()
        assert client.completions.create(model=MODEL, prompt="after", max_tokens=2).usage.completion_tokens == 2
        deadline = time.monotonic() + START_TIMEOUT_S
        while endpoint.health().get("replicas_ready") != 2:  # Ray Serve replaces the replica
            assert time.monotonic() < deadline, endpoint.health()
            time.sleep(1)
    finally:
        ray.shutdown()


def keep_streaming(url: str, i: int, no_eos: dict, routed: list, finished: list, stop: threading.Event) -> None:
    """Slow streams one after another until `stop`: each one's replica goes to `routed` as it starts,
    (its replica, its events) to `finished` once it ends."""
    n = 0
    while not stop.is_set():
        with slow_stream(url, f"load {i}.{n} ", no_eos, LOAD_TOKENS) as r:
            name = r.headers[ray_serve.REPLICA_HEADER]
            routed.append(name)
            finished.append((name, data_events(r.read())))
        n += 1


def wait_until(done, timeout_s: float, what) -> None:
    """Until `done()`, at most `timeout_s`; failing, with `what()`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what()
        time.sleep(0.5)


@pytest.mark.slow
def test_an_autoscaled_endpoint_adds_a_replica_under_load_and_removes_it_after(endpoints, run_exported_bundle):
    from concurrent.futures import ThreadPoolExecutor

    e = endpoints.get(1, *AUTOSCALED)
    one = {"status": "ok", "replicas_ready": 1, "replicas": 1}
    assert e.health() == one
    hello = e.client().completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2)
    first = hello.headers[ray_serve.REPLICA_HEADER]
    no_eos = banned_eos(run_exported_bundle)
    routed: list[str] = []
    finished: list[tuple[str, list[str]]] = []
    stop = threading.Event()
    with ThreadPoolExecutor(LOAD) as pool:
        load = [pool.submit(keep_streaming, e.url, i, no_eos, routed, finished, stop) for i in range(LOAD)]
        try:  # LOAD streams in flight: Ray Serve adds the second replica, and new streams reach it
            wait_until(lambda: e.health().get("replicas_ready") == 2, START_TIMEOUT_S, e.health)
            wait_until(lambda: set(routed) - {first}, REQUEST_TIMEOUT_S, lambda: (set(routed), e.health()))
        finally:
            stop.set()
        for f in load:
            f.result(timeout=START_TIMEOUT_S)  # a stream's error, raised
    assert len({name for name, _ in finished}) == 2
    for name, events in finished:
        assert events[-1] == "data: [DONE]" and not [x for x in events if '"error"' in x], (name, events[-2:])
    # idle: back to one replica; the one going counts as neither ready nor wanted from when it starts to stop
    seen: list[dict] = []
    wait_until(lambda: seen.append(e.health()) or seen[-1] == one, START_TIMEOUT_S, lambda: seen[-3:])
    two = {**one, "replicas_ready": 2, "replicas": 2}
    assert all(h in (one, two) for h in seen if h), [h for h in seen if h not in (one, two)]

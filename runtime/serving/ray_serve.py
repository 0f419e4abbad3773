"""`deepinfer-serve --ray-serve ADDRESS`: N replicas of the engine behind one endpoint, on Ray Serve.

    client --HTTP--> Ray Serve's proxy --> Ingress --(prefix affinity)--> Replica 1..N
                                                                            `-- deepinfer-serve (child)

Each `Replica` (a Ray Serve replica, one actor) runs one `deepinfer-serve` of the bundle as its child
process on 127.0.0.1 (a multi-rank bundle starts its rank processes there, so a replica's ranks stay
one replica) and forwards requests to it: every route, streaming, refusal and limit is the one server's.
The child dies with its replica (PR_SET_PDEATHSIG), and a replica whose child died fails Ray Serve's
health check, so Ray Serve replaces it.

The `Ingress` takes every request and hands it to a replica through a handle whose request router is
`PrefixAffinityRouter`: a request with a prompt (or messages) goes to the live replica that last took
the longest prefix it shares with an earlier request (prefixes keyed every 64 characters), else to its
first 64 characters' home by rendezvous hashing over the live replicas (a key moves only when its
replica goes), so the turns of a conversation, which repeat its beginning, reach the replica whose
prefix cache holds it; unless that replica has `imbalance` more requests in flight than the least
loaded one, and then least loaded first (as a request without a prompt). Ray's own prefix-aware router
ships with Ray Serve LLM, which needs vLLM or SGLang installed; this one needs neither.

A response names the replica that served it (header `x-deepinfer-replica`). A replica that dies
mid-request (its actor's stream raises in the ingress, or ends before the replica's `[DONE]`): a stream
ends with one error event naming the replica, after the last event the replica sent whole (`relay`); a
request not streamed gets HTTP 502 naming it; new requests go to the live replicas. `GET /health` on
the endpoint: 200 with the replicas ready, 503 while none is.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer.errors import DeepinferError, one_line

APP = "deepinfer"
REPLICA, INGRESS = "Replica", "Ingress"
CHUNK_CHARS = 64  # a prompt's prefixes are keyed at every 64 characters (`prefix_keys`)
MAX_CHUNKS = 64  # up to its first 4,096 characters
MAX_KEYS = 1 << 18  # prefix keys the router remembers (16-byte keys: about 10 MiB with the table)
IMBALANCE = 8  # requests in flight a prompt's replica may have beyond the least loaded one
# requests a replica (or the ingress) takes at once: Ray Serve's default of 5 would hold a batching engine
# below its batch; the engine's own queue (--max-queue, then 429) is what bounds a replica's load
MAX_ONGOING = 1024
TARGET_ONGOING = 8  # with --min/--max-replicas: the requests in flight per replica Ray Serve scales toward
START_TIMEOUT_S = 600.0  # a replica's child loading its bundle
STOP_TIMEOUT_S = 120.0  # deleting the application, its replicas and children, and leaving the cluster
RAY_OPTIONS = (
    "--ray-serve",
    "--replicas",
    "--replica-cpus",
    "--min-replicas",
    "--max-replicas",
    "--upscale-delay-s",
    "--downscale-delay-s",
    "--scaling-window-s",
)
DONE = b"data: [DONE]"  # a stream's last event, from the replica's server
EVENT_STREAM = "text/event-stream"
MAX_EVENT_BYTES = 1 << 20  # the most of a stream's bytes the ingress holds back for an event's blank line
GOING = ("STOPPING", "STOPPED")  # Ray Serve's states of a replica on its way out
REPLICA_HEADER = "x-deepinfer-replica"  # which replica served a response (debugging, tests)
HOST_OPTIONS = ("--host", "--port")  # the endpoint's, not a replica's (its child binds 127.0.0.1:0)


@dataclass(frozen=True)
class Forward:
    """One HTTP request as the ingress hands it to a replica: `prompt` is what the router's affinity
    reads (Ray's routers look for an argument with a `prompt` attribute too)."""

    method: str
    path: str
    query: str
    body: bytes
    content_type: str
    prompt: str | None
    stream: bool


def prompt_text(body: bytes) -> tuple[str | None, bool]:
    """A request body -> (the text its affinity key reads: the prompt, or the messages' roles and text
    in order; None when it has neither), whether it asks for a stream."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None, False
    if not isinstance(doc, dict):
        return None, False
    stream = doc.get("stream") is True
    prompt = doc.get("prompt")
    if isinstance(prompt, list):  # token ids, or a batch of prompts: their first
        prompt = " ".join(map(str, prompt)) if all(isinstance(t, int) for t in prompt) else (prompt or [None])[0]
    if isinstance(prompt, str):
        return prompt, stream
    messages = doc.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):  # OpenAI's content parts: their text
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                parts.append(f"{m.get('role')}: {content}\n")
        return "".join(parts), stream
    return None, stream


def prefix_keys(prompt: str, chunk: int = CHUNK_CHARS, most: int = MAX_CHUNKS) -> list[bytes]:
    """The keys of a prompt's prefixes: of its first chunk, 2 chunks, ... characters (at most `most`;
    a prompt shorter than a chunk: its whole text), each a hash of everything before its end."""
    h = hashlib.blake2b(digest_size=16)
    keys = []
    for i in range(0, min(len(prompt), chunk * most) or 1, chunk):
        h.update(prompt[i : i + chunk].encode())
        keys.append(h.copy().digest())
    return keys


def rendezvous(key: bytes, replica: str) -> int:
    """A key's score for one replica: the highest-scoring live replica is the key's home."""
    return int.from_bytes(hashlib.blake2b(key + replica.encode(), digest_size=8).digest(), "big")


class Affinity:
    """Where prompts' prefixes went: a bounded table from prefix key (`prefix_keys`) to the replica a
    request with that prefix was routed to, the least recently routed dropped first."""

    def __init__(self, most: int = MAX_KEYS):
        from collections import OrderedDict

        self.table: OrderedDict[bytes, str] = OrderedDict()
        self.most = most

    def home(self, keys: list[bytes], live: dict[str, object]):
        """The live replica that took the longest of `keys` last, else the first key's rendezvous home."""
        for key in reversed(keys):
            name = self.table.get(key)
            if name in live:
                return live[name]
        return live[max(live, key=lambda name: rendezvous(keys[0], name))]

    def routed(self, keys: list[bytes], replica: str) -> None:
        for key in keys:
            self.table[key] = replica
            self.table.move_to_end(key)
        while len(self.table) > self.most:
            self.table.popitem(last=False)


def rank_replicas(prompt: str | None, replicas: Sequence, load, affinity: Affinity, imbalance: int) -> list[list]:
    """Ranks of `replicas` (objects with `.replica_id.unique_id`) for a request: its prompt's home
    (`Affinity.home`) first, then the others least loaded first (`load(replica)`: requests in flight);
    least loaded first without a prompt or when the home has more than `imbalance` beyond the least loaded."""
    ordered = sorted(replicas, key=load)
    if prompt is None or not ordered:
        return [ordered]
    home = affinity.home(prefix_keys(prompt), {r.replica_id.unique_id: r for r in replicas})
    if load(home) - load(ordered[0]) > imbalance:
        return [ordered]
    return [[home], [r for r in ordered if r is not home]]


def replica_args(argv: Sequence[str], valued: Collection[str]) -> list[str]:
    """`deepinfer-serve`'s arguments as a replica's child takes them: without the bundle (the first
    positional) and the options of the endpoint and of Ray (`RAY_OPTIONS`, `HOST_OPTIONS`). `valued`:
    the command's options that take a value (the command knows them)."""
    out: list[str] = []
    dropped = RAY_OPTIONS + HOST_OPTIONS
    skip, bundle_seen = False, False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in dropped:
            skip = "=" not in arg
            continue
        if not arg.startswith("-") and not bundle_seen and (not out or out[-1] not in valued):
            bundle_seen = True
            continue
        out.append(arg)
    return out


# --- the replica --------------------------------------------------------------------------------


class Replica:
    """One engine: `deepinfer-serve BUNDLE ARGS` as a child on 127.0.0.1:0, requests forwarded to it."""

    def __init__(self, bundle: str, args: Sequence[str], start_timeout_s: float = START_TIMEOUT_S):
        from ray import serve

        from deepinfer.runtime.serving.server_process import ServerProcess

        self.id = serve.get_replica_context().replica_id.unique_id
        self.server = ServerProcess(bundle, *args, start_timeout_s=start_timeout_s, die_with_parent=True)

    async def __call__(self, f: Forward) -> AsyncIterator:
        """Yields ("head", replica id, status, content type), then the body's chunks as they come."""
        import aiohttp

        url = f"{self.server.url}{f.path}" + (f"?{f.query}" if f.query else "")
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            headers = {"Content-Type": f.content_type} if f.content_type else {}
            async with session.request(f.method, url, data=f.body, headers=headers) as r:
                yield ("head", self.id, r.status, r.headers.get("Content-Type", ""))
                async for chunk in r.content.iter_any():
                    yield chunk

    def check_health(self) -> None:
        """Ray Serve's health check: the child serves (else the replica is replaced)."""
        code = self.server.proc.poll()
        if code is not None:
            raise RuntimeError(f"replica {self.id}: its deepinfer-serve exited with status {code}")

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(timeout_s=10)


# --- the router -----------------------------------------------------------------------------------


def _prompt(pending_request) -> str | None:
    """The prompt text a routed request carries (`Forward.prompt`), if any."""
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "prompt", None)


@functools.cache
def _router_class():
    """`PrefixAffinityRouter`, built once where Ray Serve is installed (the module imports without it)."""
    from ray.serve.request_router import RequestRouter

    class PrefixAffinityRouter(RequestRouter):
        """Ray Serve's request router for the replicas: `rank_replicas` over the replicas' queue lengths."""

        def initialize_state(self, imbalance: int = IMBALANCE, **kwargs):
            self.imbalance, self.affinity = imbalance, Affinity()

        async def choose_replicas(self, candidate_replicas, pending_request=None):
            def load(r) -> int:
                return self.replica_queue_len_cache.get(r.replica_id) or 0

            return rank_replicas(_prompt(pending_request), candidate_replicas, load, self.affinity, self.imbalance)

        def on_request_routed(self, pending_request, replica_id, result) -> None:
            prompt = _prompt(pending_request)
            if prompt is not None:
                self.affinity.routed(prefix_keys(prompt), replica_id.unique_id)

    PrefixAffinityRouter.__module__ = __name__
    PrefixAffinityRouter.__qualname__ = "PrefixAffinityRouter"
    return PrefixAffinityRouter


def __getattr__(name: str):
    if name == "PrefixAffinityRouter":  # Ray Serve imports the router by its path on every node
        return _router_class()
    raise AttributeError(name)


# --- the ingress -----------------------------------------------------------------------------------


class Ingress:
    """Every HTTP request of the endpoint: `/health` answered here, the rest handed to a replica."""

    def __init__(self, replicas):
        self.replicas = replicas.options(stream=True)

    async def __call__(self, request):
        from starlette.responses import JSONResponse, Response, StreamingResponse

        if request.url.path == "/health":
            ready, wanted = replicas_ready()
            body = {"status": "ok" if ready else "unavailable", "replicas_ready": ready, "replicas": wanted}
            return JSONResponse(body, status_code=200 if ready else 503)
        body = await request.body()
        prompt, stream = prompt_text(body)
        f = Forward(
            request.method,
            request.url.path,
            request.url.query,
            body,
            request.headers.get("content-type", ""),
            prompt,
            stream,
        )
        gen = self.replicas.remote(f)
        try:
            _, replica, status, content_type = await gen.__anext__()
        except Exception as e:  # the replica died before it answered
            return JSONResponse(_error(f"the replica died before it answered: {one_line(e)}"), status_code=502)
        if not stream:
            chunks = []
            try:
                async for chunk in gen:
                    chunks.append(chunk)
            except Exception as e:
                return JSONResponse(_error(f"replica {replica} died mid-request: {one_line(e)}"), status_code=502)
            return Response(
                b"".join(chunks), status_code=status, media_type=content_type or None, headers=_served(replica)
            )

        events = relay(gen, replica, status == 200 and content_type.startswith(EVENT_STREAM))
        return StreamingResponse(events, status_code=status, media_type=content_type or None, headers=_served(replica))


async def relay(chunks: AsyncIterator[bytes], replica: str, events: bool) -> AsyncIterator[bytes]:
    """A replica's streamed body as the ingress forwards it. `events` (a 200 `text/event-stream`): whole
    events only, each up to its blank line, so that a replica that fails mid-stream (its generator raises,
    or ends before `[DONE]`) leaves no partial event to run into what follows; the stream then ends with
    one error event naming the replica. Any other body is forwarded as it comes, the error event appended
    if the replica's generator raises."""
    held, done, why = b"", False, None
    try:
        async for chunk in chunks:
            held += chunk
            cut = _whole(held) if events else len(held)
            if cut:
                done = held[:cut].rstrip().endswith(DONE)
                yield held[:cut]
                held = held[cut:]
    except Exception as e:
        why = one_line(e)
    if why is None and events and not done:
        why = "its stream ended before [DONE]"  # the replica's actor went without raising here
    if why is None:
        if held:
            yield held
        return
    yield b"data: " + json.dumps(_error(f"replica {replica} died mid-stream: {why}")).encode() + b"\n\n"


def _whole(held: bytes) -> int:
    """How much of an event stream's held bytes the ingress forwards now: up to its last blank line (the
    events it has whole), or all of them past MAX_EVENT_BYTES (no event of the server's is that long)."""
    if len(held) > MAX_EVENT_BYTES:
        return len(held)
    return held.rfind(b"\n\n") + 2 if b"\n\n" in held else 0


def _served(replica: str) -> dict[str, str]:
    """The response header naming the replica that served it (`REPLICA_HEADER`)."""
    return {REPLICA_HEADER: replica}


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}


def replicas_ready() -> tuple[int, int]:
    """(replicas of the app's Replica deployment running, replicas it wants), from Ray Serve's status.
    A replica stopping (scaled down, or dead and being replaced) is not wanted: it drains, takes nothing new."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or REPLICA not in app.deployments:
        return 0, 0
    states = {str(getattr(state, "value", state)): n for state, n in app.deployments[REPLICA].replica_states.items()}
    wanted = sum(n for state, n in states.items() if state not in GOING)
    return states.get("RUNNING", 0), wanted


# --- the application --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RayServeOptions:
    """How the endpoint runs: `replicas` fixed, or autoscaled between `min_replicas` and `max_replicas`
    toward TARGET_ONGOING requests in flight a replica. Autoscaled, Ray Serve adds a replica once the
    requests in flight, averaged over the last `scaling_window_s`, have asked for more for
    `upscale_delay_s`, and removes one after `downscale_delay_s` of asking for fewer. The defaults are Ray
    Serve's own (30 s, 600 s, 30 s): they ride out bursts. They are options because a replica that takes
    a minute to load may be worth adding sooner, and a test of the scaling must see it happen in seconds.
    The window must be longer than the 10 s at which the ingress's handle reports its requests in flight
    (Ray Serve's `metrics_interval_s`, which it warns about now and will refuse)."""

    address: str  # "auto", "local" (a cluster of this machine, started here) or HOST:PORT
    replicas: int = 2
    replica_cpus: float = 1.0
    min_replicas: int | None = None
    max_replicas: int | None = None
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    scaling_window_s: float = 30.0  # Ray Serve's look_back_period_s
    imbalance: int = IMBALANCE


def build_app(bundle: str, args: Sequence[str], o: RayServeOptions):
    """The Ray Serve application: the ingress bound to the replicas' deployment."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    scaling: dict = {"num_replicas": o.replicas}
    if o.min_replicas is not None or o.max_replicas is not None:
        low = o.min_replicas if o.min_replicas is not None else 1
        high = o.max_replicas if o.max_replicas is not None else max(low, o.replicas)
        scaling = {
            "autoscaling_config": AutoscalingConfig(
                min_replicas=low,
                max_replicas=high,
                initial_replicas=low,
                target_ongoing_requests=TARGET_ONGOING,
                upscale_delay_s=o.upscale_delay_s,
                downscale_delay_s=o.downscale_delay_s,
                look_back_period_s=o.scaling_window_s,
            )
        }
    routing: dict[str, Any] = {  # by path: Ray Serve imports it where the handle routes (the ingress)
        "request_router_class": f"{__name__}.PrefixAffinityRouter",
        "request_router_kwargs": {"imbalance": o.imbalance},
    }
    replica = serve.deployment(
        name=REPLICA,
        ray_actor_options={"num_cpus": o.replica_cpus},
        max_ongoing_requests=MAX_ONGOING,
        request_router_config=RequestRouterConfig(**routing),
        health_check_period_s=2,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=30,
        **scaling,
    )(Replica)
    ingress = serve.deployment(name=INGRESS, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING)(
        Ingress
    )
    return ingress.bind(replica.bind(bundle, list(args)))


def connect(address: str) -> None:
    """Join the Ray cluster at `address` ("auto", HOST:PORT) or, for "local", start one on this machine."""
    import ray

    if address == "local":  # its proxy's checks wait for a machine busy loading the replicas' bundles
        for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
            os.environ.setdefault(name, "60")
        ray.init(include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


def run(bundle, args: Sequence[str], o: RayServeOptions, host: str, port: int, echo) -> None:
    """Serve `bundle` with `o.replicas` replicas on the Ray cluster at `o.address`, the endpoint on
    host:port, until SIGINT or SIGTERM (from the cluster's connection on); then the application is
    deleted (its replicas and their children stop) and Ray Serve shut down, within STOP_TIMEOUT_S. `argv`:
    the arguments each replica's child takes (`replica_args`)."""
    import signal
    import threading

    try:
        import ray.serve  # noqa: F401
    except ImportError as e:
        raise RayServeError(f"--ray-serve needs Ray Serve ({e}): pip install 'ray[serve]'") from None
    connect(o.address)  # first: ray.init installs handlers of its own, which these replace
    stop, failed = threading.Event(), list[BaseException]()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        threading.Thread(target=_start, args=(bundle, args, o, host, port, echo, stop, failed), daemon=True).start()
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _bounded(_shutdown, STOP_TIMEOUT_S)
    if failed:
        raise RayServeError(f"--ray-serve {o.address}: {one_line(failed[0])}")


class RayServeError(DeepinferError):
    """The endpoint could not start on Ray Serve (the cluster, the port, a replica's start): one line."""


def _start(bundle, args, o: RayServeOptions, host: str, port: int, echo, stop, failed: list) -> None:
    """Connect, start Ray Serve's proxy on host:port and run the application; an error stops `run`."""
    from ray import serve

    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(str(bundle.resolve()), args, o), name=APP, route_prefix="/")
        ready, wanted = replicas_ready()
        echo(f"deepinfer-serve: {bundle} on Ray Serve at http://{host}:{port} ({ready} of {wanted} replicas ready)")
    except BaseException as e:
        failed.append(e)
        stop.set()


def _shutdown() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.delete(APP)
        serve.shutdown()
        ray.shutdown()


def _bounded(fn, timeout_s: float) -> None:
    """`fn()` on a thread, waited for at most `timeout_s` (a stop must end)."""
    import threading

    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout_s)

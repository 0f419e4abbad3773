"""`deepinfer-serve`'s HTTP limits, so that no client can hold the server or starve `/health`:

- `guarded_protocol`: uvicorn's h11 connection with a cap on open connections (one over it gets 503
  and is closed; the few just past the cap may still ask `GET /health`) and a deadline for a request's headers, from the connection's start or the
  end of its last response (a client that never finishes them is cut), and a lingering close (a
  connection closed with its request body unread is drained first, so the client reads the answer);
- `Limits`, an ASGI middleware: a body over `max_body_bytes` is refused with 413, from its
  Content-Length or after reading no more than the cap (chunked bodies too); a body must arrive whole
  within `body_timeout_s` (408, then the connection closes); while the server stops (`Gate.stopping`)
  or after its engine has stopped, every request but `/health` gets 503;
- `Stopping`, uvicorn's server with a graceful stop on SIGTERM or SIGINT: new requests get 503, the
  requests in flight have `grace_s` to end, then every one still open is ended (its stream gets a
  final chunk with `finish_reason` and `data: [DONE]`), and the process exits 0. A second signal
  stops at once. An engine whose thread stopped makes the server exit after `DEAD_LINGER_S` (its
  /health answering 503 meanwhile), so that a supervisor restarts it.

The body is read on the event loop in the transport's chunks (never more than the cap), and parsed
off it (`runtime.serving.params.parse_body` in a worker thread): `/health` answers while any of this goes on.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import cast

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from deepinfer.runtime.serving.engine import Engine

DEAD_LINGER_S = 3.0  # after the engine stops, /health answers 503 this long before the process exits
FLUSH_S = 5  # after every request has ended at a stop, what their last chunks get to leave


@dataclass
class Gate:
    """What decides whether the server takes requests: the engine's health and a stop in progress."""

    engine: Engine
    watchdog_s: float | None = None
    stopping: float | None = None  # when a stop signal came (time.monotonic), or None

    def refusal(self) -> str | None:
        """Why a new request is refused (503), or None."""
        if self.stopping is not None:
            return "the server is shutting down"
        if self.engine.dead is not None:
            return f"the engine stopped: {self.engine.dead}"
        return None

    def health(self) -> str | None:
        """Why /health answers 503, or None: a refusal, or a stalled engine (the watchdog)."""
        return self.refusal() or self.engine.health(self.watchdog_s)


def error_json(message: str, type_: str, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


async def respond(send, status: int, body: bytes, close: bool = False) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Limits:
    """The ASGI middleware of the module's docstring, around the Starlette application."""

    def __init__(self, app, gate: Gate, max_body_bytes: int, body_timeout_s: float):
        self.app, self.gate, self.cap, self.timeout_s = app, gate, max_body_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        why = self.gate.refusal()
        if why is not None and scope["path"] != "/health":
            return await respond(send, 503, error_json(why, "service_unavailable", "unavailable"))
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.cap):
            return await self.too_large(send, length.decode("latin-1"))
        body = bytearray()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                why = f"the request body did not arrive within {self.timeout_s:g} s (--body-timeout-s)"
                return await respond(send, 408, error_json(why, "invalid_request_error", "timeout"), close=True)
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.cap:
                return await self.too_large(send, f"over {self.cap}")
            if not message.get("more_body", False):
                break
        return await self.app(scope, replay(bytes(body), receive), send)

    async def too_large(self, send, size: str) -> None:
        why = f"the request body is {size} bytes; the limit is {self.cap} (--max-body-bytes)"
        await respond(send, 413, error_json(why, "invalid_request_error", "body_too_large"), close=True)


def replay(body: bytes, receive):
    """A receive that gives the body read already, then what the connection says (a disconnect)."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


LINGER_S = 5.0  # how long a connection closed with its request unread is drained before it is closed
LINGER_BYTES = 256 << 20  # and how much of it is read and dropped at most


class _Closing:
    """A connection's transport whose close() drains first while the client may still be sending.

    Closing a socket with bytes unread makes the kernel reset the connection, and the reset can reach
    the client before it reads the answer: a client that writes its whole body before reading (Python's
    http.client) saw a broken pipe instead of the 413. So, as nginx's lingering close does, such a
    close half-closes (the answer, then FIN), drops what still arrives, and closes when the client
    ends, after `LINGER_S`, or after `LINGER_BYTES`, whichever comes first."""

    def __init__(self, transport, protocol):
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        if self._protocol.may_still_send():
            self._protocol.linger()
        else:
            self._transport.close()


RAW_ANSWER = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
HEALTH_SPARE = 8  # connections over --max-connections that may still ask GET /health
SPARE_S = 1.0  # what such a connection gets to send its request's headers (at most --header-timeout-s)


class _Guarded(H11Protocol):
    """uvicorn's h11 connection with the cap and header deadline of the module's docstring, and the
    lingering close of `_Closing`; `guarded_protocol` sets its limits.

    The cap spares /health: the `HEALTH_SPARE` connections after the cap may send one request within
    `SPARE_S`; `GET /health` is answered (so that a liveness probe does not restart a server whose
    connections are all held by idle clients), any other request, or none in time, gets the cap's
    503; then the connection closes. One past those takes the place of the oldest that has sent no
    request yet (which gets the 503 at once), or, with none, gets the 503 at once itself."""

    max_connections: int
    header_timeout_s: float
    deadline: asyncio.TimerHandle | None = None
    dropped: int | None = None  # lingering: the bytes dropped since; None while not
    spare: bool = False  # over the cap: /health only (the class's docstring)
    born: float = 0.0  # when it connected (the event loop's clock)
    raw: asyncio.Transport

    def connection_made(self, transport) -> None:
        self.raw = transport  # the socket's own transport; uvicorn's code gets the lingering one
        super().connection_made(cast(asyncio.Transport, _Closing(transport, self)))
        self.born = self.loop.time()
        over = len(self.connections) - self.max_connections
        if over > HEALTH_SPARE and not self.evict_spare():
            return self.refuse()
        if over > 0:
            self.spare = True
            self.app = _health_only(self.app, self.full())
        self.arm()

    def evict_spare(self) -> bool:
        """Refuse the oldest spare connection that has sent no request yet, for this one to take its
        place (idle clients past the cap cannot keep a probe out); False when there is none."""
        mine = [c for c in self.connections if isinstance(c, _Guarded)]
        idle = [c for c in mine if c.spare and c.cycle is None]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.born)
        oldest.spare = False  # refused: no longer a place (it leaves `connections` when it is lost)
        oldest.refuse()
        return True

    def full(self) -> bytes:
        why = f"too many open connections (--max-connections {self.max_connections})"
        return error_json(why, "service_unavailable")

    def refuse(self) -> None:
        """The cap's 503, written raw, and close."""
        body = self.full()
        self.raw.write(RAW_ANSWER % (b"503 Service Unavailable", len(body), body))
        self.raw.close()

    def arm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        timeout_s = min(SPARE_S, self.header_timeout_s) if self.spare else self.header_timeout_s
        self.deadline = self.loop.call_later(timeout_s, self.too_slow)

    def too_slow(self) -> None:
        """The headers' deadline: cut a connection with no request in progress (a spare one: the 503)."""
        if self.cycle is None or self.cycle.response_complete:
            if self.spare and self.cycle is None:
                return self.refuse()
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.spare:  # its one request answered: the place is the next probe's
            self.transport.close()
        elif not self.transport.is_closing() and self.dropped is None:
            self.arm()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a bad request line, Content-Length or chunk size, a path that is
        not UTF-8, headers over h11's 16 KiB): OpenAI's JSON error body, not uvicorn's plain text."""
        body = error_json(f"malformed HTTP request ({msg.rstrip('.')})", "invalid_request_error")
        self.transport.write(RAW_ANSWER % (b"400 Bad Request", len(body), body))
        self.linger()

    def may_still_send(self) -> bool:
        """Whether the client may have bytes on the way: a request body unread, or a broken request."""
        return self.conn.their_state in (h11.SEND_BODY, h11.ERROR)

    def linger(self) -> None:
        raw = self.raw
        if self.dropped is not None or raw.is_closing():  # lingering already, or the client left
            return raw.close()
        self.dropped = 0
        if self.deadline is not None:
            self.deadline.cancel()
        raw.resume_reading()  # uvicorn pauses reading while a body waits for the application
        if raw.can_write_eof():
            raw.write_eof()
        self.loop.call_later(LINGER_S, raw.close)

    def data_received(self, data: bytes) -> None:
        if self.dropped is None:
            return super().data_received(data)
        self.dropped += len(data)
        if self.dropped > LINGER_BYTES:
            self.raw.close()

    def eof_received(self) -> None:
        if self.dropped is not None:  # the client has sent everything: nothing unread is left
            self.raw.close()

    def connection_lost(self, exc) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        super().connection_lost(exc)


def _health_only(app, full: bytes):
    """`app` for GET /health; the cap's 503 (and a close) for anything else."""

    async def health_only(scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD") and scope["path"] == "/health":
            return await app(scope, receive, send)
        return await respond(send, 503, full, close=True)

    return health_only


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """`_Guarded` with these limits."""
    return type("Guarded", (_Guarded,), {"max_connections": max_connections, "header_timeout_s": header_timeout_s})


class Stopping(uvicorn.Server):
    """uvicorn's server with the graceful stop of the module's docstring."""

    def __init__(self, config: uvicorn.Config, gate: Gate, grace_s: float):
        super().__init__(config)
        self.gate, self.grace_s = gate, grace_s
        self.ended = False  # end_all sent
        self.dead_since: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.gate.stopping is None:  # the first signal: stop gracefully (on_tick drives it)
            self.gate.stopping = time.monotonic()
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        now, engine = time.monotonic(), self.gate.engine
        if engine.dead is not None:
            self.dead_since = self.dead_since or now
            if now - self.dead_since > DEAD_LINGER_S:
                self.should_exit = True
        elif self.gate.stopping is not None and not self.should_exit:
            if not engine.busy:
                self.should_exit = True
            elif not self.ended and now - self.gate.stopping > self.grace_s:
                engine.end_all()
                self.ended = True
        return await super().on_tick(counter)

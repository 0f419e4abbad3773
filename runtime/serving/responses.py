"""A generation's output as it leaves `deepinfer-serve`: each choice's text, decoded as its tokens come
and cut at stop strings (`TextStream`, `Choice`, on the engine's thread), then gathered whole
(`collect`) or sent as server-sent events (`sse`), tool calls parsed out of it on the way.

Text leaves as it is decoded (`TextStream`): stop strings are found in the text, which is cut before
the first one, and a streamed delta holds back the text that could still begin a stop string or a
multi-byte character.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepinfer.runtime.requests import Request
from deepinfer.runtime.serving.engine import Engine
from deepinfer.runtime.serving.logprobs import Entry, Recorder
from deepinfer.runtime.serving.params import Params, error_body
from deepinfer.runtime.serving.tool_calls import CallParser


class TextStream:
    """Generated token ids -> text, cut at the first stop string, in deltas safe to send.

    Decoding runs over a window of recent ids (the text of ids[prefix:] less that of
    ids[prefix:read]), so each token costs a few ids' decode, not the whole sequence's; a
    window whose text ends in U+FFFD (a character still incomplete) waits for the next token."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.offsets: list[int] = []  # where each pushed token's text begins

    def push(self, token: int) -> bool:
        """Add a token; True when the text now holds a stop string (the text ends before it)."""
        if self.stopped:
            return True
        self.ids.append(token)
        self.offsets.append(len(self.text))  # a character still incomplete begins at the text's end
        new = self.decode(self.ids[self.prefix :])
        old = self.decode(self.ids[self.prefix : self.read])
        if len(new) > len(old) and not new.endswith("\ufffd"):
            self._append(new[len(old) :])
            self.prefix, self.read = self.read, len(self.ids)
        return self.stopped

    def _append(self, delta: str) -> None:
        start = len(self.text)
        self.text += delta
        cut = None
        for s in self.stops:
            at = self.text.find(s, max(0, start - len(s) + 1))
            if at >= 0 and (cut is None or at < cut):
                cut = at
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True

    def take(self, final: bool = False) -> str:
        """The text not sent yet that is safe to send; `final` (the sequence ended) sends the rest."""
        if final and not self.stopped:
            tail = self.decode(self.ids[self.prefix :])[len(self.decode(self.ids[self.prefix : self.read])) :]
            if tail:
                self._append(tail)
                self.prefix = self.read = len(self.ids)
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._held()
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the text's longest suffix that begins a stop string."""
        for n in range(min(len(self.text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stops):
                return n
        return 0


class Choice:
    """One choice of a request as its sequence runs (on the engine's thread): its text, cut at stop
    strings (`TextStream`), its logprobs (`Recorder`), sent as ("text", index, delta, entries) events
    (each entry with the delta whose text holds its token's start; with `echo`, the prompt's text and
    entries lead the first), then ("done", index, reason, error)."""

    def __init__(self, index: int, p: Params, tokenizer, put: Callable[[tuple], None], echo: tuple[str, list[int]]):
        self.index, self.p, self.put = index, p, put
        self.text = TextStream(tokenizer.decode, p.stops)
        self.recorder = Recorder(p.prompt, p.logprobs, p.echo) if p.logprobs is not None else None
        self.echo_text, self.echo_offsets = echo  # ("", []) without echo
        self.entries: list[Entry] = []
        self.attached = 0  # entries sent
        self.started = False

    def on_token(self, token: int) -> bool:
        if self.text.stopped:
            return True
        stop = self.text.push(token)
        if self.recorder is not None:
            self.entries.append(self.recorder.token(token, len(self.echo_text) + self.text.offsets[-1]))
        if self.p.stream:
            self.send(self.text.take())
        return stop

    def on_finish(self, reason: str, error: str | None) -> None:
        self.send(self.text.take(final=True), final=True)
        self.put(("done", self.index, reason, error))

    def send(self, delta: str, final: bool = False) -> None:
        """Send `delta` with the entries of the tokens whose text begins in what has been sent."""
        if final and not self.text.stopped:
            end = len(self.entries)
        else:
            sent = len(self.echo_text) + self.text.sent
            end = self.attached
            while end < len(self.entries) and self.entries[end].offset < sent:
                end += 1
        items, self.attached = self.entries[self.attached : end], end
        if not self.started:
            self.started = True
            delta = self.echo_text + delta
            if self.recorder is not None and self.p.echo:
                items = self.recorder.prompt_part(self.echo_offsets) + items
        if delta or items:
            self.put(("text", self.index, delta, items))


async def collect(engine: Engine, request, jobs: list[Request], events: asyncio.Queue):
    """Each choice's (text, logprob entries, finish reason, error) once all have finished, or None when
    the client disconnected first (the sequences are then cancelled)."""

    async def gather():
        texts: list[list[str]] = [[] for _ in jobs]
        items: list[list[Entry]] = [[] for _ in jobs]
        done: dict[int, tuple[str, str | None]] = {}
        while len(done) < len(jobs):
            item = await events.get()
            if item[0] == "text":
                texts[item[1]].append(item[2])
                items[item[1]].extend(item[3])
            else:
                done[item[1]] = item[2], item[3]
        return [("".join(texts[i]), items[i], *done[i]) for i in range(len(jobs))]

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({result, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if result.done():
        return result.result()
    result.cancel()
    for job in jobs:
        engine.cancel(job)
    return None


async def sse(
    engine: Engine,
    jobs: list[Request],
    events: asyncio.Queue,
    head: dict,
    chat: bool,
    include_usage: bool,
    usage: Callable[[], dict],
    logprobs: Callable[[list[Entry]], dict | None],
    call_names: set[str] | None = None,
):
    """Server-sent events of one streamed generation, a chunk per choice's delta (its `index`);
    leaving early (the client disconnected, a choice failed) cancels the choices still running.
    With `call_names` (a chat request's tools), each choice's text goes through a `CallParser`: its
    content as it comes (text that may begin a call held back), a call's `tool_calls` delta (index,
    id, type, name) once its opening is whole, then its arguments as they are written."""
    kind = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    chunk = Chunks(kind, chat, include_usage, logprobs)
    parsers = [CallParser(call_names) for _ in jobs] if call_names is not None else None
    finished = 0
    try:
        if chat:
            for i in range(len(jobs)):
                yield chunk(i, None, None, [], first=True)
        while finished < len(jobs):
            item = await events.get()
            if item[0] == "text" and parsers is None:
                yield chunk(item[1], item[2], None, item[3])
                continue
            if item[0] == "text":
                assert parsers is not None  # the branch above took the rest
                for piece in call_chunks(item[1], parsers[item[1]].feed(item[2]), item[3], chunk):
                    yield piece
                continue
            finished += 1
            _, i, reason, error = item
            if reason == "error":
                yield _event(error_body(error, "server_error"))
                yield "data: [DONE]\n\n"
                return
            if parsers is not None:
                for piece in call_chunks(i, parsers[i].end(), [], chunk):
                    yield piece
                if parsers[i].calls and reason == "stop":
                    reason = "tool_calls"
            yield chunk(i, None, reason, [])
        if include_usage:
            yield _event({**kind, "choices": [], "usage": usage()})
        yield "data: [DONE]\n\n"
    finally:
        if finished < len(jobs):
            for job in jobs:
                engine.cancel(job)


def _event(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


@dataclass(frozen=True)
class Chunks:
    """The chunks of one streamed generation (`kind`: its id, object, created and model), a choice's
    delta each: a chat's first (the role), its text, its tool calls (`calls`), or why it finished."""

    kind: dict
    chat: bool
    include_usage: bool
    logprobs: Callable[[list[Entry]], dict | None]

    def __call__(
        self, i: int, text: str | None, reason: str | None, items: list[Entry], first: bool = False, calls=None
    ) -> str:
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            )
            if calls:
                delta = {"tool_calls": calls}  # OpenAI's: one call's delta
            choice = {"index": i, "delta": delta, "logprobs": self.logprobs(items) if items else None}
        else:
            choice = {"index": i, "text": text or "", "logprobs": self.logprobs(items) if items else None}
        choice["finish_reason"] = reason
        return _event({**self.kind, "choices": [choice], **({"usage": None} if self.include_usage else {})})


def call_chunks(i: int, events: list[tuple], items: list[Entry], chunk: Chunks) -> list[str]:
    """The chunks of choice i's `CallParser` events (`items`, its logprob entries, ride the first)."""
    out = []
    for e in events:
        if e[0] == "content":
            out.append(chunk(i, e[1], None, items))
        elif e[0] == "call":
            call = e[2].message()
            call["function"]["arguments"] = ""
            out.append(chunk(i, None, None, items, calls=[{"index": e[1], **call}]))
        else:
            out.append(chunk(i, None, None, items, calls=[{"index": e[1], "function": {"arguments": e[2]}}]))
        items = []
    if items:  # text held back: the entries go now, with no text
        out.append(chunk(i, "", None, items))
    return out

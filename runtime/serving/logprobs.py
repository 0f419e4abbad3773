"""Log-probabilities of tokens for the OpenAI API's `logprobs`: computed on the host from the logits
the leader already has, and written in the chat format or the legacy completions one.

A token's logprob is the log-softmax, in float32, of the model's raw logits at the position that
predicts it: before the temperature, top-k/top-p, penalties and logit bias a request samples with
(vLLM's default, "raw logprobs"). `Recorder` is one choice's: `on_logits` (the scheduler's
`Request.on_logits`, on the engine's thread) keeps the log-softmax rows of positions still to be
generated and, with `echo`, turns each prompt position's row into its entry at once, so no row
outlives the step that emits its token; `token` makes a generated token's entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_TOP_CHAT = 20  # OpenAI's limit on top_logprobs (chat)
MAX_TOP_LEGACY = 5  # OpenAI's limit on logprobs (completions)


@dataclass(frozen=True)
class Entry:
    """One token's logprob (None: the prompt's first token, which nothing predicts), the `top` most
    likely tokens at its position ((id, logprob), most likely first), and where its text begins in
    the text it belongs to."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]
    offset: int


def entries(rows: Tensor, tokens: list[int], top: int) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Log-softmax rows [n, V] (float32) and the token each predicts -> (its logprob, the top `top`)."""
    chosen = rows.gather(1, torch.tensor(tokens, dtype=torch.int64)[:, None])[:, 0].tolist()
    if top == 0:
        return [(lp, ()) for lp in chosen]
    values, ids = torch.topk(rows, min(top, rows.shape[1]), dim=-1)
    return [(lp, tuple(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]


class Recorder:
    """One choice's logprobs as its request runs: the prompt's entries (with `echo`), then one entry
    per generated token (`token`)."""

    def __init__(self, prompt: list[int], top: int, echo: bool):
        self.prompt, self.top, self.echo = prompt, top, echo
        self.prompt_entries: list[tuple[float | None, tuple[tuple[int, float], ...]]] = [(None, ())] if echo else []
        self.pending: dict[int, Tensor] = {}  # a position still to be generated -> its log-softmax row
        self.generated = 0

    def on_logits(self, start: int, rows: Tensor) -> None:
        """Rows [n, V] of positions start .. start + n - 1; row i predicts position start + i + 1."""
        P, first = len(self.prompt), len(self.prompt) + self.generated  # the next position to generate
        targets = range(start + 1, start + 1 + len(rows))
        wanted = [i for i, q in enumerate(targets) if (self.echo and q < P) or q >= first]
        if not wanted:
            return
        lsm = torch.log_softmax(rows[wanted].float(), dim=-1)  # [len(wanted), V]
        prompt_rows = [j for j, i in enumerate(wanted) if targets[i] < P]
        if prompt_rows:
            tokens = [self.prompt[targets[wanted[j]]] for j in prompt_rows]
            self.prompt_entries.extend(entries(lsm[prompt_rows], tokens, self.top))
        for j, i in enumerate(wanted):
            if targets[i] >= P:
                self.pending[targets[i]] = lsm[j]

    def token(self, token: int, offset: int) -> Entry:
        """The entry of the next generated token, whose text begins at `offset` of the generated text."""
        row = self.pending.pop(len(self.prompt) + self.generated)
        self.generated += 1
        ((lp, top),) = entries(row[None], [token], self.top)
        return Entry(token, lp, top, offset)

    def prompt_part(self, offsets: list[int]) -> list[Entry]:
        """The prompt's entries (with `echo`, once the prompt has run), its tokens' text at `offsets`."""
        return [Entry(t, lp, top, o) for t, (lp, top), o in zip(self.prompt, self.prompt_entries, offsets, strict=True)]


def token_text(data: bytes) -> str:
    """A token's text as OpenAI writes it: its bytes as UTF-8, or `bytes:\\xNN...` for part of a character."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def chat_format(items: list[Entry], token_bytes) -> dict:
    """`choices[].logprobs` of a chat completion (or of one streamed chunk)."""

    def one(token: int, logprob: float) -> dict:
        data = token_bytes(token)
        return {"token": token_text(data), "logprob": logprob, "bytes": list(data)}

    return {
        "content": [
            {**one(e.token, e.logprob if e.logprob is not None else 0.0), "top_logprobs": [one(i, v) for i, v in e.top]}
            for e in items
        ],
        "refusal": None,
    }


def legacy_format(items: list[Entry], token_bytes, shift: int = 0) -> dict:
    """`choices[].logprobs` of a completion: tokens, token_logprobs, top_logprobs (a {token: logprob}
    dict each, most likely first: of two tokens with one text the likelier stays; None for the
    prompt's first token) and text_offset (each entry's offset + `shift`)."""
    texts = {e.token: token_text(token_bytes(e.token)) for e in items}
    for e in items:
        for i, _ in e.top:
            if i not in texts:
                texts[i] = token_text(token_bytes(i))
    return {
        "tokens": [texts[e.token] for e in items],
        "token_logprobs": [e.logprob for e in items],
        "top_logprobs": [None if e.logprob is None else _first_of_each(texts, e.top) for e in items],
        "text_offset": [e.offset + shift for e in items],
    }


def _first_of_each(texts: dict[int, str], top: tuple[tuple[int, float], ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for i, v in top:
        out.setdefault(texts[i], v)
    return out

"""Structured output: grammars a request's generated tokens must follow, enforced with token masks.

`deepinfer-serve`'s `response_format` (`json_object`, `json_schema`) and forced tool calls
(`tool_choice: "required"` or a named function, `runtime/serving/tool_calls.py`) become grammars of llguidance
(a maintained grammar engine: JSON Schema and Lark grammars compiled to token masks over a
tokenizer's byte-level vocabulary, in Rust, without a torch or transformers dependency). `Grammars`
is one tokenizer's: its llguidance tokenizer (each token id's bytes, and eos) is built once, `compile`
refuses a grammar the engine cannot enforce (`GrammarError`, the server's 400), `constraint` starts a
matcher for one sequence from a compiled grammar. The scheduler (`runtime/schedule.py`) asks `masks` once a step for every
constrained sequence that picks a token in it, in one call (llguidance's executor), and applies each
mask to that sequence's logits before the pick; sequences without a constraint pay nothing.

The JSON a grammar admits is compact (no whitespace between tokens: a model cannot loop on
whitespace), and an object schema with `properties` but no `additionalProperties` admits no other
keys (JSON Schema would allow them; the output still validates). A grammar that is complete
(nothing but eos can follow) ends its sequence with finish reason `stop`; `max_tokens` reached
first ends it with `length`, its text a prefix of what the grammar admits, as OpenAI does.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
from torch import Tensor

from deepinfer.errors import DeepinferError

# every JSON value compact: no whitespace between tokens, "," and ":" as separators
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT: dict = {"type": "object"}  # response_format json_object


class GrammarError(DeepinferError):
    """A schema or grammar the engine cannot enforce (unsupported or invalid); the message names the problem."""


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` in every object schema that lists `properties` and
    says nothing of other keys (a copy; the caller's is left alone)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_schema(schema: dict) -> dict:
    """The schema a grammar enforces: `closed_objects`, with the compact-JSON options at its top."""
    out = closed_objects(copy.deepcopy(schema))
    out["x-guidance"] = {**out.get("x-guidance", {}), **JSON_OPTIONS}
    return out


def json_grammar(schema: dict) -> str:
    """The llguidance grammar of one JSON value matching `schema` (see `json_schema`)."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json_schema(schema))
    except ValueError as e:
        raise GrammarError(f"the schema is not valid JSON Schema ({e})") from None


def lark_grammar(lark: str) -> str:
    """An llguidance grammar from a Lark grammar (llguidance's dialect: `%json {schema}` embeds a schema)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


SPECIAL_PREFIX = b"\xff"  # llguidance's mark of a special token's bytes: text never matches it


def byte_tokens(tokenizer, vocab: int) -> list[bytes]:
    """Each id's bytes for the byte-level tokenizer (`regions/tokenizer.py`): byte b is id b + 3; bos,
    eos, pad, the image token and the unused ids are special (llguidance's 0xff prefix and a name)."""
    return [
        data
        if (data := tokenizer.token_bytes(i)) and i not in (tokenizer.bos, tokenizer.eos, tokenizer.pad)
        else SPECIAL_PREFIX + f"<|special_{i}|>".encode()
        for i in range(vocab)
    ]


class _ByteWrapper:
    """What llguidance's `TokenizerWrapper` reads of a tokenizer it cannot load itself."""

    def __init__(self, tokenizer, vocab: int, eos: int):
        self.tokenizer = tokenizer
        self.tokens = byte_tokens(tokenizer, vocab)
        self.eos_token_id, self.bos_token_id = eos, tokenizer.bos
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t.startswith(SPECIAL_PREFIX)]

    def __call__(self, text: bytes) -> list[int]:
        return [b + 3 for b in text]


def llguidance_tokenizer(tokenizer, vocab: int, eos: int):
    """The llguidance tokenizer of a bundle's: ids 0 .. vocab - 1 (the model's logits), `eos` the
    model's end of sequence. A `tokenizer.json` goes to llguidance as it is (its byte-level vocabulary
    and added tokens, special ones marked special); the byte-level tokenizer through `byte_tokens`."""
    import llguidance

    if tokenizer.kind == "byte":
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteWrapper(tokenizer, vocab, eos)))
    if tokenizer.kind == "tokenizers":
        return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=eos)
    raise GrammarError(f"structured output does not support the {tokenizer.kind} tokenizer")


class Grammars:
    """One tokenizer's grammar engine: `compile` a grammar, `constraint` for a sequence, `masks` for a batch.
    The llguidance tokenizer is built on first use (a `tokenizer.json`'s takes a moment)."""

    def __init__(self, tokenizer, vocab: int, eos: int, threads: int = 1):
        self.source, self.vocab, self.eos, self.threads = tokenizer, vocab, eos, threads
        self._tokenizer: Any = None
        self._executor: Any = None
        self._lock = threading.Lock()  # requests are checked on the server's worker threads

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._executor = llguidance.LLExecutor(num_threads=self.threads)
                self._tokenizer = llguidance_tokenizer(self.source, self.vocab, self.eos)
        return self._tokenizer

    def compile(self, grammar: str) -> Compiled:
        """`grammar` compiled for this tokenizer (GrammarError naming the problem when it cannot be
        enforced): what `constraint` starts each sequence from, without compiling it again."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Compiled(matcher)

    def constraint(self, grammar: str | Compiled) -> Constraint:
        """A matcher of `grammar` at the start of a sequence's generated tokens."""
        compiled = self.compile(grammar) if isinstance(grammar, str) else grammar
        return Constraint(self, compiled.matcher.deep_copy())

    def masks(self, constraints: list[Constraint]) -> Tensor:
        """The tokens each constraint allows next: bool [len(constraints), vocab], in one call."""
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        bits = allocate_token_bitmask(len(constraints), self.vocab)  # int32 [n, ceil(V / 32)]
        fill_next_token_bitmask_par(self._executor, [(c.matcher, i) for i, c in enumerate(constraints)], bits)
        shifts = torch.arange(32, dtype=torch.int32)
        return ((bits[:, :, None] >> shifts) & 1).reshape(len(constraints), -1)[:, : self.vocab].bool()


class Compiled:
    """A grammar compiled for a tokenizer, its matcher at the start (copied for each sequence)."""

    def __init__(self, matcher):
        self.matcher = matcher


class Constraint:
    """One sequence's grammar as it generates (`runtime.requests.Request.constraint`): `grammars.masks`
    gives the tokens it allows next, `accept` takes the token picked."""

    def __init__(self, grammars: Grammars, matcher):
        self.grammars, self.matcher = grammars, matcher

    def accept(self, token: int) -> bool:
        """Advance over `token` -> whether the grammar is complete (nothing but eos may follow)."""
        if token == self.grammars.eos:
            return True
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not follow the grammar: {self.matcher.get_error()}")
        return self.matcher.is_stopped()

    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

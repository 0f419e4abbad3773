"""`GET /openapi.json`: an OpenAPI 3.0 document of `deepinfer-serve`'s routes, their request bodies and
their answers, refusals included (400, 408, 413, 429, 503; 500 for a generation whose step failed).

Written by hand from `runtime/serving/params.py` and `runtime/serving/routes.py` (what they accept and send); the
tests run schemathesis against a live server with it (no 5xx, every answer matching it).
"""

from __future__ import annotations

from typing import Any

from deepinfer.runtime.serving.logprobs import MAX_TOP_CHAT, MAX_TOP_LEGACY
from deepinfer.runtime.serving.params import MAX_N, MAX_STOPS

JSON = "application/json"


def _nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


NUMBER = {"type": "number"}
INTEGER = {"type": "integer"}
STRING = {"type": "string"}
BOOLEAN = {"type": "boolean"}
TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": STRING,
                "type": STRING,
                "param": _nullable(STRING),
                "code": _nullable(STRING),
            },
        }
    },
}

SAMPLING = {
    "max_tokens": _nullable({"type": "integer", "minimum": 0}),
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1}),
    "top_k": _nullable({"type": "integer", "minimum": -1}),
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}),
    "stop": _nullable(
        {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS},
            ]
        }
    ),
    "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}),
    "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "logit_bias": _nullable(
        {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}
    ),
    "stream": _nullable(BOOLEAN),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": BOOLEAN}}),
    "user": STRING,
}

USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": INTEGER, "completion_tokens": INTEGER, "total_tokens": INTEGER},
}


def _completion(kind: str, choice: dict) -> dict:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": STRING,
            "object": {"type": "string", "enum": [kind]},
            "created": INTEGER,
            "model": STRING,
            "choices": {"type": "array", "items": choice},
            "usage": USAGE,
        },
    }


FINISH = _nullable({"type": "string", "enum": ["stop", "length", "tool_calls", "cancelled"]})
LEGACY_CHOICE = {
    "type": "object",
    "required": ["index", "text", "finish_reason"],
    "properties": {
        "index": INTEGER,
        "text": STRING,
        "finish_reason": FINISH,
        "logprobs": _nullable({"type": "object"}),
    },
}
CHAT_CHOICE = {
    "type": "object",
    "required": ["index", "message", "finish_reason"],
    "properties": {
        "index": INTEGER,
        "message": {
            "type": "object",
            "required": ["role"],
            "properties": {"role": STRING, "content": _nullable(STRING), "tool_calls": {"type": "array"}},
        },
        "finish_reason": FINISH,
        "logprobs": _nullable({"type": "object"}),
    },
}
MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
        "content": (
            {
                "oneOf": [
                    STRING,
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "text"],
                            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": STRING},
                        },
                    },
                ]
            }
        ),
    },
}


def _refusals(*codes: int) -> dict:
    what = {
        400: "A malformed body or a bad field (param names it)",
        408: "The body did not arrive in time",
        413: "The body is over --max-body-bytes",
        429: "The queue is full (Retry-After)",
        500: "A step of the generation failed",
        503: "The server is stopping, its engine stopped, or it holds too many connections",
    }
    return {str(c): {"description": what[c], "content": {JSON: {"schema": ERROR}}} for c in codes}


def _post(summary: str, request: dict, response: dict, stream: bool = True) -> dict:
    ok: dict[str, Any] = {JSON: {"schema": response}}
    if stream:  # server-sent events, each a chunk (or an error) as JSON, the last `[DONE]`
        ok["text/event-stream"] = {"schema": {"type": "object", "properties": {"data": STRING}}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {JSON: {"schema": request}}},
            "responses": {
                "200": {"description": "The result", "content": ok},
                **_refusals(400, 408, 413, 429, 500, 503),
            },
        }
    }


def _get(summary: str, response: dict, media: str = JSON, codes: tuple[int, ...] = (503,)) -> dict:
    return {
        "get": {
            "summary": summary,
            "responses": {
                "200": {"description": summary, "content": {media: {"schema": response}}},
                **_refusals(*codes),
            },
        }
    }


HEALTH = {"type": "object", "required": ["status"], "properties": {"status": STRING}}
MODELS = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": STRING, "data": {"type": "array", "items": {"type": "object"}}},
}
TOKENIZE = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": STRING, "add_special_tokens": BOOLEAN},
}
TOKEN_IDS = {
    "type": "object",
    "required": ["tokens", "count", "max_model_len"],
    "properties": {"tokens": {"type": "array", "items": INTEGER}, "count": INTEGER, "max_model_len": INTEGER},
}
DETOKENIZE = {
    "type": "object",
    "required": ["tokens"],
    "properties": {"tokens": {"type": "array", "items": INTEGER}},
}
TEXT = {"type": "object", "required": ["prompt"], "properties": {"prompt": STRING}}


def _tokenizer_post(summary: str, request: dict, response: dict) -> dict:
    """A tokenizer route's POST: never streamed, never queued (no 429), never generating (no 500)."""
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {JSON: {"schema": request}}},
            "responses": {
                "200": {"description": summary, "content": {JSON: {"schema": response}}},
                **_refusals(400, 408, 413, 503),
            },
        }
    }


def _completion_request(model: str) -> dict:
    """A /v1/completions body for a server serving `model`."""
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string", "enum": [model]},
            "prompt": {"oneOf": [STRING, TOKENS]},
            **SAMPLING,
            "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LEGACY}),
            "echo": _nullable(BOOLEAN),
        },
    }


def _chat_request(model: str) -> dict:
    """A /v1/chat/completions body for a server serving `model`."""
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string", "enum": [model]},
            "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
            **SAMPLING,
            "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
            "logprobs": _nullable(BOOLEAN),
            "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_CHAT}),
            "response_format": _nullable({"type": "object"}),
        },
    }


def document(model: str) -> dict:
    """The OpenAPI document of a server serving `model`."""
    completion, chat = _completion_request(model), _chat_request(model)
    return {
        "openapi": "3.0.3",
        "info": {"title": "deepinfer-serve", "version": "1"},
        "paths": {
            "/v1/completions": _post("A completion", completion, _completion("text_completion", LEGACY_CHOICE)),
            "/v1/chat/completions": _post("A chat completion", chat, _completion("chat.completion", CHAT_CHOICE)),
            "/v1/models": _get("The served model", MODELS),
            "/health": _get("Whether the server takes requests", HEALTH, codes=(503,)),
            "/tokenize": _tokenizer_post("Text as token ids", TOKENIZE, TOKEN_IDS),
            "/detokenize": _tokenizer_post("Token ids as text", DETOKENIZE, TEXT),
            "/tokenizer_info": _get("The tokenizer", {"type": "object"}),
            "/metrics": _get("Prometheus metrics", STRING, "text/plain"),
            "/openapi.json": _get("This document", {"type": "object"}),
        },
    }
